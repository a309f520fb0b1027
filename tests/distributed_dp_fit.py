"""The ``DPModel.fit`` problem ``distributed_support.py`` runs on one device and
under ``MirroredStrategy``: a tanh MLP (4-5-3) with an L2 kernel penalty,
three batches of 16 of one fixed ``tf.data`` pipeline (the same batches on
every run), fixed-size or padded Poisson batches (every fifth example
masked out), noise from one seed."""

import numpy as np


def dp_fit(strategy, sampling, noise_multiplier):
    """``(parameters, history, iterations)`` after one epoch of three steps."""
    import keras
    import tensorflow as tf

    import kfac_graph as kg

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.integers(0, 3, 64)
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy is not None else tf.init_scope():
        inner = keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(5, activation="tanh", kernel_regularizer="l2"),
            keras.layers.Dense(3)])
        model = kg.DPModel(inner, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), l2_norm_clip=0.5, noise_multiplier=noise_multiplier,
            sampling=sampling, seed=3, num_examples=64, batch_size=16)
        model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"])
    data = (x, y) if sampling == "fixed" else (x, y, (np.arange(64) % 5 != 0).astype("float32"))
    batches = tf.data.Dataset.from_tensor_slices(data).batch(16).take(3)
    history = model.fit(batches, epochs=1, verbose=0)
    params = np.concatenate([v.numpy().ravel() for v in inner.trainable_variables])
    return params, history.history, int(model.optimizer.iterations.numpy())


def run(devices, out):
    """``DPModel.fit`` on one device and under MirroredStrategy on ``devices``,
    per sampler; the results in the npz ``out``."""
    import tensorflow as tf

    results = {}
    for sampling in ("fixed", "poisson"):
        ref, ref_history, _ = dp_fit(None, sampling, 1.3)
        params, history, iterations = dp_fit(tf.distribute.MirroredStrategy(devices), sampling,
                                             1.3)
        results.update({f"{sampling}/reference": ref, f"{sampling}/distributed": params,
                        f"{sampling}/iterations": np.array(iterations)})
        for key in ("loss", "accuracy", "epsilon"):
            results[f"{sampling}/reference_{key}"] = np.array(ref_history[key])
            results[f"{sampling}/{key}"] = np.array(history[key])
    np.savez(out, **results)
