"""What the offline rewrite costs, and whether its output trains as fast as
``kg.KFAC`` in the process that built it.

For each digits model (``digits.py``: the autoencoder and the CNN), the
model and its loss are saved as a SavedModel (a ``tf.Module`` with the loss
as a ``tf.function`` with an input signature), then rewritten by
``kfac_graph.emit.rewrite_saved_model`` (what ``kfac-rewrite`` runs). The
rewritten model's ``kfac_step`` and an in-process ``kg.KFAC`` on a fresh
copy of the same model are then run side by side, interleaved, on the same
batches, each block ``inverse_update_period`` steps long (one inverse
refresh per block). Defaults of ``kg.KFAC`` for both.

Columns: rewrite: wall seconds of the rewrite (load, register, trace, save);
load: seconds to load the output; size: the output's size on disk;
step / in-process: median block time of the rewritten model's steps over
the in-process optimizer's; max rel diff: the largest relative difference
between the two runs' losses over every step timed.

    python benchmarks/rewrite.py [--reps 5] [--models autoencoder,cnn]
"""
import os
import tempfile
import time

import bench_env  # noqa: E402,F401  (first: quiet logs, the repository importable)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import digits  # noqa: E402
import kfac_graph as kg  # noqa: E402
from kfac_graph import emit  # noqa: E402

tf.get_logger().setLevel("ERROR")

FLAGS = flags.FLAGS
flags.DEFINE_integer("reps", 5, "interleaved rounds (medians)")
flags.DEFINE_list("models", list(digits.MODELS), "models: autoencoder, cnn")
flags.DEFINE_integer("inverse_update_period", 10, "K-FAC's inverse period (the block length)")
flags.DEFINE_integer("batch_size", 256, "batch size")


def saved_task(task, path):
    """Saves ``task``'s model with its loss as a signature-carrying function."""
    module = tf.Module()
    module.model = task.model
    signature = [tf.TensorSpec([None, *task.inputs.shape[1:]], task.inputs.dtype),
                 tf.TensorSpec([None, *task.targets.shape[1:]], task.targets.dtype)]
    module.loss = tf.function(task.loss_fn.python_function, input_signature=signature)
    tf.saved_model.save(module, path)


def directory_mb(path):
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path)
               for f in files) / 2**20


def measure(name, workdir):
    period = FLAGS.inverse_update_period
    saved_task(digits.make_task(name), os.path.join(workdir, f"{name}_in"))
    out = os.path.join(workdir, f"{name}_kfac")
    start = time.perf_counter()
    emit.rewrite_saved_model(os.path.join(workdir, f"{name}_in"), "loss", out,
                             inverse_update_period=period)
    rewrite_s = time.perf_counter() - start
    start = time.perf_counter()
    rewritten = tf.saved_model.load(out)
    load_s = time.perf_counter() - start
    task = digits.make_task(name)  # the same initial weights as the saved model
    optimizer = kg.KFAC(task.loss_fn, inverse_update_period=period)
    steps = {"rewritten": rewritten.kfac_step, "in-process": optimizer.step}
    batches = task.batches(period * (FLAGS.reps + 1), FLAGS.batch_size)
    blocks = [batches[i * period:(i + 1) * period] for i in range(FLAGS.reps + 1)]
    times = {k: [] for k in steps}
    losses = {k: [] for k in steps}
    for r, block in enumerate(blocks):  # block 0 compiles and warms up
        for key, step in steps.items():
            start = time.perf_counter()
            values = [step(x, t).numpy() for x, t in block]
            if r:
                times[key].append(time.perf_counter() - start)
            losses[key] += values
    a, b = np.array(losses["rewritten"]), np.array(losses["in-process"])
    diff = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))
    ratio = np.median(times["rewritten"]) / np.median(times["in-process"])
    return name, rewrite_s, load_s, directory_mb(out), ratio, diff


def main(argv):
    del argv
    with tempfile.TemporaryDirectory() as workdir:
        rows = [measure(name, workdir) for name in FLAGS.models]
    lines = [f"kfac-rewrite on the digits models; rewritten kfac_step against in-process "
             f"kg.KFAC, blocks of {FLAGS.inverse_update_period} steps, batch "
             f"{FLAGS.batch_size}, medians of {FLAGS.reps} interleaved rounds", "",
             "| model | rewrite (s) | load (s) | size (MB) | step / in-process | max rel diff |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, rewrite_s, load_s, size, ratio, diff in rows:
        lines.append(f"| {name} | {rewrite_s:.1f} | {load_s:.1f} | {size:.1f} | {ratio:.2f} "
                     f"| {diff:.1e} |")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    app.run(main)
