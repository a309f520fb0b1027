"""Registration time of a small Keras model made fresh each time.

What every new model in a process pays before its first step: the trace of
the loss, the Keras flags of its variables (``passes/keras_frozen.py``,
``passes/keras_reach.py``) and the pass. Makes a 4-layer MLP (Dense, Dense,
LayerNormalization, Dense) and its ``kg.auto_register`` loss ``--repeats``
times and prints the median of the registrations' times, and the number of
objects the process's garbage collector tracks (what a scan would go
through).

    python benchmarks/registration_fresh.py [--repeats 15]
"""
from __future__ import annotations

import gc
import time

import bench_env  # noqa: F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import kfac_graph as kg  # noqa: E402

flags.DEFINE_integer("repeats", 15, "registrations of fresh models timed")
FLAGS = flags.FLAGS


def _once(x, y) -> float:
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(8), keras.layers.LayerNormalization(),
                              keras.layers.Dense(3)])
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    fn = kg.auto_register(lambda a, b: ce(b, model(a, training=True)))
    start = time.perf_counter()
    fn.registration(x, y)
    return time.perf_counter() - start


def main(_):
    x = tf.constant(np.random.default_rng(0).normal(size=(8, 6)), tf.float32)
    y = tf.constant([0, 1, 2, 0, 1, 2, 0, 1])
    _once(x, y)  # the process's one-time costs
    times = [_once(x, y) for _ in range(FLAGS.repeats)]
    print(f"median registration of a fresh model: {np.median(times):.3f} s "
          f"({FLAGS.repeats} models; {len(gc.get_objects()):,} objects tracked)")


if __name__ == "__main__":
    app.run(main)
