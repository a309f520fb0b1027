"""Runs ``kg.KFAC`` on a small Keras LSTM (its loop unrolled by the pass)
under ``MirroredStrategy`` on logical CPU devices, and on one device, in a
fresh process (logical devices must be set before TensorFlow starts);
writes both runs' final parameters and losses to an npz.

    python tests/recurrent_mirrored.py --devices 2 --out r.npz

The problem: float64 LSTM(4) on 5 steps of 3 features, Dense(3) on the last
state, softmax loss, 6 batches of 8; exact Fisher, regular momentum,
inverses every 2 steps.
"""

import argparse
import contextlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

STEPS, BATCH, T, D, U = 6, 8, 5, 3, 4
OPTIONS = dict(learning_rate=0.1, damping=1e-2, momentum_type="regular", estimation_mode="exact",
               inverse_update_period=2, adapt_damping=False)


def train(strategy=None):
    """Final parameters and losses after ``STEPS`` steps on whole batches."""
    import keras
    import tensorflow as tf

    import kfac_graph as kg

    keras.config.set_floatx("float64")
    rng = np.random.default_rng(0)
    batches = [(tf.constant(rng.normal(size=(BATCH, T, D))),
                tf.constant(rng.integers(0, 3, BATCH).astype(np.int32))) for _ in range(STEPS)]
    keras.utils.set_random_seed(0)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = keras.Sequential([keras.Input((T, D)), keras.layers.LSTM(U),
                                  keras.layers.Dense(3)])

        @kg.auto_register
        def loss_fn(x, y):
            logits = model(x)
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

        opt = kg.KFAC(loss_fn, **OPTIONS)
    losses = [float(opt.step(x, y)) for x, y in batches]
    kinds = [layer.kind for layer in opt.registration.layers]
    params = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    return params, np.array(losses), kinds, int(opt.skipped_steps.numpy())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import distributed_support
    import tensorflow as tf

    names = distributed_support.logical_devices(args.devices)
    reference, reference_losses, kinds, _ = train()
    params, losses, mirrored_kinds, skipped = train(tf.distribute.MirroredStrategy(names))
    np.savez(args.out, reference=reference, reference_losses=reference_losses, params=params,
             losses=losses, generic=np.array("generic" in kinds + mirrored_kinds),
             skipped=np.array(skipped))


if __name__ == "__main__":
    main()
