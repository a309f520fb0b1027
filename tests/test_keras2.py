"""Keras 2 models (``tf_keras``, TensorFlow's ``tf.keras`` under
``TF_USE_LEGACY_KERAS=1``), code written for the Keras before Keras 3.

Keras 2 freezes a layer on the layer, not on its variables: the
``tf.Variable`` stays trainable, and ``model.trainable_variables`` leaves it
out. Before, ``kg.KFAC`` trained such a layer (``passes/keras_frozen.py``).
Its embedding lookup is colocated with the table's placeholder, which the
re-run graph maps to the variable, and in a SavedModel's function with a
node of the caller's graph: the import refused both (``kfac_graph/taps.py``,
``passes/inline.py``). Shown in float64: frozen layers (one layer, and a
whole nested model) are constants; a model of Keras 2 layers (Embedding,
Conv1D, LSTM, MultiHeadAttention, LayerNormalization) has per-example
gradients equal to a loop of one-example tapes, and ``kg.KFAC`` trains it;
``kg.KFACModel.fit`` trains a Keras 2 model and ``kg.DPModel`` refuses one.
"""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras as tfk

import kfac_graph as kg
from per_example_reference import assert_matches_loop

L = tfk.layers
B = 4


def _loss(model):
    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))
    return loss_fn


def _classes(rng):
    return tf.constant(rng.integers(0, 3, (B,)))


def test_frozen_layers_and_a_frozen_nested_model_are_constants():
    tfk.backend.set_floatx("float64")
    try:
        rng = np.random.default_rng(0)
        inner = tfk.Sequential([tfk.Input((4,)), L.Dense(5, activation="tanh", name="inner")])
        frozen_dense = L.Dense(5, activation="tanh", name="frozen")
        model = tfk.Sequential([tfk.Input((4,)), inner, frozen_dense, L.Dense(3, name="head")])
        inner.trainable = False
        frozen_dense.trainable = False
        loss_fn = _loss(model)
        args = (tf.constant(rng.normal(size=(B, 4))), _classes(rng))
        reg = assert_matches_loop(loss_fn, args)
        assert [v.name for v in reg.variables] == [v.name for v in model.trainable_variables] == [
            "head/kernel:0", "head/bias:0"]
        before = [v.numpy() for v in model.non_trainable_variables]
        opt = kg.KFAC(loss_fn)
        losses = [float(opt.step(*args)) for _ in range(3)]
        assert losses[-1] < losses[0], losses
        for v, value in zip(model.non_trainable_variables, before):
            np.testing.assert_array_equal(v.numpy(), value, err_msg=v.name)
    finally:
        tfk.backend.set_floatx("float32")


def test_a_keras2_sequence_model_matches_the_loop_and_trains():
    tfk.backend.set_floatx("float64")
    try:
        tf.random.set_seed(0)
        rng = np.random.default_rng(1)
        ids = tfk.Input((6,), dtype="int32")
        h = L.Embedding(12, 8)(ids)
        h = L.Conv1D(8, 3, padding="same", activation="relu")(h)
        h = L.LayerNormalization()(h + L.MultiHeadAttention(2, 4)(h, h))
        h = L.LSTM(5)(h)
        model = tfk.Model(ids, L.Dense(3)(h))
        loss_fn = _loss(model)
        args = (tf.constant(rng.integers(0, 12, (B, 6)), tf.int32), _classes(rng))
        reg = assert_matches_loop(loss_fn, args, atol=1e-10)
        assert {layer.kind for layer in reg.layers} == {"embedding", "conv2d", "dense",
                                                        "scale_and_shift"}, reg.summary()
        opt = kg.KFAC(loss_fn)
        losses = [float(opt.step(*args)) for _ in range(4)]
        assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses
    finally:
        tfk.backend.set_floatx("float32")


def test_keras_fit_wrappers():
    """``kg.KFACModel`` trains a Keras 2 model through Keras 3's ``fit``;
    ``kg.DPModel``, whose optimizer is Keras 3's, refuses it in one line."""
    rng = np.random.default_rng(2)
    model = tfk.Sequential([tfk.Input((4,)), L.Dense(3)])
    x = rng.normal(size=(64, 4)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(4, 3)), axis=1)  # separable classes
    loss = tfk.losses.SparseCategoricalCrossentropy(from_logits=True)
    km = kg.KFACModel(model, loss=loss, learning_rate=0.1, damping=1e-2)
    km.compile()
    before = model.layers[0].kernel.numpy()
    history = km.fit(x, y, batch_size=16, epochs=3, verbose=0).history["loss"]
    assert history[-1] < history[0] and not np.allclose(model.layers[0].kernel.numpy(), before)
    with pytest.raises(TypeError, match=r"kg.DPModel wraps a Keras 3 model, got a tf_keras"):
        kg.DPModel(model, loss=loss)


@pytest.mark.slow  # Keras 2's sequence model (fast) above; SavedModel rewrites: test_rewrite.py
def test_a_keras2_saved_model_is_rewritten(tmp_path):
    """A SavedModel of a Keras 2 model with an embedding (its lookup colocated
    with the table's handle, named as the caller's graph names it): rewritten,
    its per-example gradients equal the in-process ones, and it trains."""
    from tools import kfac_rewrite

    rng = np.random.default_rng(3)
    ids = tfk.Input((6,), dtype="int32")
    model = tfk.Model(ids, L.Dense(3)(L.GlobalAveragePooling1D()(L.Embedding(12, 8)(ids))))

    class Saved(tf.Module):
        def __init__(self):
            self.model = model

        @tf.function(input_signature=[tf.TensorSpec([None, 6], tf.int32),
                                      tf.TensorSpec([None], tf.int32)])
        def loss(self, x, y):
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    tf.saved_model.save(Saved(), str(tmp_path / "in"))
    assert kfac_rewrite.main(["kfac-rewrite", "--input", str(tmp_path / "in"), "--function",
                              "loss", "--output", str(tmp_path / "out")]) == 0
    loaded = tf.saved_model.load(str(tmp_path / "out"))
    args = (tf.constant(rng.integers(0, 12, (B, 6)), tf.int32), tf.constant([0, 1, 2, 1]))
    for got, want in zip(loaded.per_example_gradients(*args),
                         kg.per_example_gradients(_loss(model), *args)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    losses = [float(loaded.kfac_step(*args)) for _ in range(4)]
    assert losses[-1] < losses[0], losses
