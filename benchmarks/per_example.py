"""End-to-end per-example gradients and norms on Keras 3 models, as ratios.

For each model (float32) and each compilation mode (the whole timed function
under ``tf.function(jit_compile=True)`` or a plain ``tf.function``), times
side by side, calls interleaved, medians of ``--reps`` rounds:

- ``batch``: the batch gradient (``tf.GradientTape``);
- ``floor``: writing one ``[batch, parameter count]`` float32 tensor (``tf.fill``),
  the memory floor of materialising per-example gradients;
- ``pxg``: ``kg.per_example_gradients``;
- ``norms``: ``kg.per_example_gradient_norms``;
- ``vmap``: ``tf.vectorized_map`` over one-example ``GradientTape`` gradients
  (TensorFlow Privacy's vectorised method);
- ``loop``: ``tf.map_fn`` over one-example ``GradientTape`` gradients (a graph
  loop over the examples, the old seed's method; ``--loop_reps`` rounds).

Every timed function takes the batch as arguments and returns its full
outputs (a function call on the CPU returns once they are computed). Models:

- mlp: 784-512-256-10 relu, batch 128;
- cnn: 32x32x3, conv 32 3x3, conv 64 3x3 stride 2, depthwise 3x3, 1x1 conv 64
  (relu each), global average pool, dense 10; batch 64;
- dwcnn: conv 32 3x3, then 3 blocks of depthwise 3x3 + 1x1 conv 64 (the second
  block's depthwise strided 2), pool, dense 10; batch 64;
- audio: 1-D, 256 steps x 8 channels: causal Conv1D 32 k=3 with dilations 1, 2,
  4, 8 (TensorFlow writes the dilated ones with SpaceToBatchND), pool, dense
  10; batch 64;
- resnext: 16x16x32, a ResNeXt block (1x1 conv 64, 3x3 conv 64 in 8 groups,
  1x1 conv 32, residual), strided grouped 3x3 conv 64 in 8 groups, pool,
  dense 10; batch 64;
- unet: a decoder, 8x8x32: Conv2DTranspose 32 3x3 stride 2, conv 32 3x3,
  Conv2DTranspose 16 3x3 stride 2, Conv1x1 3 (a 32x32x3 image), squared error
  against a target image instead of the cross-entropy; batch 32.
Loss: mean sparse softmax cross-entropy (unet: mean squared error).

    python benchmarks/per_example.py [--reps 7] [--models mlp,cnn,dwcnn,audio,resnext,unet]
        [--no_xla] [--markdown out.md]
"""
import os
import sys
import time

import bench_env  # noqa: E402,F401  (first: quiet logs, the repository importable)

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags

import kfac_graph as kg

tf.get_logger().setLevel("ERROR")

FLAGS = flags.FLAGS
flags.DEFINE_integer("reps", 7, "interleaved rounds per candidate (medians)")
flags.DEFINE_integer("loop_reps", 3, "rounds for the tf.map_fn loop (slow)")
flags.DEFINE_list("models", ["mlp", "cnn", "dwcnn", "audio", "resnext", "unet"],
                  "models to time: mlp, cnn, dwcnn, audio, resnext, unet")
flags.DEFINE_bool("no_xla", False, "skip the jit_compile=True runs")
flags.DEFINE_string("markdown", None, "also write the table as markdown here")

# model -> bounds on pxg / floor, pxg / batch, norms / batch, and the speedup
# vmap / pxg (a lower bound); None: no target
TARGETS = {
    "mlp": {"floor": 1.5, "batch": None, "vmap": None, "norms": 1.5},
    "cnn": {"floor": None, "batch": 2.5, "vmap": 2.0, "norms": 2.0},
    "dwcnn": {"floor": None, "batch": 2.5, "vmap": 2.0, "norms": 2.0},
    "audio": {"floor": None, "batch": 2.5, "vmap": 2.0, "norms": 2.0},
    "resnext": {"floor": None, "batch": 2.5, "vmap": 2.0, "norms": 2.0},
    "unet": {"floor": None, "batch": 2.5, "vmap": 2.0, "norms": 2.0},
}


# --- models ---------------------------------------------------------------------


def build(name):
    """(keras model, x, y) with fixed weights and data."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    L = keras.layers
    if name == "mlp":
        batch, shape = 128, (784,)
        layers = [L.Dense(512, activation="relu"), L.Dense(256, activation="relu"), L.Dense(10)]
    elif name == "cnn":
        batch, shape = 64, (32, 32, 3)
        layers = [L.Conv2D(32, 3, padding="same", activation="relu"),
                  L.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
                  L.DepthwiseConv2D(3, padding="same", activation="relu"),
                  L.Conv2D(64, 1, activation="relu"),
                  L.GlobalAveragePooling2D(), L.Dense(10)]
    elif name == "dwcnn":
        batch, shape = 64, (32, 32, 3)
        layers = [L.Conv2D(32, 3, padding="same", activation="relu")]
        for stride in (1, 2, 1):
            layers += [L.DepthwiseConv2D(3, strides=stride, padding="same", activation="relu"),
                       L.Conv2D(64, 1, activation="relu")]
        layers += [L.GlobalAveragePooling2D(), L.Dense(10)]
    elif name == "audio":
        batch, shape = 64, (256, 8)
        layers = [L.Conv1D(32, 3, dilation_rate=d, padding="causal", activation="relu")
                  for d in (1, 2, 4, 8)]
        layers += [L.GlobalAveragePooling1D(), L.Dense(10)]
    elif name == "resnext":
        return _resnext(rng)
    elif name == "unet":
        batch, shape = 32, (8, 8, 32)
        layers = [L.Conv2DTranspose(32, 3, strides=2, padding="same", activation="relu"),
                  L.Conv2D(32, 3, padding="same", activation="relu"),
                  L.Conv2DTranspose(16, 3, strides=2, padding="same", activation="relu"),
                  L.Conv2D(3, 1)]
        model = keras.Sequential([keras.Input(shape)] + layers)
        x = tf.constant(rng.standard_normal((batch, *shape)), tf.float32)
        return model, x, tf.constant(rng.standard_normal((batch, 32, 32, 3)), tf.float32)
    else:
        raise app.UsageError(f"unknown model {name!r}")
    model = keras.Sequential([keras.Input(shape)] + layers)
    x = tf.constant(rng.standard_normal((batch, *shape)), tf.float32)
    y = tf.constant(rng.integers(0, 10, batch), tf.int32)
    return model, x, y


def _resnext(rng, batch=64):
    """A ResNeXt block (grouped 3x3 conv, residual) and a strided grouped conv."""
    L = keras.layers
    inputs = keras.Input((16, 16, 32))
    h = L.Conv2D(64, 1, activation="relu")(inputs)
    h = L.Conv2D(64, 3, padding="same", groups=8, activation="relu")(h)
    h = L.Add()([inputs, L.Conv2D(32, 1)(h)])
    h = L.Conv2D(64, 3, strides=2, padding="same", groups=8, activation="relu")(L.ReLU()(h))
    outputs = L.Dense(10)(L.GlobalAveragePooling2D()(h))
    x = tf.constant(rng.standard_normal((batch, 16, 16, 32)), tf.float32)
    y = tf.constant(rng.integers(0, 10, batch), tf.int32)
    return keras.Model(inputs, outputs), x, y


def candidates(model, x, y, xla):
    """name -> tf.function(x, y) for every timed method."""
    variables = list(model.trainable_variables)
    n_params = sum(int(np.prod(v.shape)) for v in variables)
    batch = int(x.shape[0])

    @kg.auto_register
    def loss_fn(x, y):
        logits = model(x, training=True)
        if y.dtype.is_floating:  # an image target: squared error
            return tf.reduce_mean(tf.reduce_sum(tf.square(logits - y), axis=[1, 2, 3]))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    def one_example(xy):
        xi, yi = xy
        with tf.GradientTape() as tape:
            loss = loss_fn(xi[None], yi[None])
        return tape.gradient(loss, variables)

    def batch_grad(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(x, y)
        return tape.gradient(loss, variables)

    signature = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
    fns = {
        "batch": batch_grad,
        "floor": lambda x, y: tf.fill([batch, n_params], tf.reshape(x, [-1])[0] + 1.0),
        "pxg": lambda x, y: kg.per_example_gradients(loss_fn, x, y),
        "norms": lambda x, y: kg.per_example_gradient_norms(loss_fn, x, y),
        "vmap": lambda x, y: tf.vectorized_map(one_example, (x, y)),
        "loop": lambda x, y: tf.map_fn(one_example, (x, y), fn_output_signature=signature),
    }
    loss_fn.registration(x, y)  # trace and register outside the timing
    return {k: tf.function(f, jit_compile=xla) for k, f in fns.items()}, n_params


# --- timing -----------------------------------------------------------------------


def time_interleaved(fns, args, reps, sparse):
    """Median seconds per call. Rounds alternate through the candidates (order
    rotated each round); those in ``sparse`` (name -> reps) run only in that
    many rounds, spread out."""
    for f in fns.values():  # trace / compile, then one warm call
        f(*args)
        f(*args)
    names = list(fns)
    times = {k: [] for k in names}
    for r in range(reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            if k in sparse and len(times[k]) >= sparse[k]:
                continue
            if k in sparse and r % max(1, reps // sparse[k]) != 0:
                continue
            start = time.perf_counter()
            fns[k](*args)
            times[k].append(time.perf_counter() - start)
    return {k: float(np.median(v)) for k, v in times.items()}


def check(fns, args):
    """Max relative error of pxg and norms against the vectorized_map result."""
    got = fns["pxg"](*args)
    want = fns["vmap"](*args)
    err = max(float(tf.reduce_max(tf.abs(g - w)) / (tf.reduce_max(tf.abs(w)) + 1e-12))
              for g, w in zip(got, want))
    norms = fns["norms"](*args)
    want_norms = tf.sqrt(tf.add_n([tf.reduce_sum(tf.reshape(w, [w.shape[0], -1]) ** 2, 1)
                                   for w in want]))
    err = max(err, float(tf.reduce_max(tf.abs(norms - want_norms) / want_norms)))
    return err


def verdict(value, target, higher_is_better=False):
    if target is None:
        return f"{value:.2f}"
    ok = value >= target if higher_is_better else value <= target
    sign = ">=" if higher_is_better else "<="
    return f"{value:.2f} {'PASS' if ok else 'MISS'} ({sign}{target:g})"


def main(argv):
    del argv
    xla_modes = [False] if FLAGS.no_xla else [False, True]
    header = ["model", "params", "xla", "pxg / batch", "pxg / floor", "norms / batch",
              "vmap / pxg", "loop / pxg", "max rel err"]
    rows = []
    started = time.time()
    for name in FLAGS.models:
        model, x, y = build(name)
        targets = TARGETS[name]
        for xla in xla_modes:
            fns, n_params = candidates(model, x, y, xla)
            err = check(fns, (x, y))
            t = time_interleaved(fns, (x, y), FLAGS.reps, {"loop": FLAGS.loop_reps})
            rows.append([
                f"{name} B={x.shape[0]}", f"{n_params:,}", "yes" if xla else "no",
                verdict(t["pxg"] / t["batch"], targets["batch"]),
                verdict(t["pxg"] / t["floor"], targets["floor"]),
                verdict(t["norms"] / t["batch"], targets["norms"]),
                verdict(t["vmap"] / t["pxg"], targets["vmap"], higher_is_better=True),
                f"{t['loop'] / t['pxg']:.1f}",
                f"{err:.1e}",
            ])
            print(" | ".join(rows[-1]), flush=True)
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    command = " ".join(["python"] + sys.argv)
    note = (
        f"Conditions: TensorFlow {tf.__version__}, Keras {keras.__version__}, "
        f"{os.cpu_count()} CPU cores shared with other jobs, float32. Each figure is a ratio of "
        f"medians over {FLAGS.reps} interleaved rounds in one process ({FLAGS.loop_reps} for the "
        "map_fn loop), after tracing/compiling and a warm call; every timed function is a "
        "tf.function of (x, y) returning its full outputs; 'xla' compiles the whole function "
        "with jit_compile=True. batch: batch gradient; floor: tf.fill of a [batch, params] "
        "float32 tensor; pxg: kg.per_example_gradients; norms: kg.per_example_gradient_norms; "
        "vmap: tf.vectorized_map of one-example GradientTape gradients; loop: tf.map_fn of the "
        "same; vmap/pxg and loop/pxg are speedups of pxg. max rel err: pxg and norms against "
        f"vmap. Total wall time {time.time() - started:.0f} s."
    )
    print(f"\ncommand: {command}\n\n{note}")
    if FLAGS.markdown:
        with open(FLAGS.markdown, "w") as f:
            f.write("| " + " | ".join(header) + " |\n")
            f.write("|" + "|".join(["---"] * 3 + ["---:"] * (len(header) - 3)) + "|\n")
            for r in rows:
                f.write("| " + " | ".join(r) + " |\n")
            f.write(f"\n`{command}`\n\n{note}\n")


if __name__ == "__main__":
    app.run(main)
