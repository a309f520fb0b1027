"""The quadratic model's cap (``kfac_graph/optimizer/qmodel.py``): is a model
that promises more than the whole objective to be trusted, and what does
shortening such steps cost?

Part 1 (trust). ``kg.KFAC`` with the quadratic model and the cap switched
off, the damping adapted after every step so that each step reports
``rho`` (the loss's actual change over the undamped model's prediction
``M_0``) and ``M_0`` itself. Steps are split by the promise ``-M_0 / h``
(``h`` the loss before the step): above 1 the model says the loss falls
below zero, which no cross-entropy can. Problems: the small dense softmax
problem of the optimizer tests (a new batch each step, damping 1e-2,
exact Fisher factors; seeds 0-7) and the digits CNN and autoencoder
(``digits.py``) at K-FAC's defaults.

Part 2 (cost). The digits models at K-FAC's defaults, with and without the
cap, from the same initial weights on the same batches in the same order:
the whole training set's loss after ``--steps`` steps, and the skipped
steps.

    python benchmarks/qmodel_cap.py [--steps 200] [--dense_seeds 8]
"""
import contextlib
import sys
from unittest import mock

import bench_env  # noqa: F401  (first: quiet logs, the repository importable)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import digits  # noqa: E402
import kfac_graph as kg  # noqa: E402
from kfac_graph.optimizer import qmodel  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 200, "training steps per digits run")
flags.DEFINE_integer("dense_seeds", 8, "seeds of the dense softmax problem")
flags.DEFINE_integer("dense_steps", 8, "steps per dense run (one new batch each)")


def uncapped():
    """The quadratic model without its cap (an ablation for this benchmark)."""
    return mock.patch.object(qmodel, "cap", lambda quadratic, linear, objective:
                             tf.ones_like(tf.convert_to_tensor(linear)))


def dense_problem(seed, d_in=3, k=4, batch=8, steps=8):
    rng = np.random.default_rng(seed)
    w = tf.Variable(rng.normal(size=(d_in, k)), dtype=tf.float64)
    b = tf.Variable(rng.normal(size=(k,)) * 0.1, dtype=tf.float64)

    @kg.auto_register
    def loss_fn(x, y):
        logits = tf.matmul(x, w) + b
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    batches = [(tf.constant(rng.normal(size=(batch, d_in))),
                tf.constant(rng.integers(0, k, size=batch), tf.int32)) for _ in range(steps)]
    return loss_fn, batches


def promises_and_rhos(loss_fn, batches, **options):
    """``[(-M_0 / h, rho)]`` per step, damping adapted after every step, no cap."""
    out = []
    with uncapped():
        opt = kg.KFAC(loss_fn, damping_adaptation_interval=1, **options)
        for x, y in batches:
            h = float(opt.step(x, y))
            out.append((-float(opt.qmodel_change) / h, float(opt.rho)))
    return out


def trust_table(rows):
    print("| problem | promise -M_0/h | steps | rho min | rho median | rho max |")
    print("|---|---|---|---|---|---|")
    for name, pairs in rows:
        pairs = [(p, r) for p, r in pairs if np.isfinite(p)]
        for label, keep in (("<= 1", lambda p: p <= 1), ("> 1", lambda p: p > 1)):
            rhos = np.array([r for p, r in pairs if keep(p)])
            if rhos.size:
                print(f"| {name} | {label} | {rhos.size} | {rhos.min():.2f} | "
                      f"{np.median(rhos):.2f} | {rhos.max():.2f} |")
            else:
                print(f"| {name} | {label} | 0 | | | |")


def train(task, steps, capped):
    """Whole-set loss after ``steps`` default K-FAC steps, and the skipped steps."""
    task = digits.make_task(task)  # seeded: the same initial weights each time
    opt = kg.KFAC(task.loss_fn)
    with contextlib.nullcontext() if capped else uncapped():
        for x, t in task.batches(steps):
            opt.step(x, t)
    return task.full_loss(), int(opt.skipped_steps)


def main(argv):
    del argv
    rows = []
    pairs = []
    for seed in range(FLAGS.dense_seeds):
        loss_fn, batches = dense_problem(seed, steps=FLAGS.dense_steps)
        pairs += promises_and_rhos(loss_fn, batches, momentum_type="qmodel", damping=1e-2,
                                   estimation_mode="exact", cov_ema_decay=0.0,
                                   inverse_update_period=1, jit_compile=False)
    rows.append((f"dense softmax, {FLAGS.dense_seeds} seeds", pairs))
    for name in digits.MODELS:
        task = digits.make_task(name)
        rows.append((f"digits {name}, {FLAGS.dense_steps * 5} steps",
                     promises_and_rhos(task.loss_fn, task.batches(FLAGS.dense_steps * 5))))
    trust_table(rows)
    print()
    print(f"| digits model | loss after {FLAGS.steps} steps, capped | uncapped | skipped, capped |"
          " uncapped |")
    print("|---|---|---|---|---|")
    for name in digits.MODELS:
        (lc, sc), (lu, su) = train(name, FLAGS.steps, True), train(name, FLAGS.steps, False)
        print(f"| {name} | {lc:.4g} | {lu:.4g} | {sc} | {su} |")
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main)
