"""The ``KFACModel.fit`` problem ``distributed_support.py`` runs on one device
and under ``tf.distribute``: a float64 tanh MLP (6-8-3) on 128 examples."""

import numpy as np


def keras_fit(strategy):
    """``(parameters, history, iterations)`` of ``KFACModel.fit`` (2 epochs of 4
    batches of 32, float64, exact Fisher) under ``strategy`` (None: one device);
    Keras's float type is put back afterwards."""
    import keras

    previous = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")  # Keras may have cached a float32 policy
    try:
        return _keras_fit(strategy)
    finally:
        keras.config.set_floatx(previous[0])
        keras.config.set_dtype_policy(previous[1])


def _keras_fit(strategy):
    import keras
    import tensorflow as tf

    import kfac_graph as kg

    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 6))
    y = np.argmax(x @ rng.normal(size=(6, 3)), axis=1)
    keras.utils.set_random_seed(0)
    scope = strategy.scope() if strategy is not None else tf.init_scope()
    with scope:
        inner = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
        )
        model = kg.KFACModel(
            inner,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            estimation_mode="exact",
            damping=1e-2,
            inverse_update_period=3,
        )
        model.compile(metrics=["accuracy"])
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    params = np.concatenate([v.numpy().ravel() for v in inner.trainable_variables])
    return params, history.history, int(model.kfac.iterations.numpy())
