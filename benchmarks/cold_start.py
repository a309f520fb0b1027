"""Where the first K-FAC step's time goes, against a first Adam step and a
first batch-gradient call, on real Keras models (random weights).

Models: ``keras.applications.MobileNetV3Small`` (32x32, batch 16),
``ResNet50`` and ``EfficientNetB0`` (64x64, batch 16), 10 classes, and
``bert_small.py``'s encoder (sequence 128, batch 16, 2 classes); mean
softmax cross-entropy.

For each model, in one process:

- ``Adam``: a ``tf.function`` step (``GradientTape`` and
  ``keras.optimizers.Adam.apply_gradients``, no XLA): the optimizer's
  construction and ``build`` (its slots) and the step's first call (trace,
  graph optimisation, run), then a later call;
- ``kg.KFAC`` (its defaults; ``--variants`` adds ``regular``: regular
  momentum at a fixed damping; a variant's name ending ``:in_place`` traces
  every block's algebra in place instead of one shared kernel per
  structure, ``fisher/shared_kernels.py``; ending ``:own_pullback``, the
  quadratic model's forms take a backward pass of their own instead of
  differentiating the gradients', ``own_pullback.py``): construction and registration
  (``build``: the loss's trace, the pass, the blocks' variables), the
  step's trace, its first run (TensorFlow's graph optimisation and the XLA
  compile of the preconditioning) and a later call; inside the trace, the
  time spent in each part of the step (inclusive, measured by wrapping the
  parts while tracing);
- ``per_example_gradients``: its first call against a first
  ``tf.function`` batch-gradient call, with Grappler off (the default)
  and on (``graph_optimization="default"``), alternating over
  ``--per_example_rounds`` rounds on fresh instances of the model (mean).

Each model's first-order steps run after a throwaway SGD step on another
instance of it, which pays the process's one-time start-up. Ratios
(``/ Adam first``, ``/ gradient first``) are measured side by side
in the same process; the machine is shared, so the absolute seconds vary.

    python benchmarks/cold_start.py [--models mobilenet_v3_small,resnet50,efficientnetb0,bert_small]
        [--variants defaults,regular] [--markdown out.md]

A second table counts the traced operations of each step (its graph and the
functions it calls).
"""
from __future__ import annotations

import contextlib
import time

import bench_env  # noqa: F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import bert_small  # noqa: E402
import kfac_graph as kg  # noqa: E402
from lm_race import keras_step  # noqa: E402
from own_pullback import own_pullback  # noqa: E402
from kfac_graph.fisher import estimator as estimator_lib, shared_kernels  # noqa: E402
from kfac_graph.optimizer import exact_fisher, single_device, step_core, update_rules  # noqa: E402
from kfac_graph import taps as taps_lib  # noqa: E402

tf.get_logger().setLevel("ERROR")

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mobilenet_v3_small", "resnet50"], "models")
flags.DEFINE_list("variants", ["defaults"],
                  "K-FAC variants: defaults, regular (each may end :in_place)")
flags.DEFINE_string("markdown", None, "also write the table as markdown here")
flags.DEFINE_integer("per_example_rounds", 2,
                     "per-example first calls per Grappler setting (alternating; mean)")


def image_model(build, size, batch):
    """``() -> (model, x, y)`` for a ``keras.applications`` constructor."""
    def make_model():
        model = build(input_shape=(size, size, 3), weights=None, classes=10)
        x = tf.random.stateless_normal([batch, size, size, 3], seed=[1, 2])
        y = tf.random.stateless_uniform([batch], seed=[3, 4], maxval=10, dtype=tf.int32)
        return model, x, y
    return make_model


MODELS = {
    "mobilenet_v3_small": image_model(keras.applications.MobileNetV3Small, 32, 16),
    "resnet50": image_model(keras.applications.ResNet50, 64, 16),
    "efficientnetb0": image_model(keras.applications.EfficientNetB0, 64, 16),
    "bert_small": lambda: (bert_small.bert_small(), *bert_small.batch(np.random.default_rng(0))),
}
VARIANTS = {"defaults": {}, "regular": {"momentum_type": "regular", "adapt_damping": False}}

# (label, owner, attribute): the parts of the step's trace timed inclusively
PARTS = [
    ("registered graph imported (LayerTaps.build)", taps_lib.LayerTaps, "build"),
    ("statistics pass (estimator accumulate)", estimator_lib.FisherEstimator, "_update"),
    ("inverse refresh", single_device.SingleDeviceCore, "refresh_inverses"),
    ("update: preconditioning and rule", step_core.StepCore, "update"),
    ("exact-Fisher forms (quadratic model)", exact_fisher, "quadratic_forms"),
    ("quadratic model solve", update_rules, "quadratic_model"),
    ("damping rule (loss re-evaluated)", step_core.StepCore, "adapt_damping"),
]


@contextlib.contextmanager
def timed_parts(totals: dict):
    """Wraps each of ``PARTS`` so that its inclusive time adds to ``totals``."""
    saved = []
    for label, owner, name in PARTS:
        original = owner.__dict__[name]
        plain = original.__func__ if isinstance(original, (classmethod, staticmethod)) else original

        def wrapper(*a, _plain=plain, _label=label, **k):
            start = time.perf_counter()
            try:
                return _plain(*a, **k)
            finally:
                totals[_label] = totals.get(_label, 0.0) + time.perf_counter() - start

        setattr(owner, name, classmethod(wrapper) if isinstance(original, classmethod)
                else wrapper)
        saved.append((owner, name, original))
    try:
        yield totals
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def traced_ops(concrete) -> int:
    """Operations in a concrete function's graph and in the functions it
    calls (``tf.cond`` branches, loop bodies): the trace's size, which its
    trace and first-run times follow, and which the noisy clock does not
    blur."""
    graph_def = concrete.graph.as_graph_def()
    return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)


def clock(fn):
    start = time.perf_counter()
    out = fn()
    if isinstance(out, tf.Tensor):
        out.numpy()
    return time.perf_counter() - start


def make(model_name):
    keras.utils.set_random_seed(0)
    model, x, y = MODELS[model_name]()

    def loss(x, y):
        logits = model(x, training=True)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    return model, loss, (x, y)


def adam_times(model_name, optimizer=None):
    model, loss, args = make(model_name)
    variables = model.trainable_variables
    start = time.perf_counter()
    optimizer = optimizer or keras.optimizers.Adam(1e-3)
    # built before the trace, as ``Model.fit`` does: creating the slots inside
    # the trace doubles Adam's first step on these models
    optimizer.build(variables)
    step = keras_step(model, loss, optimizer, jit_compile=False)
    step(*args).numpy()
    first = time.perf_counter() - start
    return {"first step": first, "later step": clock(lambda: step(*args)),
            "ops": traced_ops(step.get_concrete_function(*args))}


def gradient_times(model_name):
    model, loss, args = make(model_name)
    variables = model.trainable_variables

    @tf.function
    def grads(x, y):
        with tf.GradientTape() as tape:
            value = loss(x, y)
        return tape.gradient(value, variables)

    return {"first call": clock(lambda: grads(*args))}


def per_example_times(model_name, graph_optimization="off"):
    _, loss, args = make(model_name)
    fn = kg.auto_register(loss)
    call = lambda: kg.per_example_gradients(fn, *args, graph_optimization=graph_optimization)[0]
    return {"first call": clock(call), "later call": clock(call)}


def mean_times(runs):
    """The mean of each phase's seconds over ``runs`` (dicts of phases)."""
    return {phase: float(np.mean([run[phase] for run in runs])) for phase in runs[0]}


def kfac_times(model_name, variant):
    _, loss, args = make(model_name)
    out = {}
    start = time.perf_counter()
    name, _, where = variant.partition(":")
    opt = kg.KFAC(kg.auto_register(loss), **VARIANTS[name])
    opt.build(*args)
    if where == "in_place":
        shared_kernels.share(opt.estimator.blocks, shared_kernels.IN_PLACE)
    out["construct + register + build"] = time.perf_counter() - start
    parts = {}
    with timed_parts(parts), own_pullback(where == "own_pullback"):
        out["trace step"] = clock(lambda: opt._compiled.step.get_concrete_function(*args))
    ops = traced_ops(opt._compiled.step.get_concrete_function(*args))
    out["first run (graph optimisation, XLA)"] = clock(lambda: opt.step(*args))
    out["first step, total"] = (out["construct + register + build"] + out["trace step"]
                                + out["first run (graph optimisation, XLA)"])
    out["later step"] = clock(lambda: opt.step(*args))
    return out, parts, ops


def main(argv):
    del argv
    rows, op_rows = [], []
    for model_name in FLAGS.models:
        # a throwaway SGD step first pays the process's one-time start-up
        # (TensorFlow's runtime, Keras's first trace of the model's layers)
        adam_times(model_name, keras.optimizers.SGD(0.01))
        adam = adam_times(model_name)
        grad = gradient_times(model_name)
        # each call on a fresh model instance, Grappler off (the default) and on
        # alternating, so that the process's own first-time costs fall on both
        rounds = {"off": [], "default": []}
        for _ in range(FLAGS.per_example_rounds):
            for mode, times in rounds.items():
                times.append(per_example_times(model_name, graph_optimization=mode))
        base = adam["first step"]
        rows.append((model_name, "Adam first step", adam["first step"], 1.0))
        rows.append((model_name, "Adam later step", adam["later step"],
                     adam["later step"] / base))
        op_rows.append((model_name, "Adam step", adam["ops"], 1.0))
        for variant in FLAGS.variants:
            kfac, parts, ops = kfac_times(model_name, variant)
            op_rows.append((model_name, f"K-FAC {variant} step", ops, ops / adam["ops"]))
            for label, seconds in kfac.items():
                rows.append((model_name, f"K-FAC {variant}: {label}", seconds, seconds / base))
            for label, seconds in parts.items():
                rows.append((model_name, f"  in the trace: {label}", seconds, seconds / base))
        rows.append((model_name, "batch gradient, first call", grad["first call"], 1.0))
        if not FLAGS.per_example_rounds:
            continue
        pxg, pxg_on = (mean_times(rounds["off"]), mean_times(rounds["default"]))
        rows.append((model_name, "per_example_gradients, first call", pxg["first call"],
                     pxg["first call"] / grad["first call"]))
        rows.append((model_name, "per_example_gradients, later call", pxg["later call"],
                     pxg["later call"] / grad["first call"]))
        for label, seconds in pxg_on.items():
            rows.append((model_name, f"per_example_gradients, Grappler on: {label}", seconds,
                         seconds / grad["first call"]))
    lines = ["| model | phase | seconds | ratio |", "|---|---|---:|---:|"]
    lines += [f"| {m} | {p} | {s:.2f} | {r:.2f} |" for m, p, s, r in rows]
    print("ratio: K-FAC and Adam rows over Adam's first step; per-example rows over the "
          "first batch-gradient call")
    lines += ["", "| model | traced step | operations | / Adam |", "|---|---|---:|---:|"]
    lines += [f"| {m} | {p} | {n} | {r:.1f} |" for m, p, n, r in op_rows]
    print("\n".join(lines))
    if FLAGS.markdown:
        with open(FLAGS.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    app.run(main)
