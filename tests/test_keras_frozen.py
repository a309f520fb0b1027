"""Layers frozen the Keras 3 way (`layer.trainable = False`) stay frozen.

Keras 3 freezes a layer by its Keras variables' flag; the `tf.Variable`
each wraps keeps the flag it was made with, and a traced function captures
that `tf.Variable`. The pass reads the Keras flag (`passes/keras_frozen.py`):
a frozen layer registers nothing, gets no per-example gradient, and
`kg.KFAC`, `kg.DPSGD` and `kg.KFACModel.fit` (also under a
`MirroredStrategy`) leave it as it is, as `model.trainable_variables` does.
"""
import contextlib
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from per_example_reference import assert_matches_loop


def _model(freeze):
    """A tiny backbone (Dense, BatchNormalization) under a Dense head;
    ``freeze(backbone, model)`` freezes some of it after construction."""
    keras.utils.set_random_seed(0)
    backbone = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
                                 keras.layers.BatchNormalization(), keras.layers.Dense(5)],
                                name="backbone")
    model = keras.Sequential([keras.Input((4,)), backbone, keras.layers.Dense(3, name="head")])
    freeze(backbone, model)
    return backbone, model


def _loss(model):
    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, model(x, training=False)))
    return loss_fn


def _data():
    rng = np.random.default_rng(0)
    return (tf.constant(rng.normal(size=(8, 4)).astype("float32")),
            tf.constant(rng.integers(0, 3, 8)))


def _values(variables):
    return [v.numpy().copy() for v in variables]


def _frozen_backbone(backbone, model):
    backbone.trainable = False


def _frozen_first_dense(backbone, model):
    backbone.layers[0].trainable = False


def test_frozen_backbone_registers_only_the_head():
    backbone, model = _model(_frozen_backbone)
    loss_fn, args = _loss(model), _data()
    reg = loss_fn.registration(*args)
    assert {v.name for v in reg.variables} == {v.value.name for v in model.trainable_variables}
    assert len(reg.layers) == 1 and reg.layers[0].kind == "dense"
    assert_matches_loop(loss_fn, args, rtol=1e-5, atol=1e-7)
    before = _values(backbone.weights)
    opt = kg.KFAC(loss_fn)
    for _ in range(3):
        assert np.isfinite(float(opt.step(*args)))
    dp = kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0)
    dp.step(*args)
    for b, a in zip(before, _values(backbone.weights)):
        np.testing.assert_array_equal(a, b)


def test_one_frozen_layer_inside_a_trained_backbone():
    backbone, model = _model(_frozen_first_dense)
    frozen = backbone.layers[0]
    loss_fn, args = _loss(model), _data()
    reg = loss_fn.registration(*args)
    names = {v.name for v in reg.variables}
    assert names == {v.value.name for v in model.trainable_variables}
    assert not names & {v.value.name for v in frozen.weights}
    assert_matches_loop(loss_fn, args, rtol=1e-5, atol=1e-7)
    before, trained = _values(frozen.weights), _values(backbone.layers[-1].weights)
    opt = kg.KFAC(loss_fn)
    for _ in range(3):
        opt.step(*args)
    for b, a in zip(before, _values(frozen.weights)):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(b, a) for b, a in zip(trained,
                                                       _values(backbone.layers[-1].weights)))


@pytest.mark.parametrize("mirrored", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_kfac_model_fit_keeps_a_frozen_backbone(mirrored):
    """Also under ``tf.distribute`` (one device), where the step captures each
    mirrored variable's per-replica component, which does not point back."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"]) if mirrored else None
    with strategy.scope() if strategy else contextlib.nullcontext():
        backbone, model = _model(_frozen_backbone)
        km = kg.KFACModel(model, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        km.compile()
    x, y = _data()
    before, head = _values(backbone.weights), _values(model.layers[-1].weights)
    km.fit(x.numpy(), y.numpy(), batch_size=8, epochs=2, verbose=0)
    for b, a in zip(before, _values(backbone.weights)):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(b, a) for b, a in zip(head, _values(model.layers[-1].weights)))


def test_float8_scales_are_refused():
    """``model.quantize("float8")`` adds scales Keras overwrites with what their
    custom gradient computes (``overwrite_with_gradient``): no parameters, and
    no loss kfac_graph can train; one line, not a generic layer of them."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.quantize("float8")
    loss_fn = _loss(model)
    with pytest.raises(kg.TraceError, match="which Keras overwrites with its gradient"):
        loss_fn.registration(*_data())


def test_a_layer_frozen_after_a_registration_is_read_without_a_second_scan(monkeypatch):
    """A new registration after ``backbone.trainable = False`` reads the flag
    as it is then, from the Keras variables the loss holds, with no scan of
    the heap (``gc.get_objects`` made to fail) where Keras 2 is not imported."""
    backbone, model = _model(lambda backbone, model: None)
    args = _data()
    assert len(_loss(model).registration(*args).variables) == 8
    from passes import keras_frozen
    monkeypatch.delitem(sys.modules, "tf_keras", raising=False)  # Keras 2's flags: always scanned
    monkeypatch.setattr(keras_frozen.gc, "get_objects", lambda *a: pytest.fail("scanned"))
    backbone.trainable = False
    reg = _loss(model).registration(*args)
    assert {v.name for v in reg.variables} == {v.value.name for v in model.trainable_variables}
    assert len(reg.variables) == 2


def test_a_fresh_models_flags_are_read_from_what_the_loss_holds(monkeypatch):
    """A loss closing over its model: the Keras variables are found by walking
    what the function holds (``passes/keras_reach.py``), with no scan of the
    process's objects; a model behind an object the walk cannot look into
    (``__slots__``) falls back to the scan, with the same flags."""
    from passes import keras_frozen
    monkeypatch.delitem(sys.modules, "tf_keras", raising=False)
    args = _data()
    scans = []
    real = keras_frozen.gc.get_objects
    monkeypatch.setattr(keras_frozen.gc, "get_objects", lambda *a: scans.append(1) or real(*a))
    _, model = _model(_frozen_first_dense)
    reg = _loss(model).registration(*args)
    assert {v.name for v in reg.variables} == {v.value.name for v in model.trainable_variables}
    assert not scans

    class Holder:
        __slots__ = ("model",)

    holder = Holder()
    _, holder.model = _model(_frozen_first_dense)

    @kg.auto_register
    def hidden(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, holder.model(x, training=False)))

    reg = hidden.registration(*args)
    assert scans
    assert {v.name for v in reg.variables} == {
        v.value.name for v in holder.model.trainable_variables}
