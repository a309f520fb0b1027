"""BERT's pre-training loss at a word-piece vocabulary: K-FAC against Adam.

keras-hub's ``BertBackbone`` (random weights) with its ``MaskedLMHead`` tied
to the token table, the logits gathered at ``--masked`` positions of each
sequence and weighted by Keras's ``sample_weight`` (the last 3 slots of each
row padded out), plus a next-sentence ``Dense(2)`` on the pooled output: the
loss joins two categorical heads, whose blocks are their likelihoods'
Fishers (``LossSpec.likelihood_blocks``). Prints the registration's loss
line and time, then:

- fitting one batch: the loss after ``--fit_steps`` steps of ``kg.KFAC``'s
  defaults and of an XLA-compiled Adam at 1e-3;
- step cost: each ``--kfac`` row's first step, and median step over
  ``--steps`` rounds interleaved with Adam's on 4 batches, over Adam's.

Rows are ``kfac_spec`` strings (``"label=regular momentum_type=regular"``).

    python benchmarks/bert_pretraining.py [--vocab 30522] [--steps 10]
"""
import statistics
import time

import bench_env  # noqa: F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import kfac_graph as kg  # noqa: E402
import kfac_spec  # noqa: E402
import lm_race  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("vocab", 30522, "word pieces")
flags.DEFINE_integer("hidden", 128, "hidden size (intermediate 4x)")
flags.DEFINE_integer("layers", 2, "encoder layers")
flags.DEFINE_integer("length", 128, "tokens per sequence")
flags.DEFINE_integer("masked", 20, "masked slots per sequence")
flags.DEFINE_integer("batch", 16, "sequences per batch")
flags.DEFINE_integer("fit_steps", 10, "steps on one batch for the loss column")
flags.DEFINE_integer("steps", 10, "timed rounds")
flags.DEFINE_multi_string("kfac", ["label=defaults", "label=regular momentum_type=regular",
                                   "label=regular_cov5 momentum_type=regular "
                                   "cov_update_period=5"], "K-FAC rows (kfac_spec)")


def model():
    """``(loss(x, positions, y, w, pair), its variables)``, random weights."""
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=FLAGS.vocab, num_layers=FLAGS.layers, num_heads=2,
        hidden_dim=FLAGS.hidden, intermediate_dim=4 * FLAGS.hidden,
        max_sequence_length=FLAGS.length, dropout=0.0)
    head = keras_hub.layers.MaskedLMHead(
        vocabulary_size=FLAGS.vocab, token_embedding=backbone.token_embedding, activation=None)
    pair_head = keras.layers.Dense(2, name="next_sentence")
    tokens = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss(x, positions, y, w, pair):
        out = backbone(x)
        return (tokens(y, head(out["sequence_output"], mask_positions=positions),
                       sample_weight=w)
                + tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    pair, pair_head(out["pooled_output"]))))
    loss(*batch(np.random.default_rng(9)))  # (builds the heads)
    return loss, (backbone.trainable_variables + head.trainable_variables
                  + pair_head.trainable_variables)


def batch(rng):
    b, t, p = FLAGS.batch, FLAGS.length, FLAGS.masked
    ids = rng.integers(1, FLAGS.vocab, (b, t)).astype("int32")
    positions = np.stack([rng.choice(t, p, replace=False) for _ in range(b)]).astype("int32")
    w = np.ones((b, p), "float32")
    w[:, -3:] = 0.0
    x = {"token_ids": tf.constant(ids), "segment_ids": tf.zeros_like(ids),
         "padding_mask": tf.ones_like(ids)}
    return (x, tf.constant(positions), tf.constant(np.take_along_axis(ids, positions, 1)),
            tf.constant(w), tf.constant(rng.integers(0, 2, b), tf.int32))


def adam_step():
    loss, variables = model()
    adam = keras.optimizers.Adam(1e-3)
    adam.build(variables)
    return lm_race.keras_step(variables, loss, adam, jit_compile=True)


def timed(step, args):
    start = time.perf_counter()
    float(step(*args))
    return time.perf_counter() - start


def main(_):
    rng = np.random.default_rng(0)
    batches = [batch(rng) for _ in range(4)]
    fn = kg.auto_register(model()[0])
    start = time.perf_counter()
    reg = fn.registration(*batches[0])
    print(f"registration {time.perf_counter() - start:.1f} s; {reg.summary().splitlines()[-1]}")
    fits = {"K-FAC defaults": kg.KFAC(kg.auto_register(model()[0])).step, "Adam": adam_step()}
    for name, step in fits.items():
        first = float(step(*batches[0]))
        for _ in range(FLAGS.fit_steps - 1):
            last = float(step(*batches[0]))
        print(f"{name}: one batch's loss {first:.3f} -> {last:.3f} in {FLAGS.fit_steps} steps")
    rows = {"adam": adam_step()}
    for spec in FLAGS.kfac:
        label, options = kfac_spec.parse(spec)
        rows[label] = kg.KFAC(kg.auto_register(model()[0]), **options).step
    first = {label: timed(step, batches[0]) for label, step in rows.items()}
    times = {label: [] for label in rows}
    for i in range(FLAGS.steps):
        for label, step in rows.items():
            times[label].append(timed(step, batches[i % 4]))
    adam = statistics.median(times["adam"])
    print("| run | first step s | median step ms | / Adam's |\n|---|---:|---:|---:|")
    for label, ts in times.items():
        print(f"| {label} | {first[label]:.1f} | {1e3 * statistics.median(ts):.0f} | "
              f"{statistics.median(ts) / adam:.2f} |")


if __name__ == "__main__":
    app.run(main)
