"""What a Gauss-Newton curvature costs beside a likelihood's, side by side.

For each class count ``K``, one MLP (16 -> 64 -> K, batch 64) trains with
``kg.KFAC``'s defaults on a categorical focal loss (kind "ggn": the loss's
``K x K`` Hessian per example, by one vectorised double-backward pass, and
its eigendecomposition, ``kfac_graph/fisher/ggn.py``) and on the
cross-entropy (kind "categorical": the Fisher in closed form), one step of
each in turn so that the machine's load falls on both alike. Prints the
first step (trace included) and the median step of each, and the median's
ratio.

    python benchmarks/ggn_cost.py --classes 10 --classes 100 --classes 256
"""
import time

import bench_env  # noqa: F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import kfac_graph as kg  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_multi_integer("classes", [10, 100, 256], "class counts K")
flags.DEFINE_integer("steps", 20, "timed steps of each")
flags.DEFINE_integer("batch", 64, "examples per batch")


def optimizer(loss, k):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(k)])
    fn = kg.auto_register(lambda x, y: loss(y, model(x)))
    return fn, kg.KFAC(fn)


def main(_):
    rng = np.random.default_rng(0)
    print(f"{'K':>4}  {'loss':<6} {'kind':<12} {'first step s':>12} {'median ms':>10} "
          f"{'over CE':>8}")
    for k in FLAGS.classes:
        x = tf.constant(rng.normal(size=(FLAGS.batch, 16)), tf.float32)
        y = tf.constant(np.eye(k)[rng.integers(0, k, FLAGS.batch)], tf.float32)
        runs = {"CE": keras.losses.CategoricalCrossentropy(from_logits=True),
                "focal": keras.losses.CategoricalFocalCrossentropy(from_logits=True)}
        built, first, times = {}, {}, {name: [] for name in runs}
        for name, loss in runs.items():
            fn, opt = built[name] = optimizer(loss, k)
            start = time.perf_counter()
            opt.step(x, y)
            first[name] = time.perf_counter() - start
        for _ in range(FLAGS.steps):
            for name, (_, opt) in built.items():
                start = time.perf_counter()
                opt.step(x, y)
                times[name].append(time.perf_counter() - start)
        base = np.median(times["CE"])
        for name, (fn, _) in built.items():
            median = np.median(times[name])
            print(f"{k:>4}  {name:<6} {fn.registration(x, y).loss.kind:<12} "
                  f"{first[name]:>12.1f} {median * 1e3:>10.1f} {median / base:>7.1f}x")


if __name__ == "__main__":
    app.run(main)
