"""Time the registration pass on large graphs; tracing is reported separately.

Prints, for keras.applications ResNet50 and MobileNetV2 (weights=None) and
for MLPs of 10, 100 and 1000 layers: the graph size, the trace time, the
pass time (import + canonicalize + match layers + match loss), the pass time
per 1000 ops (flat when the pass is linear in graph size), and the layer
kinds found. It checks that every conv, depthwise and dense kernel registers
as its kind and the batch norms as scale_and_shift (none generic).

    python benchmarks/registration.py [--models resnet50,mobilenetv2,mlp10,mlp100,mlp1000]
"""
from __future__ import annotations

import collections
import time

import bench_env  # noqa: E402,F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import passes  # noqa: E402
from kfac_graph.auto_register import registration_from_pass  # noqa: E402

flags.DEFINE_list("models", ["resnet50", "mobilenetv2", "mlp10", "mlp100", "mlp1000"],
                  "Which models to register.")
flags.DEFINE_integer("repeats", 3, "Pass timings are the best of this many runs.")
FLAGS = flags.FLAGS


def _application(builder, size):
    model = builder(weights=None, input_shape=(size, size, 3), classes=10)
    x = tf.zeros([2, size, size, 3])
    y = tf.zeros([2], tf.int32)
    return model, (x, y)


class _MLP:
    """A plain stack of Dense layers (keras.Sequential recurses per layer and
    cannot hold 1000 of them)."""

    def __init__(self, depth, width):
        self.layers = [keras.layers.Dense(width, activation="tanh") for _ in range(depth - 1)]
        self.layers.append(keras.layers.Dense(10))

    def __call__(self, x, training=False):
        for layer in self.layers:
            x = layer(x)
        return x


def _mlp(depth, width=64):
    return _MLP(depth, width), (tf.zeros([2, width]), tf.zeros([2], tf.int32))


BUILDERS = {
    "resnet50": lambda: _application(keras.applications.ResNet50, 64),
    "mobilenetv2": lambda: _application(keras.applications.MobileNetV2, 64),
    "mlp10": lambda: _mlp(10),
    "mlp100": lambda: _mlp(100),
    "mlp1000": lambda: _mlp(1000),
}


def measure(name):
    model, args = BUILDERS[name]()

    def loss_fn(x, y):
        logits = model(x, training=True)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    start = time.perf_counter()
    traced = passes.trace(loss_fn, args)
    trace_s = time.perf_counter() - start
    best, result = float("inf"), None
    for _ in range(FLAGS.repeats):
        start = time.perf_counter()
        result = passes.run(traced)
        best = min(best, time.perf_counter() - start)
    reg = registration_from_pass(result)
    kinds = collections.Counter(layer.kind for layer in reg.layers)
    expected = _expected_kinds(model)
    ok = all(kinds[k] == n for k, n in expected.items()) and not kinds["generic"]
    return dict(model=name, ops=len(traced.graph_def.node), trace=trace_s, passes=best,
                per_kop=1e6 * best / len(traced.graph_def.node), kinds=dict(kinds),
                check="ok" if ok else f"MISMATCH expected {dict(expected)}")


def _expected_kinds(model):
    counts = collections.Counter()
    for layer in model.layers:
        kind = {"Conv2D": "conv2d", "DepthwiseConv2D": "depthwise_conv2d", "Dense": "dense",
                "BatchNormalization": "scale_and_shift"}.get(type(layer).__name__)
        if kind:
            counts[kind] += 1
    return counts


def main(argv):
    del argv
    rows = [measure(name) for name in FLAGS.models]
    print(f"{'model':<12} {'ops':>6} {'trace s':>8} {'pass s':>8} {'pass ms/1k ops':>15}  kinds  check")
    for r in rows:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r["kinds"].items()))
        print(f"{r['model']:<12} {r['ops']:>6} {r['trace']:>8.2f} {r['passes']:>8.3f} "
              f"{r['per_kop']:>15.1f}  {kinds}  {r['check']}")


if __name__ == "__main__":
    app.run(main)
