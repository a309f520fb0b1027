"""What factors in diagonal blocks (``factor_block_size``) cost, against full
factors, on ``keras.applications.ResNet50`` (64x64, batch 32, 10 classes) or,
with ``--model bert_small``, on ``bert_small.py``'s encoder (batch 16 x 128).

For full factors and each ``--sizes`` block size: the counted
preconditioning (``optimizer/costs.py``) over an SGD step's ``3 F``, the
counted refresh of every inverse over ``3 F``, the estimator's state over
the parameters (bytes), and the measured time of the preconditioning alone
(``KFAC.precondition`` on fresh caches, TensorFlow's kernels as on the CPU
by default) and of a refresh of every block's inverses (``KFAC.refresh_inverses``)
over the batch gradient's (a ``tf.function`` of the loss's
``GradientTape`` gradient), both medians of ``--reps`` calls interleaved in
one process. Then, with ``--steps`` > 0, whole regular-momentum K-FAC steps
at fixed periods ``--periods`` (not spread) beside an SGD-with-momentum
step, interleaved: the median step over SGD's and the counted step over
SGD's.

    python benchmarks/factor_blocks.py [--model resnet50] [--sizes 1024,512,256]
        [--reps 7] [--steps 6] [--periods 100/1000]
"""
from __future__ import annotations

import bench_env  # noqa: F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import kfac_graph as kg  # noqa: E402
from bert_small import batch as bert_batch, bert_small  # noqa: E402
from kfac_graph.optimizer import costs, plan  # noqa: E402
from lm_race import keras_step  # noqa: E402
from per_example_rules import time_all  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "resnet50", ["resnet50", "bert_small"], "the model")
flags.DEFINE_list("sizes", ["1024", "512", "256"], "factor_block_size values")
flags.DEFINE_integer("reps", 7, "interleaved timed calls of each preconditioning")
flags.DEFINE_integer("steps", 6, "interleaved timed whole steps of each optimizer (0: none)")
flags.DEFINE_string("periods", "100/1000", "cov_update_period/inverse_update_period")


def model_and_loss():
    keras.utils.set_random_seed(0)
    model = bert_small() if FLAGS.model == "bert_small" else keras.applications.ResNet50(
        input_shape=(64, 64, 3), weights=None, classes=10, classifier_activation=None)

    def loss(x, y):
        logits = model(x, training=True)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    return model, loss


def median_ratios(fns, reps, base):
    """Each callable's median time over ``base``'s, called in turn ``reps`` times."""
    times = time_all(fns, reps)
    return {k: t / times[base] for k, t in times.items()}


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    if FLAGS.model == "bert_small":
        x, y = bert_batch(rng)
    else:
        x = tf.constant(rng.normal(size=(32, 64, 64, 3)), tf.float32)
        y = tf.constant(rng.integers(0, 10, 32), tf.int32)
    cov, inverse = (int(p) for p in FLAGS.periods.split("/"))
    labels = ["full"] + [f"blocks of {s}" for s in FLAGS.sizes]
    block_sizes = [None] + [int(s) for s in FLAGS.sizes]
    model, loss = model_and_loss()

    @tf.function
    def gradient():
        with tf.GradientTape() as tape:
            value = loss(x, y)
        return tape.gradient(value, model.trainable_variables)

    sgd = keras.optimizers.SGD(0.01, momentum=0.9)
    sgd.build(model.trainable_variables)
    sgd_step = keras_step(model, loss, sgd, jit_compile=False)
    calls, steps, rows = {"gradient": gradient}, {"SGD": lambda: sgd_step(x, y)}, {}
    for label, size in zip(labels, block_sizes):
        _, own_loss = model_and_loss()
        opt = kg.KFAC(kg.auto_register(own_loss), momentum_type="regular", learning_rate=1e-3,
                      adapt_damping=False, cov_update_period=cov, inverse_update_period=inverse,
                      spread_covariances=False, factor_block_size=size)
        opt.build(x, y)
        opt.refresh_inverses()
        vectors = [tf.random.normal(v.shape) for v in opt.variables_to_train]
        precondition = tf.function(lambda vs, opt=opt: opt.precondition(vs))
        calls[label] = lambda p=precondition, vs=vectors: p(vs)
        refresh = tf.function(lambda opt=opt: [opt.refresh_inverses(), tf.constant(0.0)][1])
        calls[f"{label}: refresh"] = lambda r=refresh: r()
        if FLAGS.steps:
            steps[label] = lambda opt=opt: opt.step(x, y)
        forward = 3 * sum(c.forward for c in opt.costs)
        params = sum(int(np.prod(v.shape)) * v.dtype.size for v in opt.variables_to_train)
        state = sum(int(np.prod(v.shape)) * v.dtype.size for v in opt.estimator.variables)
        rows[label] = {
            "precondition": sum(c.precondition for c in opt.costs) / forward,
            "refresh": sum(c.inverse for c in opt.costs) / forward,
            "memory": state / params,
            "step counted": costs.step_multiply_adds(opt.costs, cov, inverse,
                                                     plan.cost_options(opt)) / forward}
    measured = median_ratios(calls, FLAGS.reps, "gradient")
    stepped = median_ratios(steps, FLAGS.steps, "SGD") if FLAGS.steps else {}
    shape = "bert_small, batch 16 x 128" if FLAGS.model == "bert_small" else \
        "ResNet50 64x64, batch 32"
    print(f"\n{shape}; preconditioning over the gradient: medians of "
          f"{FLAGS.reps} interleaved calls; steps at periods {cov}/{inverse}, not spread\n")
    print("| factors | counted precondition / SGD | counted refresh / SGD | memory | "
          "measured precondition / gradient | measured refresh / gradient | step / SGD | "
          "counted step / SGD |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label in labels:
        r = rows[label]
        step = f"{stepped[label]:.2f}" if label in stepped else "-"
        print(f"| {label} | {r['precondition']:.2f} | {r['refresh']:.2f} | {r['memory']:.2f} | "
              f"{measured[label]:.2f} | {measured[label + ': refresh']:.2f} | {step} | "
              f"{r['step counted']:.2f} |")


if __name__ == "__main__":
    app.run(main)
