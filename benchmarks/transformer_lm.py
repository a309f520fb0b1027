"""A character-level decoder-only transformer language model trained with
K-FAC and AdamW.

Token and learned position embeddings (d 128), 2 pre-norm blocks (causal
``MultiHeadAttention`` with 4 heads, an MLP 4d with GELU), a final
LayerNorm, and the LM head tied to the token embedding (logits = h E^T);
per-token mean cross-entropy over ``[batch, 64]`` next-character targets on
the help text of ``pydoc_data`` (``char_text.py``), last 10% held out;
batch 32, float32.

Rows: ``kg.KFAC`` for each ``--kfac`` spec (``kfac_spec.py``: e.g.
``"label=reduce dense=kron_reduce"``, ``"label=regular momentum_type=regular"``,
``"label=cosine momentum_type=regular cosine_lr=0.3"``: AdamW's warm-up
and cosine decay over ``--kfac_steps``; ``pullback=own``: the quadratic
model's forms take a backward pass of their own, ``own_pullback.py``) and
AdamW (weight decay 0.01, linear warm-up over ``--warmup`` steps, cosine
decay to 0 at ``--adam_steps``, as transformers are trained) at each
learning rate of a grid. The target is the best AdamW run's held-out loss
after ``--adam_steps`` (``lm_race.py``); the table adds each run's held-out
loss after the same wall time as that AdamW run. The per-example gradient
norms' cost over the batch gradient's is measured apart, side by side.

    python benchmarks/transformer_lm.py [--adam_steps 2000] [--kfac_steps 1000]
        [--lrs 1e-3,3e-3,1e-2] [--kfac "label=NAME key=value ..."]...
        [--plot docs/transformer_lm.png]
"""
import time

import bench_env  # noqa: F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import kfac_graph as kg  # noqa: E402
import char_transformer  # noqa: E402
import kfac_spec  # noqa: E402
import lm_race  # noqa: E402
import own_pullback  # noqa: E402
from char_text import CharText  # noqa: E402

tf.get_logger().setLevel("ERROR")

FLAGS = flags.FLAGS
flags.DEFINE_integer("adam_steps", 2000, "steps of every AdamW run")
flags.DEFINE_integer("kfac_steps", 1000, "steps of every K-FAC run")
flags.DEFINE_integer("seq_len", 64, "context: characters per window")
flags.DEFINE_integer("batch", 32, "windows per batch")
flags.DEFINE_integer("width", 128, "model width d")
flags.DEFINE_integer("heads", 4, "attention heads")
flags.DEFINE_integer("blocks", 2, "transformer blocks")
flags.DEFINE_bool("tied", True, "tie the LM head to the token embedding")
flags.DEFINE_integer("warmup", 100, "AdamW warm-up steps")
flags.DEFINE_list("lrs", ["1e-3", "3e-3", "1e-2"], "AdamW peak learning rates")
flags.DEFINE_multi_string("kfac", ["label=defaults"], "a K-FAC row, repeatable: space-separated "
                          "key=value pairs (kfac_spec.py)")
flags.DEFINE_integer("eval_every", 50, "steps between held-out evaluations")
flags.DEFINE_integer("eval_windows", 128, "held-out windows")
flags.DEFINE_integer("norm_reps", 9, "interleaved rounds timing the norms")
flags.DEFINE_string("plot", None, "write the held-out-loss-vs-time plot here")
flags.DEFINE_integer("seed", 0, "seed of the weights and the batches")


def make_model(vocab):
    return char_transformer.build(vocab, FLAGS.seq_len, FLAGS.width, FLAGS.heads, FLAGS.blocks,
                                  FLAGS.tied, FLAGS.seed)


def make_loss(model):
    def loss_fn(x, y):
        logits = model(x, training=True)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
    return loss_fn


def kfac_run(spec, vocab, held_out):
    spec, own = own_pullback.split_spec(spec)
    label, options = kfac_spec.parse(spec, steps=FLAGS.kfac_steps, warmup=FLAGS.warmup)
    model = make_model(vocab)
    opt = kg.KFAC(kg.auto_register(make_loss(model)), **options)
    run = lm_race.Run(f"K-FAC {label}", "kfac", own_pullback.step_with(opt.step, own),
                      lm_race.evaluator(model, held_out),
                      FLAGS.kfac_steps)
    if opt.momentum_type == "qmodel":  # steps the model's cap shortened (cap_watch.py)
        run.capped = lambda: int(opt.cap_watch.capped_steps)
    return run


def adamw_run(lr, vocab, held_out):
    model = make_model(vocab)
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0, FLAGS.adam_steps - FLAGS.warmup, warmup_target=lr, warmup_steps=FLAGS.warmup)
    optimizer = keras.optimizers.AdamW(schedule, weight_decay=0.01)
    step = lm_race.keras_step(model, make_loss(model), optimizer, jit_compile=True)
    return lm_race.Run(f"AdamW lr={lr:g}", "adamw", step,
                       lm_race.evaluator(model, held_out),
                       FLAGS.adam_steps)


def main(argv):
    del argv
    data = CharText(FLAGS.seq_len)
    steps = max(FLAGS.adam_steps, FLAGS.kfac_steps)
    batches = [tuple(tf.constant(t) for t in b)
               for b in data.batches(steps, FLAGS.batch, FLAGS.seed)]
    held_out = data.held_out_windows(FLAGS.eval_windows)
    runs = [kfac_run(spec, data.vocab_size, held_out) for spec in FLAGS.kfac]
    runs += [adamw_run(float(lr), data.vocab_size, held_out) for lr in FLAGS.lrs]
    start = time.perf_counter()
    lm_race.race(runs, batches, FLAGS.eval_every)
    rows, _, _ = lm_race.table(runs, reference_families=("adamw",))
    model = make_model(data.vocab_size)
    ratio = lm_race.norms_cost(model, kg.auto_register(make_loss(model)), batches[0],
                               FLAGS.norm_reps)
    print(f"\ntransformer LM: {FLAGS.blocks} blocks, d {FLAGS.width}, {FLAGS.heads} heads, "
          f"context {FLAGS.seq_len}, {'tied' if FLAGS.tied else 'untied'} embeddings, "
          f"vocabulary {data.vocab_size}, batch {FLAGS.batch}; {len(data.train):,} training / "
          f"{len(data.test):,} held-out characters\n")
    print(rows)
    print(f"\nper-example gradient norms / batch gradient: {ratio:.2f}")
    for run in runs:
        if getattr(run, "capped", None):
            print(f"{run.label}: the quadratic model's cap shortened {run.capped()} of "
                  f"{FLAGS.kfac_steps} steps")
    print(f"total wall time {time.perf_counter() - start:.0f} s")
    if FLAGS.plot:
        lm_race.plot(runs, FLAGS.plot, "Transformer character LM on pydoc_data.topics")


if __name__ == "__main__":
    app.run(main)
