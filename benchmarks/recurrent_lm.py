"""A character-level LSTM language model trained with K-FAC, Adam and AdamW.

Embedding 64 -> LSTM 256 (Keras's default ``unroll=False``: the pass unrolls
its loop) -> Dense to the vocabulary; per-token mean cross-entropy over
``[batch, 64]`` next-character targets; the help text of ``pydoc_data``
(``char_text.py``), last 10% held out; batch 32, float32.

Rows: ``kg.KFAC`` for each ``--kfac`` spec (``kfac_spec.py``), by default
with its defaults; annealed (the quadratic model's step scaled by a cosine
decay from 1 to 0 over 600 steps, its exact Fisher forms on half the batch,
covariances every 5 steps); and with the recurrent layers' kernels under
series blocks (``recurrent=series``: ``approximations={name: "series"}``,
Martens, Ba & Johnson 2018, option 2); Adam and AdamW (weight decay 0.01) at each
learning rate of a grid. The target is the best Adam run's held-out loss
after ``--adam_steps`` (``lm_race.py``). The per-example gradient norms'
cost over the batch gradient's is measured apart, side by side.

    python benchmarks/recurrent_lm.py [--adam_steps 2000] [--kfac_steps 1000]
        [--lrs 1e-3,3e-3,1e-2] [--kfac "label=NAME key=value ..."]...
        [--plot docs/recurrent_lm.png]
"""
import time

import bench_env  # noqa: F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import kfac_graph as kg  # noqa: E402
import kfac_spec  # noqa: E402
import lm_race  # noqa: E402
from char_text import CharText  # noqa: E402

tf.get_logger().setLevel("ERROR")

FLAGS = flags.FLAGS
ANNEALED = ("label=annealed cosine_lr=1.0 cosine_steps=600 qmodel_batch_fraction=0.5 "
            "cov_update_period=5")
flags.DEFINE_integer("adam_steps", 2000, "steps of every Adam/AdamW run")
flags.DEFINE_integer("kfac_steps", 1000, "steps of every K-FAC run")
flags.DEFINE_integer("seq_len", 64, "characters per window")
flags.DEFINE_integer("batch", 32, "windows per batch")
flags.DEFINE_integer("embed", 64, "embedding width")
flags.DEFINE_integer("units", 256, "LSTM units")
flags.DEFINE_list("lrs", ["1e-3", "3e-3", "1e-2"], "Adam/AdamW learning rates")
flags.DEFINE_multi_string("kfac", ["label=defaults", ANNEALED, "label=series recurrent=series"],
                          "a K-FAC row, repeatable: space-separated key=value pairs "
                          "(kfac_spec.py); recurrent=A gives the LSTM's kernels approximation A")
flags.DEFINE_integer("eval_every", 50, "steps between held-out evaluations")
flags.DEFINE_integer("eval_windows", 128, "held-out windows")
flags.DEFINE_integer("norm_reps", 9, "interleaved rounds timing the norms")
flags.DEFINE_string("plot", None, "write the held-out-loss-vs-time plot here")
flags.DEFINE_integer("seed", 0, "seed of the weights and the batches")


def make_model(vocab):
    keras.utils.set_random_seed(FLAGS.seed)
    return keras.Sequential([keras.Input((FLAGS.seq_len,), dtype="int32"),
                             keras.layers.Embedding(vocab, FLAGS.embed),
                             keras.layers.LSTM(FLAGS.units, return_sequences=True),
                             keras.layers.Dense(vocab)])


def make_loss(model):
    def loss_fn(x, y):
        logits = model(x, training=True)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
    return loss_fn


def kfac_run(spec, data, held_out, first_batch):
    label, options = kfac_spec.parse(spec, steps=FLAGS.kfac_steps)
    model = make_model(data.vocab_size)
    loss_fn = kg.auto_register(make_loss(model))
    approximations = options.get("approximations", {})
    if "recurrent" in approximations:  # the layers used at every time step: the LSTM's kernels
        chosen = approximations.pop("recurrent")
        reg = loss_fn.registration(*first_batch)
        approximations.update({layer.name: chosen for layer in reg.layers
                               if layer.kind == "dense" and layer.uses > 1})
    opt = kg.KFAC(loss_fn, **options)
    return lm_race.Run(f"K-FAC {label}", "kfac", opt.step,
                       lm_race.evaluator(model, held_out),
                       FLAGS.kfac_steps)


def adam_run(family, lr, vocab, held_out):
    model = make_model(vocab)
    step = lm_race.keras_step(model, make_loss(model), lm_race.adam_family(family, lr, 0.01),
                              jit_compile=True)
    name = "AdamW" if family == "adamw" else "Adam"
    return lm_race.Run(f"{name} lr={lr:g}", family, step,
                       lm_race.evaluator(model, held_out),
                       FLAGS.adam_steps)


def main(argv):
    del argv
    data = CharText(FLAGS.seq_len)
    steps = max(FLAGS.adam_steps, FLAGS.kfac_steps)
    batches = [tuple(tf.constant(t) for t in b)
               for b in data.batches(steps, FLAGS.batch, FLAGS.seed)]
    held_out = data.held_out_windows(FLAGS.eval_windows)
    runs = [kfac_run(spec, data, held_out, batches[0]) for spec in FLAGS.kfac]
    runs += [adam_run(family, float(lr), data.vocab_size, held_out)
             for family in ("adam", "adamw") for lr in FLAGS.lrs]
    start = time.perf_counter()
    lm_race.race(runs, batches, FLAGS.eval_every)
    rows, _, _ = lm_race.table(runs, reference_families=("adam",))
    model = make_model(data.vocab_size)
    ratio = lm_race.norms_cost(model, kg.auto_register(make_loss(model)), batches[0],
                               FLAGS.norm_reps)
    print(f"\nLSTM LM: embedding {FLAGS.embed}, LSTM {FLAGS.units}, vocabulary "
          f"{data.vocab_size}, batch {FLAGS.batch} x {FLAGS.seq_len} characters; "
          f"{len(data.train):,} training / {len(data.test):,} held-out characters\n")
    print(rows)
    print(f"\nper-example gradient norms / batch gradient: {ratio:.2f}")
    print(f"total wall time {time.perf_counter() - start:.0f} s")
    if FLAGS.plot:
        lm_race.plot(runs, FLAGS.plot, "LSTM character LM on pydoc_data.topics")


if __name__ == "__main__":
    app.run(main)
