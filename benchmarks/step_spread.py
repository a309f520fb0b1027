"""Step times one by one: K-FAC with a covariance period, its statistics on
every ``P``-th step's whole batch against spread over the steps
(``spread_covariances``), beside SGD with momentum, on ``bert_small.py``'s
encoder (sequence 128, batch 16), interleaved in one process.

K-FAC rows use regular momentum (lr 1e-3, fixed damping), covariance period
``--cov`` and inverse period ``--inv`` (inverses staggered). Each candidate
is compiled by one step first; then ``--rounds`` rounds run ``--block``
steps of each in turn. Printed per candidate, over SGD's median step: the
median, mean, 90th percentile and largest step, and every step in order.

    python benchmarks/step_spread.py [--cov 5] [--inv 10] [--rounds 3] [--block 10]
"""
from __future__ import annotations

import gc
import time

import bench_env  # noqa: F401  (first: quiet logs, the repository importable)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import bert_small  # noqa: E402
import kfac_graph as kg  # noqa: E402
from lm_race import keras_step  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("cov", 5, "cov_update_period")
flags.DEFINE_integer("inv", 10, "inverse_update_period")
flags.DEFINE_integer("rounds", 3, "interleaved rounds")
flags.DEFINE_integer("block", 10, "steps of each candidate per round")


def model_and_loss():
    keras.utils.set_random_seed(0)
    model = bert_small.bert_small()

    def loss(x, y):
        logits = model(x, training=True)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    return model, loss


def sgd_step():
    model, loss = model_and_loss()
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    optimizer.build(model.trainable_variables)
    return keras_step(model, loss, optimizer, jit_compile=False)


def kfac_step(spread):
    _, loss = model_and_loss()
    opt = kg.KFAC(kg.auto_register(loss), momentum_type="regular", learning_rate=1e-3,
                  adapt_damping=False, cov_update_period=FLAGS.cov,
                  inverse_update_period=FLAGS.inv, spread_covariances=spread)
    return opt.step


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    batches = [bert_small.batch(rng) for _ in range(FLAGS.block)]
    runs = {"SGD": sgd_step(), "K-FAC, whole batch every P-th step": kfac_step(False),
            "K-FAC, spread": kfac_step(True)}
    for step in runs.values():
        step(*batches[0]).numpy()
    gc.collect()
    gc.freeze()  # the built graphs stay alive: collecting them lands in random steps
    times = {label: [] for label in runs}
    for _ in range(FLAGS.rounds):
        for label, step in runs.items():
            for x, y in batches:
                start = time.perf_counter()
                step(x, y).numpy()
                times[label].append(time.perf_counter() - start)
    sgd = float(np.median(times["SGD"]))
    print(f"periods {FLAGS.cov}/{FLAGS.inv}; over SGD's median step ({sgd:.3f} s)\n")
    print("| candidate | median | mean | p90 | largest |\n|---|---:|---:|---:|---:|")
    for label, values in times.items():
        v = np.array(values) / sgd
        print(f"| {label} | {np.median(v):.2f} | {v.mean():.2f} | {np.percentile(v, 90):.2f} "
              f"| {v.max():.2f} |")
    for label, values in times.items():
        print(f"\n{label}: " + " ".join(f"{t / sgd:.1f}" for t in values))


if __name__ == "__main__":
    app.run(main)
