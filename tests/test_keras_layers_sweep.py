"""Keras 3 layers no other test builds, each in a tiny model: attention
(GroupQueryAttention, Attention and AdditiveAttention with their scales and
``score_mode="concat"``, ``ops.dot_product_attention`` in a custom layer,
causal masks), TimeDistributed, RNN over a list of cells or a custom cell,
Bidirectional, int4 quantization with LoRA, STFTSpectrogram with trainable
kernels, adapted Normalization, Rescaling, CenterCrop, UnitNormalization,
Identity, Lambda, ``tf.recompute_grad``. Per-example gradients equal a loop
of one-example tapes in float64 (float32 where Keras quantizes).

Batch-mixing augmentation (MixUp, CutMix) couples the examples: listed in
``reg.coupling``, each example's gradient is its own term's under the batch
call's draw, and DP-SGD refuses the loss in one line.

``kg.verify`` on two kinds of loss it used to FAIL with a correct runtime:

- AugMix picks each chain's ops by Python's ``random.choice`` when traced,
  so every trace is another loss; the mean check's reference was traced
  anew (FAILED at ~0.3-0.6): it now differentiates the registration's own
  trace (``verify.py``);
- a loss that reads statistics of the batch's data in its features (inputs
  standardised by the batch's moments; MelSpectrogram's ``top_db`` floor at
  the batch's maximum) holds them at the batch's values in every
  per-example gradient, which a batch of one cannot: one-example FAILED
  (0.8, 1.4); it is now skipped with a note (``verify_notes``), as for
  coupling.
"""
import random

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from per_example_reference import assert_matches_loop

L = keras.layers
B, T, D = 3, 4, 6


def _loss(model, training=None):
    @kg.auto_register
    def loss_fn(x, y):
        out = model(x) if training is None else model(x, training=training)
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            y, out, from_logits=True))
    return loss_fn


def _functional(block, shape=(T, D), dtype="float32"):
    keras.utils.set_random_seed(0)
    inp = keras.Input(shape, dtype=dtype)
    return keras.Model(inp, L.Dense(3)(L.Flatten()(block(inp))))


class _DotProductAttention(L.Layer):
    """Two heads of ``keras.ops.dot_product_attention``, causal."""

    def build(self, shape):
        self.q, self.k, self.v = L.Dense(4), L.Dense(4), L.Dense(4)

    def call(self, h):
        split = [keras.ops.reshape(f(h), (-1, T, 2, 2)) for f in (self.q, self.k, self.v)]
        return keras.ops.reshape(keras.ops.dot_product_attention(*split, is_causal=True),
                                 (-1, T, 4))


class _DenseCell(L.Layer):
    """An RNN cell whose call applies two Dense layers."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = self.state_size = units

    def build(self, shape):
        self.inp, self.rec = L.Dense(self.units), L.Dense(self.units, use_bias=False)

    def call(self, x, states):
        h = keras.ops.tanh(self.inp(x) + self.rec(states[0]))
        return h, [h]


class _Recomputed(L.Layer):
    """Two Dense layers under ``tf.recompute_grad``."""

    def build(self, shape):
        self.d1, self.d2 = L.Dense(5, activation="relu"), L.Dense(4, activation="tanh")
        self.d1.build(shape)
        self.d2.build((None, 5))

    def call(self, h):
        return tf.recompute_grad(lambda t: self.d2(self.d1(t)))(h)


def _pair(make_layer):
    """The layer is made when the model is, under the test's float64 policy: a
    layer made at import takes float32 and rounds the float64 model through it."""
    return lambda h: make_layer()([L.Dense(D)(h), L.Dense(D)(h)])


def _normalized(h):
    norm = L.Normalization()
    norm.adapt(np.random.default_rng(3).normal(2.0, 3.0, (8, 9, 9, 2)))
    h = L.CenterCrop(6, 6)(L.Rescaling(0.5, offset=-1.0)(norm(h)))
    return L.UnitNormalization()(L.Conv2D(3, 3)(h))


# name: (block, input shape, [kinds before the head])
MODELS = {
    "group_query_attention": (
        lambda h: L.GroupQueryAttention(2, 4, 2)(h, h, use_causal_mask=True), (T, D),
        ["dense"] * 4),
    "attention_concat_scale": (
        _pair(lambda: L.Attention(use_scale=True, score_mode="concat")), (T, D),
        ["dense", "dense", "scale_and_shift", "scale_and_shift"]),
    "additive_attention": (_pair(L.AdditiveAttention), (T, D),
                           ["dense", "dense", "scale_and_shift"]),
    "dot_product_attention": (lambda h: _DotProductAttention()(h), (T, D), ["dense"] * 3),
    "time_distributed_conv": (lambda h: L.TimeDistributed(L.Conv2D(2, 3))(h), (T, 5, 5, 2),
                              ["conv2d"]),
    # the two Dense layers of the cell read as one, [x, h] @ [W; R] + b
    "custom_cell": (lambda h: L.RNN(_DenseCell(4))(h), (T, D), ["dense"]),
    "stft_trainable": (
        lambda h: L.Conv1D(2, 2)(L.STFTSpectrogram(mode="log", frame_length=8, frame_step=4,
                                                   fft_length=8, trainable=True)(h)),
        (32, 1), ["conv2d", "conv2d", "conv2d"]),
    "normalized_image": (_normalized, (9, 9, 2), ["conv2d"]),
    "identity_lambda_recompute": (
        lambda h: _Recomputed()(L.Lambda(lambda t: tf.nn.gelu(t) + tf.reverse(t, [1]))(
            L.Identity()(h))), (D,), ["dense", "dense"]),
    "rnn_cells": (lambda h: L.RNN([L.LSTMCell(3), L.GRUCell(2)])(h), (T, D),
                  ["dense", "dense", "scale_and_shift", "dense"]),
    "bidirectional_gru_sum": (lambda h: L.Bidirectional(L.GRU(2), merge_mode="sum")(h), (T, D),
                              ["dense", "scale_and_shift", "dense"] * 2),
}
SLOW = ("rnn_cells", "bidirectional_gru_sum", "stft_trainable", "custom_cell")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in MODELS])
def test_layer_is_registered_and_exact(keras_float64, name):
    block, shape, kinds = MODELS[name]
    model = _functional(block, shape, "float64")
    rng = np.random.default_rng(0)
    args = (tf.constant(rng.normal(size=(B, *shape))), tf.constant(rng.integers(0, 3, B)))
    reg = assert_matches_loop(_loss(model), args, rtol=1e-9, atol=1e-12)
    assert [layer.kind for layer in reg.layers] == kinds + ["dense"], reg.summary()
    assert len(reg.variables) == len(model.trainable_variables)
    assert not reg.coupling and not reg.batch_statistics


def test_int4_quantized_model_with_adapters_is_exact():
    """``quantize("int4")`` packs the kernels into int8 (two per byte) with a
    scale and a zero point; the LoRA factors are two dense layers each, the
    biases shifts, and nothing quantized is trainable (the same kinds as
    int8's, which K-FAC trains in test_lora.py)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((T, 8))
    h = L.EinsumDense("btd,dh->bth", (T, 8), bias_axes="h", name="ein")(
        L.Dense(8, activation="relu", name="dense")(inp))
    model = keras.Model(inp, L.Dense(3, name="head")(L.Flatten()(h)))
    model.quantize("int4")
    rng = np.random.default_rng(1)
    for name in ("dense", "ein"):
        model.get_layer(name).enable_lora(2)
    for v in model.trainable_variables:
        if "lora_kernel_b" in v.path:
            v.assign(rng.normal(size=v.shape).astype("float32") * 0.3)
    loss_fn = _loss(model)
    args = (tf.constant(rng.normal(size=(B, T, 8)).astype("float32")),
            tf.constant(rng.integers(0, 3, B)))
    reg = assert_matches_loop(loss_fn, args, rtol=1e-4, atol=1e-6)
    assert [layer.kind for layer in reg.layers].count("dense") == 4, reg.summary()
    assert len(reg.variables) == 7 and not reg.generic_variables


def _images(seed=0):
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.uniform(0, 255, (4, 8, 8, 3)).astype("float32")),
            tf.constant(rng.integers(0, 3, 4)))


def _augmented(augmentation):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8, 8, 3)), augmentation, L.Rescaling(1 / 255),
                             L.Conv2D(3, 3, activation="tanh"), L.Flatten(), L.Dense(3)])


@pytest.mark.parametrize("mix", [L.MixUp, L.CutMix])
def test_batch_mixing_couples_and_dp_sgd_refuses(mix):
    model = _augmented(mix())
    loss_fn, args = _loss(model, training=True), _images()
    reg = loss_fn.registration(*args)
    assert reg.coupling and "gather" in reg.coupling[0].lower(), reg.coupling
    seeds = [v for v in model.variables if "seed_generator" in v.path]
    saved = [v.numpy() for v in seeds]
    pxg = kg.per_example_gradients(loss_fn, *args)
    x, y = args
    for i in range(4):  # example i's own term of the same draw (a batch of one's mean)
        for v, s in zip(seeds, saved):
            v.assign(s)
        with tf.GradientTape() as tape:
            term = keras.losses.sparse_categorical_crossentropy(
                y, model(x, training=True), from_logits=True)[i]
        for g, want in zip(pxg, tape.gradient(term, list(reg.variables))):
            np.testing.assert_allclose(g[i], want, rtol=1e-4, atol=1e-6)
    with pytest.raises(kg.KfacGraphError, match="couples the examples"):
        kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0).step(*args)


def test_verify_differentiates_the_registered_trace_of_augmix():
    """AugMix draws its chains' ops by ``random.choice`` at trace time: a
    reference traced anew is another loss (before: mean FAILED)."""
    random.seed(0)
    loss_fn, args = _loss(_augmented(L.AugMix(value_range=(0, 255))), training=True), _images()
    report = kg.verify(loss_fn, *args)
    assert report.passed, report.table()
    assert all(row.check("one-example").status == "skipped" for row in report.rows)


def _standardised():
    rng = np.random.default_rng(0)
    keras.utils.set_random_seed(0)
    dense = L.Dense(2, dtype="float64")

    @kg.auto_register
    def loss_fn(x, y):
        z = (x - tf.reduce_mean(x, 0)) / (tf.math.reduce_std(x, 0) + 1.0)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, dense(z)))
    return loss_fn, (tf.constant(rng.normal(size=(4, 3))), tf.constant(rng.integers(0, 2, 4)))


def _spectrogram():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 64)).astype("float32")
    x[0] *= 1e4  # the top_db floor (the batch's maximum - 80 dB) reaches example 1
    x[1] *= 1e-3
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)), L.MelSpectrogram(fft_length=16, sequence_stride=8, sequence_length=16,
                                             num_mel_bins=4, sampling_rate=800),
        L.Conv1D(3, 2, activation="tanh"), L.Flatten(), L.Dense(3)])
    return _loss(model), (tf.constant(x), tf.constant(rng.integers(0, 3, 3)))


@pytest.mark.parametrize("make", [_standardised, _spectrogram], ids=["standardised", "mel"])
def test_verify_skips_one_example_on_statistics_of_the_batch(make):
    loss_fn, args = make()
    reg = loss_fn.registration(*args)
    assert reg.batch_statistics and not reg.coupling and not reg.loss.weighted
    report = kg.verify(loss_fn, *args)
    assert report.passed, report.table()
    assert all(row.check("one-example").status == "skipped" for row in report.rows)
    assert any("statistics of the batch's data" in note for note in report.notes), report.notes
    with pytest.raises(kg.KfacGraphError, match="statistic of the whole batch"):
        kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0).step(*args)
