"""Runs ``kg.KFAC``'s damping rule under ``MirroredStrategy`` on 2 logical
CPU devices, in a fresh process (logical devices must be set before
TensorFlow starts), and writes what ``test_damping_rule_state.py`` checks
to an npz: ``rho`` at each step, and each replica's moving mean and seed
state after the steps; and the refusal of a batch norm with synchronized
statistics (``optimizer/synchronized_statistics.py``), with whether the
model's variables were left as they were.

    python tests/damping_rule_mirrored.py --out m.npz

The problem is the one of ``test_damping_rule_state.py`` (batch norm of
the input, dropout, a Keras loss), float64, a learning rate of 1e-6 and the
rule at every step.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

STEPS = 3


def main(out):
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras

    import kfac_graph as kg

    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    L = keras.layers
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), L.BatchNormalization(momentum=0.5),
                                  L.Dense(8, activation="tanh"), L.Dropout(0.5), L.Dense(3)])
        ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        loss_fn = kg.auto_register(lambda x, y: ce(y, model(x, training=True)))
        opt = kg.KFAC(loss_fn, momentum_type="regular", adapt_damping=True,
                      damping_adaptation_interval=1, learning_rate=1e-6)
    x = tf.random.stateless_normal([8, 6], seed=[1, 2], dtype=tf.float64) + 3.0
    y = tf.constant([0, 1, 2, 0, 1, 2, 0, 1])
    rhos = []
    for _ in range(STEPS):
        opt.step(x, y)
        rhos.append(float(opt.rho.numpy()))

    def copies(name):
        variable = [v for v in model.non_trainable_variables if name in v.path][0]
        return np.stack([np.asarray(t) for t in variable.value.values])

    # a batch norm with synchronized statistics: refused in one line, nothing written
    with strategy.scope():
        synced = keras.Sequential([keras.Input((6,)), L.BatchNormalization(
            synchronized=True, name="synced_norm"), L.Dense(3)])
        synced_fn = kg.auto_register(lambda x, y: ce(y, synced(x, training=True)))
        synced_opt = kg.KFAC(synced_fn, momentum_type="regular")
    before = [np.asarray(t) for v in synced.variables for t in v.value.values]
    try:
        synced_opt.step(x, y)
        refusal = ""
    except kg.KfacGraphError as e:
        refusal = str(e)
    after = [np.asarray(t) for v in synced.variables for t in v.value.values]
    np.savez(out, rhos=rhos, x=x.numpy(), moving=copies("moving_mean"),
             seeds=copies("seed_generator"), skipped=int(opt.skipped_steps.numpy()),
             refusal=refusal, unchanged=all(np.array_equal(a, b) for a, b in zip(before, after)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    main(parser.parse_args().out)
