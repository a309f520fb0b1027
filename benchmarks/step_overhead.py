"""What a K-FAC step costs, as a multiple of an SGD-with-momentum step on the
same model and batch (the digits models of ``digits.py``, batch 256).

For each model and each compilation mode (the whole step under XLA, or
TensorFlow's own kernels with only K-FAC's preconditioning compiled), the
candidates are timed side by side in one process, interleaved: each round
runs a block of ``inverse_update_period`` steps of every candidate, so every
K-FAC block holds exactly one inverse refresh (the cost is amortised over
the inverse period). Figures are medians over ``--reps`` rounds.

Candidates: SGD (``keras.optimizers.SGD``, momentum 0.9, compiled like the
mode), ``kg.KFAC`` with ``momentum_type="regular"`` and a fixed damping
(the plain step: covariance update every step, inverses every 10), and
``kg.KFAC`` with its defaults (``momentum_type="qmodel"``: the quadratic
model chooses the learning rate and momentum from two more Fisher-vector
products per step; the damping adapts every 5 steps, re-evaluating the loss),
and the plain optimizer's compiled preconditioning alone, applied to a
gradient (``preconditioning``): what every K-FAC step adds to its gradient
at the least, whatever its statistics cost; and the same products with
TensorFlow's kernels instead of XLA's (``preconditioning, TF kernels``).

Columns: ``/ SGD``: the block time over SGD's in the same mode; ``per
round``: the lowest and highest of that ratio within single rounds (the
spread the shared machine's load leaves); ``/ SGD no-XLA``: over SGD without XLA (the common baseline); ``inverse step /
other``: the step that refreshes the inverses against the median of the
other steps.

    python benchmarks/step_overhead.py [--reps 5] [--models autoencoder,cnn]
        [--modes no_xla,xla] [--markdown out.md]
"""
import time

import bench_env  # noqa: E402,F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import digits  # noqa: E402
import kfac_graph as kg  # noqa: E402

tf.get_logger().setLevel("ERROR")

FLAGS = flags.FLAGS
flags.DEFINE_integer("reps", 5, "interleaved rounds (medians)")
flags.DEFINE_list("models", list(digits.MODELS), "models: autoencoder, cnn")
flags.DEFINE_list("modes", ["no_xla", "xla"], "compilation modes: no_xla, xla")
flags.DEFINE_integer("inverse_update_period", 10, "K-FAC's inverse period (the block length)")
flags.DEFINE_integer("batch_size", 256, "batch size")
flags.DEFINE_string("markdown", None, "also write the table as markdown here")

# the plain step: regular momentum at a fixed damping; the qmodel step: kg.KFAC's
# defaults (quadratic model, Levenberg-Marquardt damping adapted every 5 steps)
# the qmodel row times the quadratic model's own step (no hand-over, qmodel_fallback.py)
KFAC_VARIANTS = {"K-FAC": {"momentum_type": "regular", "adapt_damping": False},
                 "K-FAC qmodel": {"qmodel_fallback": False}}


def candidates(model):
    """``[(mode, name, step)]`` for one model."""
    out = []
    for mode in FLAGS.modes:
        xla = mode == "xla"
        task = digits.make_task(model)
        out.append((mode, "SGD", digits.keras_step(
            task, keras.optimizers.SGD(0.01, momentum=0.9), jit_compile=xla)))
        for name, options in KFAC_VARIANTS.items():
            task = digits.make_task(model)
            opt = kg.KFAC(task.loss_fn, jit_compile=xla,
                          inverse_update_period=FLAGS.inverse_update_period, **options)
            out.append((mode, name, opt.step))
            if name == "K-FAC":
                task = digits.make_task(model)
                opt = kg.KFAC(task.loss_fn, jit_compile=xla, **options)
                out.append((mode, "preconditioning", preconditioning_only(opt, opt.precondition)))
                if mode == "no_xla":
                    uncompiled = lambda vs, opt=opt: opt.estimator.multiply_inverse(vs,
                                                                                    refreshed=True)
                    out.append((mode, "preconditioning, TF kernels",
                                preconditioning_only(opt, uncompiled)))
    return out


def preconditioning_only(opt, products):
    """``step(x, t)``: ``products`` (``opt``'s preconditioning) of a fixed vector
    shaped like the gradient, in a ``tf.function`` (the first call takes one
    step, which builds ``opt`` and caches its inverses)."""
    vectors = None
    precondition = tf.function(products, autograph=False)

    def step(x, t):
        nonlocal vectors
        if vectors is None:
            opt.step(x, t)
            vectors = [tf.random.stateless_normal(v.shape, [0, i], dtype=v.dtype)
                       for i, v in enumerate(opt.variables_to_train)]
        return precondition(vectors)[0]

    return step


def measure(model):
    period = FLAGS.inverse_update_period
    batches = digits.make_task(model).batches(period, FLAGS.batch_size)
    runs = candidates(model)
    for mode, name, step in runs:  # compile, and the first inverse refresh
        start = time.perf_counter()
        for x, t in batches:
            step(x, t).numpy()
        print(f"  {model} {mode} {name}: warm-up block {time.perf_counter() - start:.1f} s",
              flush=True)
    blocks = {(mode, name): [] for mode, name, _ in runs}
    per_step = {(mode, name): [] for mode, name, _ in runs}
    for _ in range(FLAGS.reps):
        for mode, name, step in runs:
            times = []
            for x, t in batches:  # K-FAC's first step of a block refreshes the inverses
                start = time.perf_counter()
                step(x, t).numpy()
                times.append(time.perf_counter() - start)
            blocks[(mode, name)].append(sum(times))
            per_step[(mode, name)].append(times)
    rows = []
    base = {mode: np.median(blocks[(mode, "SGD")]) for mode in FLAGS.modes}
    common = base.get("no_xla")
    for mode, name, _ in runs:
        block = np.median(blocks[(mode, name)])
        # the same ratio within each round: the spread the machine's load leaves
        per_round = np.array(blocks[(mode, name)]) / np.array(blocks[(mode, "SGD")])
        steps = np.array(per_step[(mode, name)])
        inverse = np.median(steps[:, 0]) / np.median(steps[:, 1:])
        rows.append((model, mode, name, block / base[mode], per_round.min(), per_round.max(),
                     None if common is None else block / common, inverse))
    return rows


def main(argv):
    del argv
    rows = []
    for model in FLAGS.models:
        rows += measure(model)
    lines = [f"K-FAC step / SGD step, amortised over the inverse period "
             f"({FLAGS.inverse_update_period}), batch {FLAGS.batch_size}, medians of "
             f"{FLAGS.reps} interleaved rounds", "",
             "| model | mode | optimizer | / SGD | per round | / SGD no-XLA | inverse step / other |",
             "|---|---|---|---:|---:|---:|---:|"]
    for model, mode, name, ratio, low, high, common, inverse in rows:
        common = "-" if common is None else f"{common:.2f}"
        lines.append(f"| {model} | {mode} | {name} | {ratio:.2f} | {low:.2f}-{high:.2f} | {common} "
                     f"| {inverse:.1f} |")
    text = "\n".join(lines)
    print("\n" + text)
    if FLAGS.markdown:
        with open(FLAGS.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    app.run(main)
