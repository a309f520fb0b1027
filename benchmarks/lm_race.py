"""A race of optimizers on one language model, shared by the language model
benchmarks (``recurrent_lm.py``; the model comes from the caller).

Each ``Run`` trains its own copy of the model on the same batches; the
held-out loss (mean per-token cross-entropy on fixed held-out windows) is
evaluated every ``eval_every`` steps, outside the timing. The reference is
the best Adam run's held-out loss after its last step (Adam and AdamW each
get a grid of learning rates); for every run the table gives the steps and
the seconds (first step excluded, shown apart) it took to reach that loss,
its median step time over Adam's, and its held-out loss at the end.
"""
import time

import keras
import numpy as np
import tensorflow as tf

import kfac_graph as kg


class Run:
    """One optimizer on its own copy of the model: ``step(x, y) -> loss``,
    ``evaluate() -> held-out loss``, trained for ``max_steps``."""

    def __init__(self, label, family, step, evaluate, max_steps):
        self.label, self.family, self.step, self._evaluate = label, family, step, evaluate
        self.max_steps = max_steps
        self.times, self.eval_steps, self.eval_losses = [], [], []
        self.failed = None

    def train_step(self, i, x, y):
        if self.failed:
            return
        start = time.perf_counter()
        try:
            loss = float(self.step(x, y))
        except tf.errors.OpError as e:
            self.failed = (i, str(e).strip().splitlines()[0][:160])
            print(f"  {self.label} failed at step {i}: {self.failed[1]}", flush=True)
            return
        self.times.append(time.perf_counter() - start)
        if not np.isfinite(loss):
            self.failed = (i, f"loss {loss}")

    def evaluate(self, i):
        if not self.failed:
            self.eval_steps.append(i)
            self.eval_losses.append(float(self._evaluate()))

    @property
    def first_step(self):
        return self.times[0] if self.times else float("nan")

    def seconds_after(self, i):
        """Training seconds after step ``i``, the first step excluded."""
        return float(np.sum(self.times[1:i]))

    def loss_at_seconds(self, seconds):
        """The held-out loss of the last evaluation within ``seconds`` of training."""
        within = [loss for i, loss in zip(self.eval_steps, self.eval_losses)
                  if self.seconds_after(i) <= seconds]
        return within[-1] if within else float("nan")

    def reached(self, target):
        """(step, seconds) of the first evaluation at or below ``target``, or None."""
        for i, loss in zip(self.eval_steps, self.eval_losses):
            if loss <= target:
                return i, self.seconds_after(i)
        return None


def keras_step(model, loss_fn, optimizer, jit_compile):
    """A compiled training step of a Keras optimizer on ``loss_fn(*batch)``
    over ``model``'s trainable variables (or ``model``, a list of them)."""
    variables = getattr(model, "trainable_variables", model)

    @tf.function(jit_compile=jit_compile)
    def step(*batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(*batch)
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss
    return step


def race(runs, batches, eval_every, log_every=500):
    """Trains every run on ``batches`` (interleaved step by step, so that the
    machine's load falls on all alike)."""
    for run in runs:
        run.evaluate(0)
    for i, (x, y) in enumerate(batches, start=1):
        for run in runs:
            if i <= run.max_steps:
                run.train_step(i, x, y)
        if i % eval_every == 0:
            for run in runs:
                if i <= run.max_steps:
                    run.evaluate(i)
        if i % log_every == 0:
            print(f"  step {i}: " + ", ".join(f"{r.label} {r.eval_losses[-1]:.3f}"
                                              for r in runs if r.eval_losses), flush=True)


def table(runs, reference_families=("adam",)):
    """Markdown rows; the target is the best ``reference_families`` run's
    final held-out loss, and every run's loss after as many training seconds
    as that run took is shown beside its own final loss."""
    refs = [r for r in runs if r.family in reference_families and not r.failed]
    best = min(refs, key=lambda r: r.eval_losses[-1])
    target, budget = best.eval_losses[-1], best.seconds_after(best.eval_steps[-1])
    ref_step = np.median(best.times[1:])
    lines = [f"target: {best.label}'s held-out loss after {best.eval_steps[-1]} steps, "
             f"{target:.4f} ({budget:.0f} s of training)\n",
             f"| run | steps to target | seconds to target | first step s | step / {best.label}'s "
             f"| loss after {budget:.0f} s | final held-out loss (step) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        if r.failed:
            lines.append(f"| {r.label} | failed at step {r.failed[0]}: {r.failed[1]} "
                         "| | | | | |")
            continue
        hit = r.reached(target)
        steps, secs = (str(hit[0]), f"{hit[1]:.0f}") if hit else ("not reached", "-")
        lines.append(f"| {r.label} | {steps} | {secs} | {r.first_step:.1f} | "
                     f"{np.median(r.times[1:]) / ref_step:.2f} | "
                     f"{r.loss_at_seconds(budget):.4f} | "
                     f"{r.eval_losses[-1]:.4f} ({r.eval_steps[-1]}) |")
    return "\n".join(lines), best, target


def median_ratio(fns, args, reps):
    """``fns`` = {"batch": f, other: g}: median seconds of ``g(*args)`` over
    ``f(*args)``'s, timed interleaved after two warm calls."""
    times = {k: [] for k in fns}
    for f in fns.values():
        f(*args), f(*args)
    for _ in range(reps):
        for k, f in fns.items():
            start = time.perf_counter()
            tf.nest.map_structure(np.asarray, f(*args))
            times[k].append(time.perf_counter() - start)
    other = next(k for k in fns if k != "batch")
    return float(np.median(times[other]) / np.median(times["batch"]))


def plot(runs, path, title):
    """Held-out loss against training seconds, one line per run."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        if r.eval_losses and not r.failed:
            ax.plot([r.seconds_after(i) for i in r.eval_steps], r.eval_losses, label=r.label)
    ax.set_xlabel("training seconds (first step excluded)")
    ax.set_ylabel("held-out loss (nats per character)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def evaluator(model, held_out):
    """``evaluate() -> held-out loss``: mean per-token cross-entropy of
    ``model`` (inference mode) on the windows ``held_out = (x, y)``."""
    x, y = (tf.constant(t) for t in held_out)

    @tf.function
    def evaluate():
        logits = model(x, training=False)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
    return evaluate


def norms_cost(model, loss_fn, batch, reps):
    """Median seconds of ``kg.per_example_gradient_norms`` over a batch
    gradient's, on ``batch``, for the registered ``loss_fn`` of ``model``."""
    variables = model.trainable_variables

    @tf.function
    def batch_gradient(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(x, y)
        return tape.gradient(loss, variables)

    fns = {"batch": batch_gradient,
           "norms": tf.function(lambda x, y: kg.per_example_gradient_norms(loss_fn, x, y))}
    return median_ratio(fns, batch, reps)


def adam_family(name, lr, weight_decay):
    """A fresh Keras Adam or AdamW."""
    if name == "adamw":
        return keras.optimizers.AdamW(lr, weight_decay=weight_decay)
    return keras.optimizers.Adam(lr)
