"""Batches of new shapes: what a K-FAC step costs when the batch size or the
sequence length changes (``kfac_graph/relaxed_shapes.py``).

Models (random weights, ``kg.KFAC`` defaults):

- ``mobilenet_v3_small``: ``keras.applications.MobileNetV3Small`` (32x32,
  batch 16, 10 classes), then partial batches of 5 and 9, as the last batch
  of an epoch;
- ``lm``: a variable-length decoder (ids ``[B, None]``, vocabulary 64, width
  64, two pre-norm blocks of causal ``MultiHeadAttention`` and a GELU MLP,
  learned positions, a masked mean of the tokens' cross-entropy), batch 16
  at lengths 64, then 48 and 40, as a bucketed language model;
- ``lm_mean``: the same decoder with Keras's ``SparseCategoricalCrossentropy``
  on the ``[B, T]`` targets, a plain mean over the tokens (its ``1/T`` read
  at run time as a factor of the curvature's scale at an unknown length);
- ``lm_sample_weight``: the same loss with the padding mask as Keras's
  ``sample_weight`` (``sum(ce * mask) / (B T)``, ``sum_over_batch_size``: a
  mean of weighted tokens, whose ``1/T`` is read the same way).

With ``--replicas R`` the model and the optimizer are made under a
``MirroredStrategy`` over R logical CPU devices (the batches split over
them).

For each, in one process, ``relax_shapes=True`` (the default: one more trace
with the sizes that changed unknown) against ``relax_shapes=False`` (a trace
per shape, as before), each on a fresh model: the first step, the step at the
first new shape, the step at the second, then the median of ``--later``
steps at the first new shape, and the traces of the step function. The
machine is shared: compare the two rows of a model, not the seconds across
runs.

    python benchmarks/new_shapes.py [--later 5] [--replicas 1]
        [--models mobilenet_v3_small,lm,lm_mean,lm_sample_weight]
"""
from __future__ import annotations

import time

import bench_env  # noqa: F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import kfac_graph as kg  # noqa: E402
from char_transformer import AddPositions  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mobilenet_v3_small", "lm"], "models")
flags.DEFINE_integer("later", 5, "later steps at the first new shape (median)")
flags.DEFINE_integer("replicas", 1, "above 1: the steps split over this many logical CPU "
                     "devices (MirroredStrategy; the batches of 16 split evenly)")

L = keras.layers


def mobilenet():
    model = keras.applications.MobileNetV3Small(input_shape=(32, 32, 3), weights=None,
                                                classes=10)

    def loss(x, y):
        logits = model(x, training=True)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    def batch(size, seed):
        x = tf.random.stateless_normal([size, 32, 32, 3], seed=[seed, 1])
        y = tf.random.stateless_uniform([size], seed=[seed, 2], maxval=10, dtype=tf.int32)
        return x, y

    return loss, [batch(16, 0), batch(5, 1), batch(9, 2)]


def decoder(vocab=64, width=64, heads=4, blocks=2, max_length=64):
    ids = keras.Input((None,), dtype="int32")
    h = AddPositions(max_length, width)(L.Embedding(vocab, width)(ids))
    for _ in range(blocks):
        a = L.LayerNormalization()(h)
        h = h + L.MultiHeadAttention(heads, width // heads)(a, a, use_causal_mask=True)
        m = L.LayerNormalization()(h)
        h = h + L.Dense(width)(L.Dense(4 * width, activation="gelu")(m))
    return keras.Model(ids, L.Dense(vocab)(L.LayerNormalization()(h)))


def padded_batches():
    """Batches of 16 ``(ids, targets, padding mask)`` at lengths 64, 48, 40."""
    def batch(length, seed):
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, 64, (16, length + 1))
        mask = (np.arange(length)[None] < rng.integers(length // 2, length + 1, (16, 1)))
        return (tf.constant(ids[:, :-1], tf.int32), tf.constant(ids[:, 1:], tf.int32),
                tf.constant(mask, tf.float32))

    return [batch(64, 0), batch(48, 1), batch(40, 2)]


def lm():
    model = decoder()

    def loss(ids, targets, mask):
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(targets, model(ids, training=True))
        return tf.reduce_sum(ce * mask) / tf.reduce_sum(mask)

    return loss, padded_batches()


def lm_mean():
    model = decoder()
    cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss(ids, targets):
        return cross_entropy(targets, model(ids, training=True))

    def batch(length, seed):
        ids = np.random.default_rng(seed).integers(0, 64, (16, length + 1))
        return tf.constant(ids[:, :-1], tf.int32), tf.constant(ids[:, 1:], tf.int32)

    return loss, [batch(64, 0), batch(48, 1), batch(40, 2)]


def lm_sample_weight():
    model = decoder()
    cross_entropy = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss(ids, targets, mask):
        return cross_entropy(targets, model(ids, training=True), sample_weight=mask)

    return loss, padded_batches()


MODELS = {"mobilenet_v3_small": mobilenet, "lm": lm, "lm_mean": lm_mean,
          "lm_sample_weight": lm_sample_weight}


def seconds(fn):
    start = time.perf_counter()
    fn().numpy()
    return time.perf_counter() - start


def run(model_name, relax, strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():  # (the default strategy's: one device)
        loss, (first, new, other) = MODELS[model_name]()
        opt = kg.KFAC(kg.auto_register(loss), relax_shapes=relax)
    start = time.perf_counter()
    opt.step(*first).numpy()
    row = {"first step": time.perf_counter() - start,
           "first new shape": seconds(lambda: opt.step(*new)),
           "second new shape": seconds(lambda: opt.step(*other))}
    row["later step, new shape"] = float(np.median(
        [seconds(lambda: opt.step(*new)) for _ in range(FLAGS.later)]))
    row["traces"] = opt._compiled.step.experimental_get_tracing_count()
    return row


def main(argv):
    del argv
    columns = ["first step", "first new shape", "second new shape", "later step, new shape"]
    strategy = tf.distribute.get_strategy()
    if FLAGS.replicas > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * FLAGS.replicas)
        strategy = tf.distribute.MirroredStrategy(
            [f"/cpu:{i}" for i in range(FLAGS.replicas)])
    rows = {name: {relax: run(name, relax, strategy) for relax in (True, False)}
            for name in FLAGS.models}
    print("| model | relax_shapes | " + " | ".join(columns) + " | traces |")
    print("|---|---|" + "---:|" * (len(columns) + 1))
    for name, pair in rows.items():
        for relax, row in pair.items():
            print(f"| {name} | {relax} | " + " | ".join(f"{row[c]:.2f} s" for c in columns)
                  + f" | {row['traces']} |")
    print("\n| model | later step at the new shape, relaxed / exact | the two new shapes, "
          "exact - relaxed |")
    print("|---|---:|---:|")
    for name, pair in rows.items():
        ratio = pair[True]["later step, new shape"] / pair[False]["later step, new shape"]
        new = lambda row: row["first new shape"] + row["second new shape"]  # noqa: E731
        print(f"| {name} | {ratio:.2f}x | {new(pair[False]) - new(pair[True]):.1f} s |")


if __name__ == "__main__":
    app.run(main)
