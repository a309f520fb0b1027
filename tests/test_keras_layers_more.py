"""More Keras 3 layers no other test builds, each in a tiny float64 model:
``ActivityRegularization`` and a Dense ``activity_regularizer`` (their
penalties joined to the loss through ``model.losses``),
``LayerNormalization(rms_scaling=True)`` and ``RMSNormalization``, ``Multiply``/``Subtract`` merges,
``RepeatVector`` into an LSTM decoder with ``TimeDistributed(Dense)``,
``ZeroPadding3D``/``Conv3D``/``Cropping3D``, ``ConvLSTM3D``, string
``Hashing`` into an ``Embedding`` and ``HashedCrossing`` into a Dense.
Every trainable variable registers; per-example gradients equal a loop of
one-example tapes; ``kg.verify`` passes; 3 ``kg.KFAC`` steps with defaults
skip none. The activity penalty is in the fast set (the others under
``-m slow``: each their family's only case here)."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from per_example_reference import assert_matches_loop

L = keras.layers
B = 4


def _dense_inputs():
    return tf.constant(np.random.default_rng(0).normal(size=(B, 6)))


def _activity():
    return keras.Sequential([keras.Input((6,)), L.Dense(5, activation="tanh"),
                             L.ActivityRegularization(l1=0.01, l2=0.02),
                             L.Dense(5, activity_regularizer="l2"), L.Dense(3)]), _dense_inputs()


def _rms():
    return keras.Sequential([keras.Input((6,)), L.Dense(5), L.LayerNormalization(
        rms_scaling=True), L.Dense(5), L.RMSNormalization(), L.Dense(3)]), _dense_inputs()


def _merges():
    i = keras.Input((6,))
    a, b = L.Dense(4)(i), L.Dense(4)(i)
    o = L.Dense(3)(L.Concatenate()([L.Multiply()([a, b]), L.Subtract()([a, b])]))
    return keras.Model(i, o), _dense_inputs()


def _repeat():
    i = keras.Input((6,))
    s = L.LSTM(4, return_sequences=True)(L.RepeatVector(3)(L.Dense(4)(i)))
    return keras.Model(i, L.Dense(3)(L.Flatten()(L.TimeDistributed(L.Dense(2))(s)))), \
        _dense_inputs()


def _volume():
    x = tf.constant(np.random.default_rng(0).normal(size=(B, 5, 5, 5, 2)))
    return keras.Sequential([keras.Input((5, 5, 5, 2)), L.ZeroPadding3D(1), L.Conv3D(3, 3),
                             L.Cropping3D(1), L.GlobalAveragePooling3D(), L.Dense(3)]), x


def _conv_lstm3d():
    x = tf.constant(np.random.default_rng(0).normal(size=(B, 2, 4, 4, 4, 1)))
    return keras.Sequential([keras.Input((2, 4, 4, 4, 1)), L.ConvLSTM3D(2, 2, padding="same"),
                             L.Flatten(), L.Dense(3)]), x


def _hashing():
    ids = tf.constant([["a", "b"], ["c", "a"], ["d", "e"], ["b", "b"]])
    return keras.Sequential([keras.Input((2,), dtype="string"), L.Hashing(7), L.Embedding(7, 3),
                             L.Flatten(), L.Dense(3)]), ids


def _crossing():
    i1, i2 = keras.Input((), dtype="int64"), keras.Input((), dtype="int64")
    o = L.Dense(3)(L.HashedCrossing(num_bins=8, output_mode="one_hot")((i1, i2)))
    return keras.Model([i1, i2], o), (tf.constant([1, 2, 3, 4], tf.int64),
                                      tf.constant([5, 5, 6, 7], tf.int64))


MODELS = {"activity": _activity, "rms": _rms, "merges": _merges, "repeat": _repeat,
          "volume": _volume, "conv_lstm3d": _conv_lstm3d, "hashing": _hashing,
          "crossing": _crossing}


@pytest.mark.parametrize("name", [n if n == "activity" else pytest.param(
    n, marks=pytest.mark.slow) for n in MODELS])
def test_layer_registers_matches_the_loop_verifies_and_trains(keras_float64, name):
    keras.utils.set_random_seed(0)
    model, x = MODELS[name]()
    y = tf.constant([0, 1, 2, 0])

    @kg.auto_register
    def loss_fn(x, y):
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            y, model(x, training=True), from_logits=True))
        return loss + tf.add_n(model.losses) if model.losses else loss

    reg = assert_matches_loop(loss_fn, (x, y), rtol=1e-9, atol=1e-12)
    assert {v.name for v in reg.variables} == {v.value.name for v in model.trainable_variables}
    assert all(layer.kind != "generic" for layer in reg.layers)
    assert kg.verify(loss_fn, x, y).passed
    opt = kg.KFAC(loss_fn)
    for _ in range(3):
        assert np.isfinite(float(opt.step(x, y)))
    assert int(opt.skipped_steps) == 0
