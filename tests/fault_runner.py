"""A short deterministic K-FAC training run in a fresh process, for
``test_faults.py``: it can SIGKILL itself part-way, and a later run resumes
from what the killed one saved.

    python tests/fault_runner.py kfac  --dir CKPT --out final.npz [--kill_after 7]
    python tests/fault_runner.py keras --dir BACKUP --out final.npz [--kill_after 7]

``kfac``: a raw ``kg.KFAC.step`` loop of ``STEPS`` steps with a
``tf.train.CheckpointManager`` (model + optimizer) saving every ``EVERY``
steps; it restores the latest checkpoint in ``--dir`` if there is one and
goes on from the optimizer's ``iterations``. The batch of step ``t`` depends
only on ``t`` (stateless random ops seeded by ``t``).

``keras``: ``kg.KFACModel.fit`` for ``EPOCHS`` epochs of ``BATCHES`` batches
(no shuffling) with ``keras.callbacks.BackupAndRestore(--dir)`` (a backup at
every epoch end, restored when ``fit`` starts).

``--kill_after k``: SIGKILL this process right after global step ``k``
(1-based), before anything else runs. Without it the run finishes and writes
the final weights and the optimizer's state to ``--out``.
"""

import argparse
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

STEPS, EVERY = 12, 3  # kfac: steps, checkpoint period
EPOCHS, BATCHES = 4, 3  # keras: epochs, batches per epoch
BATCH, IN, HIDDEN, OUT = 16, 5, 8, 3


def kill_self():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def make_model():
    """A float64 Keras MLP with fixed initial weights (from numpy, not Keras's
    seed generators, so they do not depend on what ran before in the process)."""
    import keras

    keras.backend.set_floatx("float64")
    model = keras.Sequential([
        keras.Input((IN,), dtype="float64"),
        keras.layers.Dense(HIDDEN, activation="tanh", name="hidden"),
        keras.layers.Dense(OUT, name="logits"),
    ])
    rng = np.random.default_rng(0)
    model.set_weights([rng.normal(size=w.shape) * 0.5 for w in model.get_weights()])
    return model


def batch(t):
    """Step ``t``'s batch (``t`` from 0): a function of ``t`` alone."""
    import tensorflow as tf

    x = tf.random.stateless_normal([BATCH, IN], seed=[t, 1], dtype=tf.float64)
    y = tf.random.stateless_uniform([BATCH], seed=[t, 2], minval=0, maxval=OUT, dtype=tf.int32)
    return x, y


def run_kfac(args):
    import tensorflow as tf

    import kfac_graph as kg

    model = make_model()

    @kg.auto_register
    def loss_fn(x, y):
        logits = model(x, training=True)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    opt = kg.KFAC(loss_fn, momentum_type=args.momentum_type, inverse_update_period=2)
    opt.build(*batch(0))  # every state variable exists before a restore
    ckpt = tf.train.Checkpoint(model=model, opt=opt)
    manager = tf.train.CheckpointManager(ckpt, args.dir, max_to_keep=2)
    if manager.latest_checkpoint:
        ckpt.restore(manager.latest_checkpoint).assert_consumed()
    start = int(opt.iterations.numpy())
    for t in range(start, STEPS):
        opt.step(*batch(t))
        done = t + 1
        if done % EVERY == 0:
            manager.save(checkpoint_number=done)
        if done == args.kill_after:
            kill_self()
    np.savez(args.out, *[v.numpy() for v in model.weights], resumed_from=start,
             iterations=opt.iterations.numpy(), damping=opt.damping.numpy(),
             learning_rate=opt.learning_rate.numpy(), momentum=opt.momentum.numpy(),
             state=np.concatenate([np.ravel(v.numpy()) for v in opt.variables]))


def run_keras(args):
    import keras

    import kfac_graph as kg

    model = make_model()
    xs, ys = zip(*[batch(t) for t in range(BATCHES)])
    x, y = np.concatenate(xs), np.concatenate(ys)
    km = kg.KFACModel(model, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      momentum_type=args.momentum_type, inverse_update_period=2)
    km.compile()
    seen = {"epoch": None}

    class Tracker(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if seen["epoch"] is None:
                seen["epoch"] = epoch

        def on_train_batch_end(self, batch, logs=None):
            if int(km.optimizer.iterations.numpy()) == args.kill_after:
                kill_self()

    backup = keras.callbacks.BackupAndRestore(args.dir, delete_checkpoint=False)
    km.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
           callbacks=[backup, Tracker()])
    kfac = km.kfac
    np.savez(args.out, *[v.numpy() for v in model.weights], resumed_from=seen["epoch"],
             iterations=kfac.iterations.numpy(), damping=kfac.damping.numpy(),
             learning_rate=kfac.learning_rate.numpy(), momentum=kfac.momentum.numpy(),
             keras_iterations=km.optimizer.iterations.numpy(),
             state=np.concatenate([np.ravel(v.numpy()) for v in kfac.variables]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["kfac", "keras"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill_after", type=int, default=-1)
    parser.add_argument("--momentum_type", default="qmodel")
    args = parser.parse_args()
    (run_kfac if args.mode == "kfac" else run_keras)(args)


if __name__ == "__main__":
    main()
