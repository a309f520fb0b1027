"""How much two batches' preconditioned gradients agree, along a K-FAC run
on the digits (``digits.py``): why the quadratic model can steer some
models' steps from one batch and not others'.

For batches ``a`` and ``b`` at the same parameters, with ``P`` the
optimizer's preconditioner at that step (``kg.KFAC.precondition``),

    agreement = 2 g_a.P g_b / (g_a.P g_a + g_b.P g_b)

is 1 where the two gradients are the same and about 0 where each batch's
gradient is mostly its own noise: ``g.P g`` over a batch estimates
``gbar.P gbar + tr(P Sigma) / B`` and ``g_a.P g_b`` the first term alone. A
step that minimises one batch's model of the loss then does little for the
next batch's. The table gives, after each of ``--at`` steps of one
``--kfac`` run, the median and range over ``--pairs`` pairs of fresh
batches, with ``P = I`` (plain gradients) beside it.

    python benchmarks/gradient_agreement.py --model resnet50 --batch_size 32
        --kfac "momentum_type=regular adapt_damping=False damping=1e-3" --at 1,20,50
"""
import bench_env  # noqa: F401  (first: quiet logs, the repository importable)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import digits  # noqa: E402
import kfac_graph as kg  # noqa: E402
from kfac_graph.optimizer import vectors as vec  # noqa: E402
import kfac_spec  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "cnn", "autoencoder, cnn or resnet50")
flags.DEFINE_integer("batch_size", 32, "batch size of the run and of the pairs")
flags.DEFINE_string("kfac", "", "the run's K-FAC settings (kfac_spec.py; '' = the defaults)")
flags.DEFINE_list("at", ["1", "20", "50"], "steps after which to measure")
flags.DEFINE_integer("pairs", 4, "pairs of fresh batches per measurement")
flags.DEFINE_integer("seed", 0, "seed of the weights and the batches")


def _dot(xs, ys):
    """``sum_k <x_k, y_k>`` in float64 (the agreements are small ratios)."""
    return float(vec.dot([tf.cast(x, tf.float64) for x in xs], ys))


def agreement(ga, gb, pa, pb):
    """``2 g_a.p_b / (g_a.p_a + g_b.p_b)`` with ``p = P g``."""
    return 2 * _dot(ga, pb) / (_dot(ga, pa) + _dot(gb, pb))


def main(_):
    task = digits.make_task(FLAGS.model, FLAGS.seed)
    _, options = kfac_spec.parse(FLAGS.kfac)
    opt = kg.KFAC(task.loss_fn, **options)
    at = sorted(int(s) for s in FLAGS.at)
    batches = task.batches(at[-1] + 2 * FLAGS.pairs, FLAGS.batch_size, FLAGS.seed)
    fresh = batches[at[-1]:]

    @tf.function
    def gradients(x, t, variables):
        with tf.GradientTape() as tape:
            loss = task.loss_fn.python_function(x, t)
        return tape.gradient(loss, variables)

    print(f"{FLAGS.model}, batch {FLAGS.batch_size}, kg.KFAC({FLAGS.kfac or 'defaults'})")
    print("| after step | full loss | agreement, P | range | agreement, I | range |")
    print("|---:|---:|---:|---|---:|---|")
    for step, (x, t) in enumerate(batches[:at[-1]], start=1):
        opt.step(x, t)
        if step not in at:
            continue
        variables = list(opt.registration.variables)
        grads = [gradients(x2, t2, variables) for x2, t2 in fresh]
        pre = [opt.precondition(g) for g in grads]
        with_p = [agreement(grads[i], grads[i + 1], pre[i], pre[i + 1])
                  for i in range(0, len(grads), 2)]
        plain = [agreement(grads[i], grads[i + 1], grads[i], grads[i + 1])
                 for i in range(0, len(grads), 2)]
        print(f"| {step} | {task.full_loss():.3f} | {np.median(with_p):.3f} | "
              f"{min(with_p):.3f} to {max(with_p):.3f} | {np.median(plain):.3f} | "
              f"{min(plain):.3f} to {max(plain):.3f} |", flush=True)


if __name__ == "__main__":
    app.run(main)
