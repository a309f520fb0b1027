"""Batches of a new shape: one more trace with the sizes that changed unknown
(``kfac_graph/relaxed_shapes.py``), equal to a trace at their own shapes.

References: ``kg.KFAC(relax_shapes=False)`` on the same batches (a trace per
shape, as before), and for DP-SGD a loop of one-example tapes. The last,
partial batch of an epoch and a new sequence length used to trace the whole
step again."""
import numpy as np
import pytest
import tensorflow as tf
import keras
from absl import logging

import kfac_graph as kg
from kfac_graph import relaxed_shapes

L = keras.layers


def _token_model(conv=True):
    """Ids ``[B, T]`` -> logits ``[B, T', 11]`` (``T' = ceil(T / 2)`` with
    ``conv``: a strided Conv1D, a LayerNormalization and a causal
    MultiHeadAttention, whose projections are BatchMatMulV2s at known sizes
    and Einsums at unknown ones)."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((None,), dtype="int32")
    h = L.Embedding(11, 6)(ids)
    if conv:
        h = L.LayerNormalization()(L.Conv1D(6, 3, strides=2, padding="same",
                                            activation="tanh")(h))
        h = h + L.MultiHeadAttention(2, 3)(h, h, use_causal_mask=True)
    else:
        h = L.Dense(6, activation="tanh")(h)
    return keras.Model(ids, L.Dense(11)(L.Dense(8, activation="tanh")(h)))


def _loss(model, reduction):
    @kg.auto_register
    def loss(x, y):
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x))
        if reduction == "sum":  # over tokens, then the mean over the batch
            return tf.reduce_mean(tf.reduce_sum(ce, 1))
        if reduction == "masked":
            mask = tf.cast(y > 1, ce.dtype)
            return tf.reduce_sum(ce * mask) / tf.reduce_sum(mask)
        if reduction == "weighted_mean":
            return tf.reduce_mean(ce * tf.cast(y > 1, ce.dtype))
        if reduction == "huber":  # a Gauss-Newton loss: its Hessian holds its 1/T at any T
            return keras.losses.Huber()(tf.one_hot(y, 11, dtype=ce.dtype), model(x))
        if reduction == "keras_sample_weight":  # sum(ce * w) / size(ce): sum_over_batch_size
            return keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
                y, model(x), sample_weight=tf.cast(y > 1, ce.dtype))
        return tf.reduce_mean(ce)
    return loss


def _batches(shapes, stride=2, seed=0):
    rng = np.random.default_rng(seed)
    return [(tf.constant(rng.integers(0, 11, (b, t)), tf.int32),
             tf.constant(rng.integers(0, 11, (b, -(-t // stride))), tf.int32))
            for b, t in shapes]


def _train(batches, reduction, conv=True, **options):
    model = _token_model(conv)
    opt = kg.KFAC(_loss(model, reduction), **options)
    losses = [float(opt.step(x, y)) for x, y in batches]
    return losses, [v.numpy() for v in model.trainable_variables], opt


def _assert_same(a, b, tol=1e-10):
    np.testing.assert_allclose(a[0], b[0], rtol=tol, atol=tol)
    for u, v in zip(a[1], b[1]):
        np.testing.assert_allclose(u, v, rtol=tol, atol=tol)


@pytest.mark.parametrize("jit_compile", ["auto", pytest.param(True, marks=pytest.mark.slow)])
def test_new_lengths_and_batch_sizes_trace_once_more(keras_float64, jit_compile):
    """A sum over tokens reads alike at any size: one relaxed trace takes
    every later shape (a Conv1D, strided with SAME padding, a
    LayerNormalization and attention read their sizes at run time), and
    the steps equal a trace per shape."""
    batches = _batches([(4, 6), (3, 9), (2, 7)])
    options = dict(momentum_type="regular", learning_rate=0.05, damping=0.1,
                   jit_compile=jit_compile)  # (True: XLA compiles each shape, traced once)
    relaxed = _train(batches, "sum", **options)
    exact = _train(batches, "sum", relax_shapes=False, **options)
    _assert_same(relaxed, exact)
    # the first shape, then all the others
    assert relaxed[2]._compiled.step.experimental_get_tracing_count() == 2
    assert exact[2]._compiled.step.experimental_get_tracing_count() == 3


@pytest.mark.parametrize("options", [
    # all under -m slow: the weighted means below (Keras's sample_weight in the fast
    # set) take the same path, their tokens' weights apart
    pytest.param(dict(momentum_type="regular", learning_rate=0.05, damping=0.1),
                 marks=pytest.mark.slow),
    # statistics every other step: the other steps take the registered graph's pass
    pytest.param(dict(momentum_type="regular", learning_rate=0.05, damping=0.1,
                      cov_update_period=2), marks=pytest.mark.slow),
    pytest.param({}, marks=pytest.mark.slow)], ids=["regular", "cov2", "defaults"])
def test_mean_over_tokens_reads_its_length_at_run_time(keras_float64, monkeypatch, options):
    """A plain mean over tokens divides by T: a constant ``scale`` at known
    sizes, and at an unknown length a size read at run time as a factor of
    the curvature's scale (``LossSpec.size_scaled``), so the Fisher's tokens
    and the factors read alike: new batch sizes and lengths share one
    relaxed trace, with no warning, and equal a trace per shape."""
    warnings = []
    monkeypatch.setattr(logging, "warning", lambda fmt, *a: warnings.append(fmt % a))
    batches = _batches([(4, 6), (3, 6), (4, 9), (2, 9)], stride=1)
    relaxed = _train(batches, "mean", conv=False, **options)
    exact = _train(batches, "mean", conv=False, relax_shapes=False, **options)
    _assert_same(relaxed, exact)
    step = relaxed[2]._compiled.step
    assert step.relaxed[0][0].shape.as_list() == [None, None]
    # (4, 6); (None, 6), widened to (None, None) by (4, 9), which takes (2, 9)
    assert step.experimental_get_tracing_count() == 3
    assert not warnings, warnings


# (reduce_mean(ce * mask) under -m slow: its sizes, an axis's, are in the fast set through
# test_per_token_run_time_sizes.py's blocks at a run-time length)
@pytest.mark.parametrize("reduction", [pytest.param("weighted_mean", marks=pytest.mark.slow),
                                       "keras_sample_weight"])
def test_mean_of_weighted_tokens_reads_its_length_at_run_time(keras_float64, monkeypatch,
                                                              reduction):
    """``reduce_mean(ce * mask)`` and Keras's ``sample_weight`` under
    ``sum_over_batch_size`` weigh their tokens by data and divide by T (and
    B): a constant ``scale`` at known sizes; at an unknown length the
    tokens' weights are ``w_it = s m_it`` with ``s = 1/T`` read from the
    sizes (``LossSpec.sizes``) as a factor of the curvature's scale and
    ``m_it`` the data's, so the factors read alike: new lengths share one
    relaxed trace with no warning, equal to a trace per shape (statistics
    every other step: the steps without take the registered graph's pass)."""
    warnings = []
    monkeypatch.setattr(logging, "warning", lambda fmt, *a: warnings.append(fmt % a))
    batches = _batches([(4, 6), (3, 6), (4, 9), (2, 7)], stride=1)
    options = dict(momentum_type="regular", learning_rate=0.05, damping=0.1,
                   cov_update_period=2)
    relaxed = _train(batches, reduction, conv=False, **options)
    exact = _train(batches, reduction, conv=False, relax_shapes=False, **options)
    _assert_same(relaxed, exact)
    step = relaxed[2]._compiled.step
    assert step.relaxed[0][0].shape.as_list() == [None, None]
    assert step.experimental_get_tracing_count() == 3  # (4, 6); (None, 6); (None, None)
    assert not warnings, warnings
    reg = relaxed[2].estimator.build(tf.TensorSpec([None, None], tf.int32),
                                     tf.TensorSpec([None, None], tf.int32))
    assert reg.loss.size_scaled and reg.loss.data_weighted, reg.summary()


@pytest.mark.slow  # (a ggn loss relaxes in the fast set: test_joined_run_time_length.py)
def test_a_gauss_newton_mean_over_tokens_traces_once_more(keras_float64):
    """A Huber loss over tokens is ``ggn``: its curvature is the Hessian of
    each example's loss, ``1/T`` and all, read from the loss at any length;
    a divisor that is a size there (none at known sizes) changes nothing
    (before, that difference kept a trace per length)."""
    batches = _batches([(4, 6), (6, 6), (4, 9), (2, 9)], stride=1)
    options = dict(estimation_mode="exact", momentum_type="regular", learning_rate=0.1,
                   damping=0.1)
    relaxed = _train(batches, "huber", conv=False, **options)
    exact = _train(batches, "huber", conv=False, relax_shapes=False, **options)
    _assert_same(relaxed, exact)
    assert relaxed[2]._compiled.step.experimental_get_tracing_count() == 3


@pytest.mark.slow
def test_masked_mean_over_tokens_traces_once_more(keras_float64):
    """A masked mean, sum(ce * mask) / sum(mask), divides by data at any
    size: new lengths share one relaxed trace (K-FAC's defaults)."""
    batches = _batches([(4, 6), (3, 9), (2, 7)], stride=1)
    relaxed = _train(batches, "masked", conv=False)
    exact = _train(batches, "masked", conv=False, relax_shapes=False)
    _assert_same(relaxed, exact)
    assert relaxed[2]._compiled.step.experimental_get_tracing_count() == 2


@pytest.mark.slow
def test_a_recurrent_loop_over_an_unknown_length_stays_exact(keras_float64, monkeypatch):
    """An LSTM's loop over T unrolls at a known length only: at an unknown
    one its cell would be generic, so new lengths keep their own traces."""
    warnings = []
    monkeypatch.setattr(logging, "warning", lambda fmt, *a: warnings.append(fmt % a))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((None,), dtype="int32"), L.Embedding(11, 4),
                              L.LSTM(4, return_sequences=True), L.Dense(11)])
    loss = _loss(model, "sum")
    opt = kg.KFAC(loss, momentum_type="regular", learning_rate=0.05)
    for x, y in _batches([(3, 5), (3, 7)], stride=1):
        opt.step(x, y)
    assert opt._compiled.step.relaxed is None
    assert len(warnings) == 1 and "registers as generic there, not dense" in warnings[0], warnings
    assert "not unrolled" in warnings[0]


def test_dpsgd_partial_batch_and_new_length_against_one_example_tapes(keras_float64):
    """kg.DPSGD without noise on batches of three shapes: the clipped mean of
    per-example gradients from a loop of one-example tapes, step by step."""
    model = _token_model(conv=False)
    loss = _loss(model, "mean")
    clip, rate = 0.05, 0.5
    opt = kg.DPSGD(loss, learning_rate=rate, l2_norm_clip=clip, noise_multiplier=0.0, seed=1)
    for x, y in _batches([(4, 6), (3, 9), (2, 6)], stride=1):
        before = [v.numpy() for v in model.trainable_variables]
        clipped = []
        for i in range(x.shape[0]):
            with tf.GradientTape() as tape:
                value = loss(x[i:i + 1], y[i:i + 1])
            grads = tape.gradient(value, model.trainable_variables)
            grads = [tf.convert_to_tensor(g).numpy() for g in grads]
            norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
            clipped.append([g * min(1.0, clip / norm) for g in grads])
        opt.step(x, y)
        for k, v in enumerate(model.trainable_variables):
            expected = before[k] - rate * np.mean([c[k] for c in clipped], axis=0)
            np.testing.assert_allclose(v.numpy(), expected, rtol=1e-9, atol=1e-12)
    assert opt._step_function.experimental_get_tracing_count() == 2


@pytest.mark.slow  # KFACModel.fit steps through kg.KFAC's relaxed step, checked above
def test_kfac_model_fit_batches_of_new_sizes(keras_float64):
    """KFACModel.fit over batches of 4, 3 and 2 examples (the last of an
    epoch is often partial): the steps at 3 and 2 share one relaxed trace,
    and equal a trace per size."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(9, 3)), rng.integers(0, 4, 9)
    batches = [(x[:4], y[:4]), (x[4:7], y[4:7]), (x[7:], y[7:])]
    out = []
    for relax in (True, False):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), L.Dense(5, activation="tanh"), L.Dense(4)])
        wrapped = kg.KFACModel(model, momentum_type="regular", learning_rate=0.05,
                               relax_shapes=relax)
        wrapped.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        wrapped.fit((b for b in batches), epochs=1, steps_per_epoch=3, shuffle=False,
                    verbose=0)
        out.append([v.numpy() for v in model.trainable_variables])
        assert wrapped.kfac._compiled.step.experimental_get_tracing_count() == (2 if relax else 3)
    for u, v in zip(*out):
        np.testing.assert_allclose(u, v, rtol=1e-10, atol=1e-12)


def test_signatures_widen_only_where_sizes_differ():
    a = relaxed_shapes.signature((tf.zeros([4, 6]), np.zeros([4], np.int32)))
    b = relaxed_shapes.signature((tf.zeros([3, 6]), np.zeros([3], np.int32)))
    wide = relaxed_shapes.widen(a, b)
    assert [s.shape.as_list() for s in wide] == [[None, 6], [None]]
    assert relaxed_shapes.widen(a, relaxed_shapes.signature((tf.zeros([4]), np.zeros([4])))) \
        is None  # a rank or dtype that differs is traced at its own shapes
    assert relaxed_shapes.signature((tf.zeros([2]), 3.0)) is None  # a Python number: exact


def test_a_registration_at_known_sizes_after_one_at_unknown_sizes():
    """tf.function serves a call from any trace general enough for it: after
    a registration at [None, None] one at [2, 5] read the mean over tokens
    as a run-time divisor (scale 1). It is now traced at its own sizes."""
    w = tf.Variable(tf.ones([3, 2]))

    @kg.auto_register
    def loss(x, y):
        logits = tf.einsum("btj,jk->btk", x, w)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    unknown = loss.registration(tf.TensorSpec([None, None, 3]), tf.TensorSpec([None, None],
                                                                              tf.int32))
    known = loss.registration(tf.zeros([2, 5, 3]), tf.zeros([2, 5], tf.int32))
    assert (unknown.loss.scale, unknown.loss.divisors) == (1.0, ())
    assert [s.words for s in unknown.loss.sizes] == ["the size of axis 1 of " + (
        unknown.loss.sizes[0].tensor)]
    assert (known.loss.scale, known.loss.divisors, known.loss.sizes) == (0.2, (), ())


def test_dp_model_fit_partial_last_batch(keras_float64):
    """kg.DPModel.fit without noise or clipping over batches of 4, 3 and 3:
    Keras's SGD on the same batches; the batches of 3 run one relaxed step."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(10, 3)), rng.integers(0, 4, 10)
    batches = [(x[:4], y[:4]), (x[4:7], y[4:7]), (x[7:], y[7:])]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out = []
    for private in (True, False):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), L.Dense(5, activation="tanh"), L.Dense(4)])
        wrapped = (kg.DPModel(model, loss=loss, l2_norm_clip=1e9, noise_multiplier=0.0,
                              sampling=None) if private else model)
        wrapped.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        wrapped.fit((b for b in batches), epochs=1, steps_per_epoch=3, shuffle=False,
                    verbose=0)
        out.append([v.numpy() for v in model.trainable_variables])
        if private:  # (4,), then (None,) once
            assert wrapped._step_function.relaxed[0][0].shape.as_list() == [None, 3]
            assert wrapped._step_function.experimental_get_tracing_count() == 2
    for u, v in zip(*out):
        np.testing.assert_allclose(u, v, rtol=1e-10, atol=1e-12)


def test_per_example_gradients_and_norms_of_new_shapes(keras_float64):
    """kg.per_example_gradients and _norms called eagerly on new lengths and
    batch sizes: one relaxed trace each, equal to a fresh registration's."""
    model = _token_model(conv=True)
    loss = _loss(model, "mean")
    for x, y in _batches([(4, 6), (3, 9), (2, 7)]):
        fresh = _loss(model, "mean")
        for got, want in zip(kg.per_example_gradients(loss, x, y),
                             kg.per_example_gradients(fresh, x, y)):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(kg.per_example_gradient_norms(loss, x, y).numpy(),
                                   kg.per_example_gradient_norms(fresh, x, y).numpy(),
                                   rtol=1e-10)
    for want in ("grads", "norms"):
        step = loss.derived[("per_example", want, id(None))]
        assert step.relaxed[0][0].shape.as_list() == [None, None]
        assert step.experimental_get_tracing_count() == 2


def test_a_later_size_widens_the_relaxed_signature_once_more():
    """[4, 6] exactly; [3, 6] relaxed to [None, 6]; [3, 7] widens it to
    [None, None], which then takes [3, 6] too; a batch of the first shape
    keeps its exact trace, and a Python number goes to it as well."""
    calls = []
    step = relaxed_shapes.Relaxed(lambda x: 2.0 * x, lambda first, wider: calls.append(wider),
                                  "test", autograph=False)
    for shape in ([4, 6], [3, 6], [3, 7], [3, 6], [4, 6], [5, 9]):
        x = tf.random.normal(shape)
        np.testing.assert_allclose(step(x).numpy(), 2.0 * x.numpy())
    assert [w[0].shape.as_list() for w in calls] == [[None, 6], [None, None]]
    assert step.relaxed[0][0].shape.as_list() == [None, None]
    assert step.experimental_get_tracing_count() == 3
    assert step.get_concrete_function(tf.zeros([4, 6])) is step.exact.get_concrete_function(
        tf.zeros([4, 6]))


@pytest.mark.slow  # about 40 s: two keras-hub BERTs trained over three lengths
def test_keras_hub_bert_pre_training_heads_relax_new_lengths(keras_float64):
    """keras-hub's ``BertBackbone`` with its own tied ``MaskedLMHead`` and a
    pair head: a relaxed step takes every later length (the default step,
    two traces for three lengths), with the steps of a trace per length."""
    keras_hub = pytest.importorskip("keras_hub")
    vocab, rng = 40, np.random.default_rng(1)

    def make():
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=vocab, num_layers=1, num_heads=2, hidden_dim=8,
            intermediate_dim=16, max_sequence_length=16)
        mlm = keras_hub.layers.MaskedLMHead(vocabulary_size=vocab, activation=None,
                                            token_embedding=backbone.token_embedding)
        pair = L.Dense(2)

        @kg.auto_register
        def loss_fn(ids, segments, mask, positions, targets, pairs):
            out = backbone({"token_ids": ids, "segment_ids": segments, "padding_mask": mask})
            logits = mlm(out["sequence_output"], mask_positions=positions)
            words = tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits)
            nsp = tf.nn.sparse_softmax_cross_entropy_with_logits(pairs,
                                                                 pair(out["pooled_output"]))
            return tf.reduce_mean(words) + tf.reduce_mean(nsp)

        return backbone, loss_fn

    batches = []
    for t in (6, 9, 12):
        ids = tf.constant(rng.integers(0, vocab, (2, t)), tf.int32)
        batches.append((ids, tf.zeros_like(ids), tf.ones_like(ids),
                        tf.constant(rng.integers(0, t, (2, 3)), tf.int32),
                        tf.constant(rng.integers(0, vocab, (2, 3)), tf.int32),
                        tf.constant([0, 1], tf.int32)))

    def train(**options):
        backbone, loss_fn = make()
        opt = kg.KFAC(loss_fn, **options)
        losses = [float(opt.step(*b)) for b in batches]
        assert int(opt.skipped_steps.numpy()) == 0
        return losses, [v.numpy() for v in backbone.trainable_variables], opt

    relaxed, exact = train(), train(relax_shapes=False)
    _assert_same(relaxed, exact)
    assert relaxed[2]._compiled.step.experimental_get_tracing_count() == 2
    assert exact[2]._compiled.step.experimental_get_tracing_count() == 3
