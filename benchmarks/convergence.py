"""K-FAC against Adam and SGD with momentum on the digits (``digits.py``):
training loss against steps and against seconds.

For each model, every optimizer starts from the same initial weights and
sees the same minibatches in the same order (batch 256, one seeded shuffle
per epoch). Runs are interleaved step by step (round robin), so load on the
shared machine slows them alike. Every ``--eval_every`` steps the loss on the
whole training set (1797 digits) is recorded, outside the timed region.

Candidates: ``kg.KFAC`` with its default settings (more with ``--kfac``),
Adam over ``--adam_lrs`` and SGD with momentum ``--momentum`` over
``--sgd_lrs``. The first-order steps take their fastest setting here: the
whole step under XLA for the autoencoder, TensorFlow's own kernels for the
CNN, whose convolutions XLA runs slowly on the CPU (K-FAC's
``jit_compile="auto"`` compiles the whole step on accelerators only).

The target is Adam's best full-training-set loss at the last step; the table
gives the steps and seconds each candidate needs to reach it (seconds: the
step times summed, the first, compiling, step counted at the median step
time; its own time is the ``compile s`` column; ``ms / step``: the mean
over the other steps, so the inverse refreshes are amortised; ``capped steps``: for the
quadratic model, the steps whose update its cap shortened, ``cap_watch.py``). Plots of loss
against steps and seconds go to ``--out``.

    python benchmarks/convergence.py [--steps 1000] [--models autoencoder,cnn]
        [--out benchmarks/out] [--kfac "" --kfac "momentum_type=adam"]

By default three K-FAC runs: the defaults (``jit_compile="auto"``), the
defaults without XLA where "auto" chose XLA, and the quadratic model with
adaptive damping from 0.1 (Martens & Grosse's setting; at the default
damping 1e-3 it diverges on the CNN).
"""
import json
import os
import time

import bench_env  # noqa: E402,F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import digits  # noqa: E402
import kfac_graph as kg  # noqa: E402
import kfac_spec  # noqa: E402

tf.get_logger().setLevel("ERROR")

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 1000, "training steps per run")
flags.DEFINE_list("models", list(digits.MODELS), "models: autoencoder, cnn (or resnet50)")
flags.DEFINE_integer("batch_size", 256, "batch size")
flags.DEFINE_integer("eval_every", 10, "steps between whole-training-set losses")
flags.DEFINE_list("adam_lrs", ["1e-3", "3e-3", "1e-2"], "Adam learning rates")
flags.DEFINE_list("sgd_lrs", ["0.01", "0.03", "0.1"], "SGD learning rates")
flags.DEFINE_float("momentum", 0.9, "SGD momentum")
flags.DEFINE_multi_string(
    "kfac", ["label=defaults", "label=no-XLA jit_compile=False",
             "label=regular momentum_type=regular adapt_damping=False damping=1e-3"],
    "K-FAC settings, one run each: space-separated key=value pairs for kg.KFAC, plus "
    "label=NAME ('' = the defaults); repeatable. A run that resolves to the same settings "
    "as an earlier one (jit_compile=False where 'auto' already chose no XLA) is left out")
flags.DEFINE_integer("seed", 0, "seed of the initial weights and the data order")
flags.DEFINE_string("out", os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
                    "where plots and the results JSON go")


class Run:
    """One optimizer on its own copy of the model."""

    def __init__(self, label, family, task, step):
        self.label, self.family, self.task, self.step = label, family, task, step
        self.times = []
        self.eval_steps, self.eval_losses = [], []
        self.failed = None  # (step, message) once a step raised
        self.capped = None  # the quadratic model's capped-step count (cap_watch.py), if any

    def train_step(self, step, x, t):
        if self.failed:
            return
        start = time.perf_counter()
        try:
            self.step(x, t).numpy()
        except tf.errors.OpError as e:
            lines = [line for line in e.message.strip().splitlines()
                     if line.strip() and not line.startswith((" ", "\t", "["))]
            self.failed = (step, (lines[-1] if lines else type(e).__name__)[:160])
            print(f"  {self.label} failed at step {step}: {self.failed[1]}", flush=True)
            return
        self.times.append(time.perf_counter() - start)

    def evaluate(self, step):
        if self.failed:
            return
        self.eval_steps.append(step)
        self.eval_losses.append(self.task.full_loss())

    def seconds(self):
        """Cumulative seconds after each step, the first (compiling) step
        counted at the median step time."""
        times = np.array(self.times)
        if len(times) > 1:
            times[0] = np.median(times[1:])
        return np.cumsum(times)


def make_runs(model: str, first_batch):
    runs, seen = [], set()
    for spec in FLAGS.kfac:
        task = digits.make_task(model, FLAGS.seed)
        label, options = kfac_spec.parse(spec, default_label=spec or "defaults")
        opt = kg.KFAC(task.loss_fn, **options)
        opt.build(*first_batch)
        shown = ", ".join(f"{k}={v!r}" for k, v in options.items())
        options.pop("jit_compile", None)
        key = (tuple(sorted(options.items())), opt.whole_step_jit)
        if key in seen:
            continue
        seen.add(key)
        xla = "XLA" if opt.whole_step_jit else "no XLA"
        runs.append(Run(f"K-FAC {label} ({xla})", "kfac", task, opt.step))
        if opt.momentum_type == "qmodel":
            runs[-1].capped = lambda watch=opt.cap_watch: int(watch.capped_steps)
        print(f"  {runs[-1].label}: kg.KFAC({shown})")
    for lr in FLAGS.adam_lrs:
        task = digits.make_task(model, FLAGS.seed)
        runs.append(Run(f"Adam lr={lr}", "adam", task, digits.keras_step(
            task, keras.optimizers.Adam(float(lr)), jit_compile=not task.has_conv)))
    for lr in FLAGS.sgd_lrs:
        task = digits.make_task(model, FLAGS.seed)
        runs.append(Run(f"SGD lr={lr} m={FLAGS.momentum:g}", "sgd", task, digits.keras_step(
            task, keras.optimizers.SGD(float(lr), momentum=FLAGS.momentum),
            jit_compile=not task.has_conv)))
    return runs


def train(model: str):
    batches = digits.make_task(model, FLAGS.seed).batches(FLAGS.steps, FLAGS.batch_size,
                                                          FLAGS.seed)
    runs = make_runs(model, batches[0])
    for run in runs:
        run.evaluate(0)
    for step, (x, t) in enumerate(batches, start=1):
        for run in runs:
            run.train_step(step, x, t)
        if step % FLAGS.eval_every == 0 or step == FLAGS.steps:
            for run in runs:
                run.evaluate(step)
            if (step // FLAGS.eval_every) % 10 == 0 or step == FLAGS.steps:
                print(f"  {model} step {step}: " + ", ".join(
                    f"{r.label} {r.eval_losses[-1]:.4g}" for r in runs), flush=True)
    return runs


def report(model, runs):
    adam = [r for r in runs if r.family == "adam" and not r.failed]
    reference = min(adam, key=lambda r: r.eval_losses[-1]) if adam else None
    target = reference.eval_losses[-1] if reference else None
    rows = []
    for run in runs:
        seconds = run.seconds()
        reached = None
        if target is not None:
            hits = [s for s, loss in zip(run.eval_steps, run.eval_losses) if loss <= target]
            reached = hits[0] if hits else None
        rows.append({
            "optimizer": run.label, "final_loss": run.eval_losses[-1], "failed": run.failed,
            "best_loss": min(run.eval_losses),
            "steps_to_target": reached,
            "seconds_to_target": None if not reached else float(seconds[reached - 1]),
            "ms_per_step": 1e3 * float(np.mean(run.times[1:])) if len(run.times) > 1 else None,
            "compile_s": run.times[0] if run.times else None,
            "capped_steps": run.capped() if run.capped else None,
            "eval_steps": run.eval_steps, "eval_losses": run.eval_losses,
            "eval_seconds": [0.0] + [float(seconds[s - 1]) for s in run.eval_steps[1:]],
        })
    floor = runs[0].task.floor
    print(f"\n### {model}: {FLAGS.steps} steps, batch {FLAGS.batch_size}"
          + (f", loss floor (data entropy) {floor:.4f}" if floor is not None else ""))
    if reference:
        print(f"target: {reference.label} at step {FLAGS.steps}, loss {target:.4f}\n")
    print("| optimizer | final loss | steps to target | s to target | ms / step | compile s "
          "| capped steps |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        steps = r["steps_to_target"] or "not reached"
        secs = f"{r['seconds_to_target']:.1f}" if r["seconds_to_target"] is not None else "-"
        final = (f"{r['final_loss']:.4g}" if not r["failed"]
                 else f"failed at step {r['failed'][0]}")
        capped = "-" if r["capped_steps"] is None else r["capped_steps"]
        print(f"| {r['optimizer']} | {final} | {steps} | {secs} | "
              f"{r['ms_per_step']:.1f} | {r['compile_s']:.1f} | {capped} |")
    return {"model": model, "steps": FLAGS.steps, "batch_size": FLAGS.batch_size,
            "floor": floor, "target": target,
            "reference": reference.label if reference else None, "runs": rows}


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = result["floor"]
    shift = floor if floor is not None else 0.0
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"kfac": dict(lw=2.2), "adam": dict(lw=1.2), "sgd": dict(lw=1.2, ls="--")}
    for r in result["runs"]:
        family = ("kfac" if r["optimizer"].startswith("K-FAC")
                  else "adam" if r["optimizer"].startswith("Adam") else "sgd")
        y = np.array(r["eval_losses"]) - shift
        axes[0].plot(r["eval_steps"], y, label=r["optimizer"], **styles[family])
        axes[1].plot(r["eval_seconds"], y, label=r["optimizer"], **styles[family])
    start = max(r["eval_losses"][0] for r in result["runs"]) - shift
    for ax, xlabel in zip(axes, ("step", "seconds (training steps only)")):
        ax.set_yscale("log")
        ax.set_ylim(top=1.5 * start)  # a diverged run leaves the plot at the top
        ax.set_xlabel(xlabel)
        ax.set_ylabel("training loss" + (" - entropy floor" if floor is not None else ""))
        if result["target"] is not None:
            ax.axhline(result["target"] - shift, color="gray", lw=0.8, ls=":")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"digits {result['model']}: whole-training-set loss, batch "
                 f"{result['batch_size']} (dotted: Adam's best at step {result['steps']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv):
    del argv
    os.makedirs(FLAGS.out, exist_ok=True)
    pixels, _ = digits.digits()
    print(f"digits: {pixels.shape[0]} examples; entropy of the pixels (/16) summed over "
          f"pixels, averaged over examples: {digits.entropy_floor(pixels):.4f} nats")
    results = []
    for model in FLAGS.models:
        result = report(model, train(model))
        results.append(result)
        path = os.path.join(FLAGS.out, f"convergence_{model}.png")
        plot(result, path)
        print(f"plot: {path}")
    with open(os.path.join(FLAGS.out, "convergence.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)
