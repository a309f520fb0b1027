"""Time the registration pass on large graphs; tracing is reported separately.

Prints, for keras.applications ResNet50 and MobileNetV2 (weights=None, 64x64)
and for MLPs of 10, 100 and 1000 layers, or for every keras.applications
constructor (``--models apps``: weights=None, the smallest input each takes):
the graph size, the trace time, the pass time (import + canonicalize + match
layers + match loss), the pass time per 1000 ops (flat when the pass is
linear in graph size), and the layer kinds found. It checks that no variable
is generic and that every Keras conv, depthwise, separable, transposed,
dense and normalization layer is found as its kind (at least as many of each
kind as the model has such layers; custom layers with variables, like
ConvNeXt's layer scale, add scale_and_shift layers).

    python benchmarks/registration.py [--models resnet50,mobilenetv2,mlp10,mlp100,mlp1000]
    python benchmarks/registration.py --models apps --repeats 1
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


APPLICATIONS = sorted(n for n in dir(keras.applications) if n[:1].isupper())
SMALLEST = {"InceptionV3": 75, "InceptionResNetV2": 75, "Xception": 71}


def _builder(name):
    if name in BUILDERS:
        return BUILDERS[name]
    if name in APPLICATIONS:
        return lambda: _application(getattr(keras.applications, name), SMALLEST.get(name, 32))
    raise app.UsageError(f"unknown model {name!r}")


def measure(name):
    model, args = _builder(name)()

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
    ok = all(kinds[k] >= n for k, n in expected.items()) and not kinds["generic"]
    return dict(model=name, ops=len(traced.graph_def.node), trace=trace_s, passes=best,
                per_kop=1e6 * best / len(traced.graph_def.node), kinds=dict(kinds),
                check="ok" if ok else f"MISMATCH expected {dict(expected)}")


_KINDS_OF = {"Conv1D": ("conv2d",), "Conv2D": ("conv2d",), "Dense": ("dense",),
             "DepthwiseConv1D": ("depthwise_conv2d",), "DepthwiseConv2D": ("depthwise_conv2d",),
             "SeparableConv1D": ("depthwise_conv2d", "conv2d"),
             "SeparableConv2D": ("depthwise_conv2d", "conv2d"),
             "Conv1DTranspose": ("conv2d_transpose",), "Conv2DTranspose": ("conv2d_transpose",),
             "BatchNormalization": ("scale_and_shift",),
             "LayerNormalization": ("scale_and_shift",),
             "GroupNormalization": ("scale_and_shift",)}


def _expected_kinds(model):
    counts = collections.Counter()
    for layer in model.layers:
        counts.update(_KINDS_OF.get(type(layer).__name__, ()))
    return counts


def main(argv):
    del argv
    names = [n for m in FLAGS.models for n in (APPLICATIONS if m == "apps" else [m])]
    rows = []
    for name in names:
        rows.append(measure(name))
        print(f"{name}: {rows[-1]['ops']} ops, {rows[-1]['check']}", flush=True)
    print(f"{'model':<12} {'ops':>6} {'trace s':>8} {'pass s':>8} {'pass ms/1k ops':>15}  kinds  check")
    for r in rows:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r["kinds"].items()))
        print(f"{r['model']:<12} {r['ops']:>6} {r['trace']:>8.2f} {r['passes']:>8.3f} "
              f"{r['per_kop']:>15.1f}  {kinds}  {r['check']}")


if __name__ == "__main__":
    app.run(main)
