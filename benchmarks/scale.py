"""K-FAC at scale: cold start, step-time spread, counted arithmetic and the
estimator's memory, against SGD with momentum, side by side in one process.

Models (random weights, random data of the stated shapes):

- ``resnet50``: ``keras.applications.ResNet50``, 64x64, batch 32, 10 classes;
- ``efficientnetb0``: ``keras.applications.EfficientNetB0``, 64x64, batch 32;
- ``bert_small``: a hand-written Keras encoder (token embeddings and a
  learned position table, 4 layers of 4-head self-attention and a 1024-wide GELU
  feed-forward, d 256, post-layer-norm), sequence 128, batch 16, a 2-class
  softmax loss on the first token;
- ``autoencoder``: the digits autoencoder of ``digits.py``, batch 256.

Candidates per model: SGD with momentum 0.9 (the baseline), Adam (cold
start only), and ``kg.KFAC`` as ``defaults`` (quadratic model, adapted
damping, kept: ``qmodel_fallback=False``), ``regular`` (regular momentum,
lr 1e-3, fixed damping) and
``qmodel`` (the quadratic model at a fixed damping), each also with
``overhead_budget=--budget``, which spreads the covariances (each step
takes a slice's statistics; with ``--unspread`` also that budget with
``spread_covariances=False``: every ``P``-th step all of a batch's). Every
candidate is built and compiled first (``cold start``: construction and the
first step, over Adam's first step). One untimed step of each follows,
once all are built: a candidate's first step after other models were
built and run took seconds more (SGD's 5 s against its 0.6 s step on
ResNet50), once, and that had been the largest "step" of some rows. Then
``--rounds`` rounds each run ``--block`` steps of every candidate in
turn (interleaved, so the shared machine's load falls on all alike), every
step timed. Columns:

- ``cold / Adam``: the candidate's first step (construction, registration,
  tracing, compiling, running) over Adam's first step;
- ``median / SGD``, ``p99 / SGD``: the median and 99th-percentile step time
  over SGD's median step;
- ``counted``: ``kg.KFAC.cost_summary``'s counted multiply-adds of the
  amortised step over an SGD step's (``optimizer/costs.py``);
- ``memory``: the estimator's state (factors and cached inverses) over the
  parameters, in bytes;
- ``periods``: the covariance and inverse periods the step ran with (and the
  factor block size and the quadratic model's forms fraction an overhead
  budget picked, if any).

    python benchmarks/scale.py [--models resnet50,efficientnetb0,bert_small,autoencoder]
        [--variants defaults,regular,qmodel] [--budget 3] [--unspread] [--rounds 3] [--block 10]
        [--markdown out.md]
"""
from __future__ import annotations

import gc
import time

import bench_env  # noqa: F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import digits  # noqa: E402
from bert_small import batch as bert_batch, bert_small  # noqa: E402
import kfac_graph as kg  # noqa: E402
from lm_race import keras_step  # noqa: E402
from kfac_graph.optimizer import costs, plan  # noqa: E402

tf.get_logger().setLevel("ERROR")

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["resnet50", "efficientnetb0", "bert_small", "autoencoder"],
                  "models")
flags.DEFINE_list("variants", ["defaults", "regular", "qmodel"], "K-FAC variants")
flags.DEFINE_float("budget", 3.0, "overhead_budget of the budgeted rows (0: no such rows)")
flags.DEFINE_boolean("unspread", False, "also the budgeted rows with spread_covariances=False")
flags.DEFINE_integer("rounds", 3, "interleaved rounds")
flags.DEFINE_integer("block", 10, "steps of each candidate per round")
flags.DEFINE_string("markdown", None, "also write the table as markdown here")

# the quadratic model's rows time its own step: no hand-over to regular momentum
# where its cap shortens most steps (ResNet50 at batch 32; qmodel_fallback.py)
VARIANTS = {
    "defaults": {"qmodel_fallback": False},
    "regular": {"momentum_type": "regular", "learning_rate": 1e-3, "adapt_damping": False},
    "qmodel": {"adapt_damping": False, "qmodel_fallback": False},
}


def make(name):
    """``(model, loss(x, y), batches)`` with fresh weights (seed 0)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if name == "autoencoder":
        task = digits.make_task("autoencoder")
        return task.model, task.loss_fn.python_function, task.batches(FLAGS.block, 256)
    if name == "bert_small":
        model = bert_small()
        batches = [bert_batch(rng) for _ in range(FLAGS.block)]
    else:
        build = {"resnet50": keras.applications.ResNet50,
                 "efficientnetb0": keras.applications.EfficientNetB0}[name]
        model = build(input_shape=(64, 64, 3), weights=None, classes=10,
                      classifier_activation=None)
        batches = [(tf.constant(rng.normal(size=(32, 64, 64, 3)), tf.float32),
                    tf.constant(rng.integers(0, 10, 32), tf.int32)) for _ in range(FLAGS.block)]

    def loss(x, y):
        logits = model(x, training=True)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    return model, loss, batches


def first_order(name, optimizer):
    model, loss, batches = make(name)
    optimizer.build(model.trainable_variables)
    return keras_step(model, loss, optimizer, jit_compile=False), batches


def timed(step, x, y):
    start = time.perf_counter()
    step(x, y).numpy()
    return time.perf_counter() - start


def estimator_bytes(opt):
    return sum(int(np.prod(v.shape)) * v.dtype.size for v in opt.estimator.variables)


def candidates(name):
    """``[(label, step, batches, info)]``, each built and run once (its cold start)."""
    out = []
    for label, optimizer in (("SGD", keras.optimizers.SGD(0.01, momentum=0.9)),
                             ("Adam", keras.optimizers.Adam(1e-3))):
        step, batches = first_order(name, optimizer)
        cold = timed(step, *batches[0])
        out.append((label, step, batches, {"cold": cold}))
        print(f"  {name} {label}: first step {cold:.1f} s", flush=True)
    # (budget, spread_covariances): a budget spreads the covariances by default
    budgets = [(None, None)] + ([(FLAGS.budget, None)] if FLAGS.budget else [])
    budgets += [(FLAGS.budget, False)] if FLAGS.budget and FLAGS.unspread else []
    for variant in FLAGS.variants:
        for budget, spread in budgets:
            model, loss, batches = make(name)
            start = time.perf_counter()
            opt = kg.KFAC(kg.auto_register(loss), overhead_budget=budget,
                          spread_covariances=spread, **VARIANTS[variant])
            opt.step(*batches[0]).numpy()
            cold = time.perf_counter() - start
            options = plan.cost_options(opt)
            counted = (costs.step_multiply_adds(opt.costs, opt.cov_update_period,
                                                opt.inverse_update_period, options)
                       / costs.sgd_multiply_adds(opt.costs))
            params = sum(int(np.prod(v.shape)) * v.dtype.size for v in opt.variables_to_train)
            label = variant if budget is None else f"{variant}, budget {budget:g}"
            label += ", not spread" if spread is False else ""
            info = {"cold": cold, "counted": counted, "memory": estimator_bytes(opt) / params,
                    "periods": f"{opt.cov_update_period}/{opt.inverse_update_period}"}
            if opt.schedule.spread and opt.schedule.slice_stride > 1:
                info["periods"] += f", a slice every {opt.schedule.slice_stride} steps"
            if opt.estimator.factor_block_size:  # the budget's choice
                info["periods"] += f", blocks of {opt.estimator.factor_block_size}"
            if opt.momentum_type == "qmodel" and opt.qmodel_batch_fraction < 1:
                info["periods"] += f", forms on {opt.qmodel_batch_fraction:g} of the batch"
            out.append((label, opt.step, batches, info))
            print(f"  {name} K-FAC {label}: first step {cold:.1f} s", flush=True)
    return out


def measure(name):
    runs = candidates(name)
    # the built graphs stay alive: without this, collecting them lands in random steps
    gc.collect()
    gc.freeze()
    times = {label: [] for label, *_ in runs}
    for label, step, batches, _ in runs:  # the untimed round (module docstring)
        if label != "Adam":
            timed(step, *batches[0])
    for _ in range(FLAGS.rounds):
        for label, step, batches, _ in runs:
            if label == "Adam":
                continue
            times[label] += [timed(step, x, y) for x, y in batches]
    sgd = float(np.median(times["SGD"]))
    adam = dict((label, info) for label, _, _, info in runs)["Adam"]["cold"]
    rows = []
    for label, _, _, info in runs:
        if label == "Adam":
            continue
        steps = np.array(times[label])
        rows.append((name, label, info["cold"] / adam, np.median(steps) / sgd,
                     np.percentile(steps, 99) / sgd, info.get("counted"), info.get("memory"),
                     info.get("periods", "-")))
    return rows


def main(argv):
    del argv
    rows = []
    for name in FLAGS.models:
        rows += measure(name)
    fmt = lambda x: "-" if x is None else f"{x:.2f}"
    lines = [f"{FLAGS.rounds} interleaved rounds of {FLAGS.block} steps; ratios over SGD's "
             "median step (cold start: over Adam's first step)", "",
             "| model | optimizer | cold / Adam | median / SGD | p99 / SGD | counted | memory "
             "| periods |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for name, label, cold, median, p99, counted, memory, periods in rows:
        lines.append(f"| {name} | {label} | {cold:.2f} | {median:.2f} | {p99:.2f} | "
                     f"{fmt(counted)} | {fmt(memory)} | {periods} |")
    text = "\n".join(lines)
    print("\n" + text)
    if FLAGS.markdown:
        with open(FLAGS.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    app.run(main)
