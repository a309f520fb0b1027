"""What unrolling a recurrent layer's loop costs (``passes/unroll.py``).

A Keras LSTM (default ``unroll=False``: a ``While`` loop) on ``--steps``
time steps, classifying the last state; float32, batch ``--batch``. Its
loop is unrolled by the pass into ``T`` copies of the cell, which the
runtime re-runs. Measured in one process, interleaved over ``--reps``
rounds (medians):

- registration: tracing the loss (``get_concrete_function``) and the pass
  (``unroll``: the loop copied out; the rest: import, canonicalize,
  matching; the pass's second run in the process), and the graph's op
  count before and after unrolling;
- steps, as multiples of a plain SGD step on the loop (the batch gradient
  of the ``While``): SGD on Keras's own ``unroll=True`` graph (what an
  unrolled graph costs TensorFlow), ``kg.KFAC`` (plain: regular momentum,
  fixed damping; inverses every 10 steps, amortised) on the loop, and
  ``kg.per_example_gradients`` on the loop;
- the first K-FAC step (trace, pass, build): seconds.

    python benchmarks/recurrent.py [--steps 64] [--reps 5] [--batch 32]
"""
import time

import bench_env  # noqa: F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import kfac_graph as kg  # noqa: E402
import passes  # noqa: E402

tf.get_logger().setLevel("ERROR")

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 64, "time steps T")
flags.DEFINE_integer("units", 32, "LSTM units")
flags.DEFINE_integer("features", 16, "input features")
flags.DEFINE_integer("batch", 32, "batch size")
flags.DEFINE_integer("reps", 5, "interleaved rounds (medians)")
flags.DEFINE_integer("block", 10, "steps per round (the inverse period)")


def task(unroll):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FLAGS.steps, FLAGS.features)),
                              keras.layers.LSTM(FLAGS.units, unroll=unroll),
                              keras.layers.Dense(10)])

    @kg.auto_register
    def loss_fn(x, y):
        logits = model(x, training=True)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    return model, loss_fn


def sgd_step(model, loss_fn):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(x, y)
        for v, g in zip(model.trainable_variables,
                        tape.gradient(loss, model.trainable_variables)):
            v.assign_sub(0.01 * g)
        return loss
    return step


def registration(loss_fn, args):
    """Seconds to trace and to run the pass, and the op counts."""
    start = time.perf_counter()
    concrete = loss_fn.concrete_function(*args)
    trace = time.perf_counter() - start
    traced = passes.frontends.from_concrete_function(concrete)
    passes.run(traced)  # once first: the process's one-time costs (TensorFlow's lazy imports)
    start = time.perf_counter()
    result = passes.run(traced)
    total = time.perf_counter() - start
    return (trace, result.timings["unroll"], total - result.timings["unroll"],
            len(traced.graph_def.node), len(result.traced.graph_def.node))


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((FLAGS.batch, FLAGS.steps, FLAGS.features)), tf.float32)
    y = tf.constant(rng.integers(0, 10, FLAGS.batch), tf.int32)
    trace, unrolling, rest, before, after = registration(task(False)[1], (x, y))
    runs = {}
    runs["SGD, loop"] = sgd_step(*task(False))
    runs["SGD, Keras unroll=True"] = sgd_step(*task(True))
    first = {}
    for keras_unroll, name in ((False, "K-FAC, loop unrolled by the pass"),
                               (True, "K-FAC, Keras unroll=True")):
        opt = kg.KFAC(task(keras_unroll)[1], learning_rate=0.01, damping=1e-2,
                      momentum_type="regular", adapt_damping=False,
                      inverse_update_period=FLAGS.block)
        start = time.perf_counter()
        opt.step(x, y).numpy()
        first[name] = time.perf_counter() - start
        runs[name] = opt.step
    _, pxg_fn = task(False)
    runs["per-example gradients, loop"] = lambda x, y: kg.per_example_gradients(pxg_fn, x, y)[0]
    for step in runs.values():  # warm up: trace, compile
        for _ in range(2):
            step(x, y)
    times = {name: [] for name in runs}
    for _ in range(FLAGS.reps):
        for name, step in runs.items():
            start = time.perf_counter()
            for _ in range(FLAGS.block):
                out = step(x, y)
            np.asarray(out)
            times[name].append((time.perf_counter() - start) / FLAGS.block)
    base = np.median(times["SGD, loop"])
    print(f"LSTM({FLAGS.units}) on T={FLAGS.steps} steps of {FLAGS.features} features, "
          f"batch {FLAGS.batch}, float32; medians of {FLAGS.reps} interleaved rounds of "
          f"{FLAGS.block} steps\n")
    print(f"registration: trace {trace:.2f} s, unroll {unrolling:.2f} s, rest of the pass "
          f"{rest:.2f} s; graph ops {before} -> {after} unrolled\n")
    print("| step | ms | / SGD on the loop | first step (trace, pass, build) s |\n"
          "|---|---:|---:|---:|")
    for name in runs:
        t = np.median(times[name])
        print(f"| {name} | {1e3 * t:.1f} | {t / base:.2f} | "
              + (f"{first[name]:.1f} |" if name in first else "- |"))


if __name__ == "__main__":
    app.run(main)
