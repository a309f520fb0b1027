"""A batch of one registers the layers of any other batch.

On a static batch of one every unit axis could be the batch's, and a Keras
``fit`` whose data leaves a last batch of one example traces the loss
again for it: where that trace registered other layers, ``KFACModel.fit``
stopped on "these arguments register different layers". Cases, each shown
by the registrations at batches 1 and 3 (kinds and variables) and the
per-example gradients against one-example tapes (float64):

- Keras's LSTM cell: ``ops.add(x W, h R)`` is emitted as
  ``bias_add(x W, squeeze(h R))`` when ``h R`` squeezes to one axis (a
  batch of one), so the cell's sum of products was not seen and its
  kernels registered as two layers and a shift (``passes/canonicalize.py``
  reads it as the sum);
- a Keras ``Add`` of two bias-free Dense layers (the same emission);
- a token tiled over the batch and the positions (``tile(w, [B, 4, 1])``,
  a masked autoencoder's mask token) and a per-head weight broadcast to
  ``[B, H, T, 1]`` (GPT-OSS's attention sinks): on a batch of one their
  copies along other axes hid the unit axis standing for the batch
  (``passes/batch_flow.py``, ``passes/patterns_scale_shift.py``).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import kfac_graph as kg
from per_example_reference import one_example_loop

L = keras.layers
B, T, D, V = 3, 4, 6, 12


@pytest.fixture(autouse=True)
def _float64():
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")


class MaskToken(keras.layers.Layer):
    """Appends 4 copies of a learned token to every sequence."""

    def build(self, shape):
        self.token = self.add_weight(shape=(1, 1, shape[-1]), name="token")

    def call(self, h):
        copies = ops.tile(self.token, [ops.shape(h)[0], 4, 1])
        return ops.concatenate([h, ops.cast(copies, h.dtype)], axis=1)


class Sinks(keras.layers.Layer):
    """Attention with a learned logit per head that absorbs probability."""

    def build(self, shape):
        self.query = L.Dense(D)
        self.sinks = self.add_weight(shape=(2,), name="sinks")

    def call(self, h):
        b, t = ops.shape(h)[0], ops.shape(h)[1]
        q = ops.transpose(ops.reshape(self.query(h), [b, t, 2, D // 2]), [0, 2, 1, 3])
        scores = ops.einsum("bhqd,bhkd->bhqk", q, q)
        sinks = ops.broadcast_to(ops.reshape(self.sinks, [1, 2, 1, 1]), [b, 2, t, 1])
        weights = ops.softmax(ops.concatenate([scores, sinks], axis=-1))[..., :-1]
        out = ops.einsum("bhqk,bhkd->bhqd", weights, q)
        return ops.reshape(ops.transpose(out, [0, 2, 1, 3]), [b, t, D])


def _model(kind):
    keras.utils.set_random_seed(0)
    if kind == "add_of_dense":
        x = keras.Input((D,))
        h = L.Add()([L.Dense(D, use_bias=False)(x[:, :3]), L.Dense(D, use_bias=False)(x[:, 3:])])
        return keras.Model(x, L.Dense(2)(h))
    body = {"lstm": [L.LSTM(D)], "bilstm": [L.Bidirectional(L.LSTM(D))],
            "mask_token": [MaskToken(), L.GlobalAveragePooling1D()],
            "sinks": [Sinks(), L.GlobalAveragePooling1D()]}[kind]
    return keras.Sequential([keras.Input((T,), dtype="int32"), L.Embedding(V, D), *body,
                             L.Dense(2)])


def _data(kind, n, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, D)) if kind == "add_of_dense"
         else rng.integers(0, V, (n, T)).astype("int32"))
    return tf.constant(x), tf.constant(rng.integers(0, 2, n))


@pytest.mark.parametrize("kind", [  # (bidirectional: the LSTM's cell twice)
    "lstm", pytest.param("bilstm", marks=pytest.mark.slow), "add_of_dense", "mask_token", "sinks"])
def test_a_batch_of_one_registers_as_a_batch_of_three(kind):
    model = _model(kind)

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    x, y = _data(kind, B)
    regs = [loss_fn.registration(x[:b], y[:b]) for b in (B, 1)]
    layers = [[(layer.kind, tuple(v.name for v in layer.variables)) for layer in reg.layers]
              for reg in regs]
    assert layers[0] == layers[1], (regs[0].summary(), regs[1].summary())
    assert not regs[0].generic_variables, regs[0].summary()
    if kind in ("lstm", "bilstm"):  # one stacked [x, h] layer per cell
        assert sum(len(vs) == 3 for k, vs in layers[0] if k == "dense") == (
            1 if kind == "lstm" else 2), regs[0].summary()
    if kind == "add_of_dense":
        assert [len(vs) for _, vs in layers[0]] == [2, 2], regs[0].summary()
    for args in ((x, y), (x[:1], y[:1])):
        got = kg.per_example_gradients(loss_fn, *args)
        for v, g, w in zip(regs[0].variables, got, one_example_loop(loss_fn, args,
                                                                      regs[0].variables)):
            np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-10, err_msg=v.name)


@pytest.mark.slow
def test_fit_with_a_last_batch_of_one():
    """Five examples in batches of two: the last batch holds one."""
    model = _model("lstm")
    fitted = kg.KFACModel(model, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    fitted.compile()
    x, y = _data("lstm", 5)
    before = [v.numpy() for v in model.trainable_variables]
    history = fitted.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert all(not np.array_equal(b, v.numpy()) for b, v in zip(before,
                                                                model.trainable_variables))


@pytest.mark.parametrize("layer", ["depthwise", "conv3d"])
def test_a_channels_first_bias_is_no_sum_of_products(layer):
    """Keras adds a channels-first bias as ``bias_add(x, squeeze(reshape(b,
    [1, C, 1, 1])), "NCHW")``: a laid-out weight, not a product, so it stays
    the convolution's bias (read as a sum, it broadcast along the last axis
    and its per-example gradients stopped on "leading axis 6")."""
    keras.utils.set_random_seed(0)
    conv, shape = ((L.DepthwiseConv2D(3, data_format="channels_first"), (2, 5, 5))
                   if layer == "depthwise" else
                   (L.Conv3D(2, 2, data_format="channels_first"), (2, 3, 4, 4)))
    model = keras.Sequential([keras.Input(shape), conv, L.Flatten(), L.Dense(2)])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    rng = np.random.default_rng(0)
    args = (tf.constant(rng.standard_normal((B, *shape))), tf.constant(rng.integers(0, 2, B)))
    reg = loss_fn.registration(*args)
    assert [layer.kind for layer in reg.layers][-1] == "dense" and not reg.generic_variables
    got = kg.per_example_gradients(loss_fn, *args)
    for v, g, w in zip(reg.variables, got, one_example_loop(loss_fn, args, reg.variables)):
        np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-10, err_msg=v.name)
