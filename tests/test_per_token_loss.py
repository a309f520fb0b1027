"""Per-token (sequence) losses read from the graph, on a token model
(Embedding -> Dense -> Dense) and an LSTM language model (the slower LSTM
cases under -m slow): targets [B, T], logits [B, T, V], each form a user
writes (tf.nn, Keras losses and ops, flattened
to [B*T, V], one-hot, Bernoulli, squared error), each reduction (mean over
tokens, sum, mean over tokens then batch, a padding-masked mean, Keras
sample_weight and ignore_class).

The references are written by hand here: example i's own loss, with any
batch statistic the loss divides by (sum(w), Keras's count of valid tokens)
taken from the whole batch, differentiated one example at a time; float64.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from passes import ir

B, T, V, D = 3, 4, 5, 6
RTOL = 1e-6


def _float64():
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")


def _token_model(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.layers.Embedding(V, D, name="tokens"),
                              keras.layers.Dense(D, activation="tanh", name="hidden"),
                              keras.layers.Dense(V, name="logits")])
    model.build((None, T))
    return model


def _lstm_lm(seed=0):
    """An LSTM language model (unroll=False: the pass unrolls the loop)."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.layers.Embedding(V, D, name="tokens"),
                              keras.layers.LSTM(3, return_sequences=True, name="lstm"),
                              keras.layers.Dense(V, name="logits")])
    model.build((None, T))
    return model


MODELS = {"token": (_token_model, ["embedding", "dense", "dense"]),
          "lstm": (_lstm_lm, ["embedding", "dense", "dense"])}
LSTM_FAST = ("masked_mean_flattened", "keras_sample_weight", "keras_ignore_class", "bernoulli")


def _data(seed=0):
    rng = np.random.default_rng(seed)
    ids = tf.constant(rng.integers(0, V, (B, T)), tf.int32)
    y = tf.constant(rng.integers(0, V, (B, T)), tf.int32)
    y = tf.tensor_scatter_nd_update(y, [[0, 0], [1, 1]], [0, 0])  # ignore_class 0 occurs
    y = tf.tensor_scatter_nd_update(y, [[0, 1], [2, 2]], [1, 2])  # and so do others
    w = tf.constant([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 1]], tf.float64)
    return ids, y, w


def _ce(y, logits):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)


def _one_hot(y):
    return tf.one_hot(y, V, dtype=tf.float64)


# name: (loss(logits, y, w), (kind, reduction, scale, weighted),
#        example_loss(logits_i, y_i, w_i, y, w) with the batch's statistics)
FORMS = {
    "mean": (lambda z, y, w: tf.reduce_mean(_ce(y, z)),
             ("categorical", "mean", 1 / T, False),
             lambda z, y, w, Y, W: tf.reduce_mean(_ce(y, z))),
    "sum": (lambda z, y, w: tf.reduce_sum(_ce(y, z)),
            ("categorical", "sum", 1.0, False),
            lambda z, y, w, Y, W: tf.reduce_sum(_ce(y, z))),
    "mean_tokens_then_batch": (lambda z, y, w: tf.reduce_mean(tf.reduce_mean(_ce(y, z), axis=1)),
                               ("categorical", "mean", 1 / T, False),
                               lambda z, y, w, Y, W: tf.reduce_mean(_ce(y, z))),
    "flattened": (lambda z, y, w: tf.reduce_mean(_ce(tf.reshape(y, [-1]), tf.reshape(z, [-1, V]))),
                  ("categorical", "mean", 1 / T, False),
                  lambda z, y, w, Y, W: tf.reduce_mean(_ce(y, z))),
    "masked_mean": (lambda z, y, w: tf.reduce_sum(_ce(y, z) * w) / tf.reduce_sum(w),
                    ("categorical", "sum", 1.0, True),
                    lambda z, y, w, Y, W: tf.reduce_sum(_ce(y, z) * w) / tf.reduce_sum(W)),
    "masked_mean_flattened": (
        lambda z, y, w: tf.reduce_sum(_ce(tf.reshape(y, [-1]), tf.reshape(z, [-1, V]))
                                      * tf.reshape(w, [-1])) / tf.reduce_sum(w),
        ("categorical", "sum", 1.0, True),
        lambda z, y, w, Y, W: tf.reduce_sum(_ce(y, z) * w) / tf.reduce_sum(W)),
    # a divisor per position, a statistic of the whole batch: not a scalar
    "per_position_mean": (
        lambda z, y, w: tf.reduce_sum(_ce(y, z) * w / tf.reduce_sum(w, axis=0)),
        ("categorical", "sum", 1.0, True),
        lambda z, y, w, Y, W: tf.reduce_sum(_ce(y, z) * w / tf.reduce_sum(W, axis=0))),
    "keras": (lambda z, y, w: keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, z),
              ("categorical", "mean", 1 / T, False),
              lambda z, y, w, Y, W: tf.reduce_mean(_ce(y, z))),
    "keras_sample_weight": (
        lambda z, y, w: keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
            y, z, sample_weight=w),
        ("categorical", "mean", 1 / T, True),
        lambda z, y, w, Y, W: tf.reduce_sum(_ce(y, z) * w) / T),
    "keras_ignore_class": (
        lambda z, y, w: keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=0)(y, z),
        ("categorical", "mean", 1 / T, True),
        lambda z, y, w, Y, W: B * tf.reduce_sum(
            tf.where(tf.equal(y, 0), tf.zeros_like(_ce(y, z)), _ce(y, z)))
        / tf.reduce_sum(tf.cast(tf.not_equal(Y, 0), tf.float64))),
    "keras_ops": (lambda z, y, w: keras.ops.mean(
        keras.ops.sparse_categorical_crossentropy(y, z, from_logits=True)),
        ("categorical", "mean", 1 / T, False),
        lambda z, y, w, Y, W: tf.reduce_mean(_ce(y, z))),
    "one_hot": (lambda z, y, w: tf.reduce_mean(
        tf.nn.softmax_cross_entropy_with_logits(_one_hot(y), z)),
        ("categorical", "mean", 1 / T, False),
        lambda z, y, w, Y, W: tf.reduce_mean(_ce(y, z))),
    "keras_one_hot": (lambda z, y, w: keras.losses.CategoricalCrossentropy(from_logits=True)(
        _one_hot(y), z),
        ("categorical", "mean", 1 / T, False),
        lambda z, y, w, Y, W: tf.reduce_mean(_ce(y, z))),
    "keras_binary_sample_weight": (
        lambda z, y, w: keras.losses.BinaryCrossentropy(from_logits=True)(
            _one_hot(y), z, sample_weight=w),
        ("bernoulli", "mean", 1 / (T * V), True),
        lambda z, y, w, Y, W: tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(
            _one_hot(y), z) * w[..., None]) / (T * V)),
    "keras_squared_error_sample_weight": (
        lambda z, y, w: keras.losses.MeanSquaredError()(_one_hot(y), z, sample_weight=w),
        ("normal", "mean", 1 / (T * V), True),
        lambda z, y, w, Y, W: tf.reduce_sum(tf.square(z - _one_hot(y)) * w[..., None])
        / (T * V)),
    "bernoulli": (lambda z, y, w: tf.reduce_mean(
        tf.nn.sigmoid_cross_entropy_with_logits(_one_hot(y), z)),
        ("bernoulli", "mean", 1 / (T * V), False),
        lambda z, y, w, Y, W: tf.reduce_mean(
            tf.nn.sigmoid_cross_entropy_with_logits(_one_hot(y), z))),
    "bernoulli_masked": (lambda z, y, w: tf.reduce_sum(tf.reduce_sum(
        tf.nn.sigmoid_cross_entropy_with_logits(_one_hot(y), z), -1) * w) / tf.reduce_sum(w),
        ("bernoulli", "sum", 1.0, True),
        lambda z, y, w, Y, W: tf.reduce_sum(tf.reduce_sum(
            tf.nn.sigmoid_cross_entropy_with_logits(_one_hot(y), z), -1) * w)
        / tf.reduce_sum(W)),
    "squared_error": (lambda z, y, w: tf.reduce_mean(tf.square(z - _one_hot(y))),
                      ("normal", "mean", 1 / (T * V), False),
                      lambda z, y, w, Y, W: tf.reduce_mean(tf.square(z - _one_hot(y)))),
    "squared_error_masked": (
        lambda z, y, w: tf.reduce_sum(tf.square(z - _one_hot(y)) * w[..., None])
        / tf.reduce_sum(w),
        ("normal", "sum", 1.0, True),
        lambda z, y, w, Y, W: tf.reduce_sum(tf.square(z - _one_hot(y)) * w[..., None])
        / tf.reduce_sum(W)),
}


def _registered(model, form):
    loss, _, _ = FORMS[form]

    def loss_fn(ids, y, w):
        return loss(model(ids), y, w)

    return kg.auto_register(loss_fn)


def loop_gradients(model, form, args):
    """Per variable [B, *shape]: the gradient of example i's own loss (the
    batch's statistics held), one GradientTape per example."""
    _, _, example_loss = FORMS[form]
    ids, y, w = args
    variables = model.trainable_variables
    out = []
    for i in range(B):
        with tf.GradientTape() as tape:
            loss = example_loss(model(ids[i:i + 1]), y[i:i + 1], w[i:i + 1], y, w)
        out.append([tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)])
    return [np.stack([o[k].numpy() for o in out]) for k in range(len(variables))]


@pytest.mark.parametrize("model_kind, form", [("token", f) for f in sorted(FORMS)] + [
    pytest.param("lstm", f, marks=() if f in LSTM_FAST else pytest.mark.slow)
    for f in sorted(FORMS)])
def test_per_token_form_registers_and_equals_the_loop(model_kind, form):
    _float64()
    make, kinds = MODELS[model_kind]
    model = make()
    args = _data()
    fn = _registered(model, form)
    reg = fn.registration(*args)
    kind, reduction, scale, weighted = FORMS[form][1]
    assert [layer.kind for layer in reg.layers] == kinds, reg.summary()
    assert (reg.loss.kind, reg.loss.reduction, reg.loss.weighted) == (kind, reduction, weighted)
    assert reg.loss.scale == pytest.approx(scale)
    # the logits [B, T, V], seen through any reshape to [B*T, V] or mask
    assert reg.loss.output == reg.layers[-1].outputs[0]
    assert tuple(ir.shape_of(reg.ir, reg.loss.output)) == (B, T, V)
    if form == "masked_mean":
        assert reg.loss.weights == ("w:0",) and len(reg.loss.divisors) == 1
    if form == "keras_sample_weight":
        assert reg.loss.weights == ("w:0",) and reg.loss.divisors == ()

    got = kg.per_example_gradients(fn, *args)
    want = loop_gradients(model, form, args)
    assert [tuple(g.shape) for g in got] == [(B, *v.shape) for v in model.trainable_variables]
    for g, r in zip(got, want):
        np.testing.assert_allclose(g.numpy(), r, rtol=RTOL, atol=1e-12)
    norms = kg.per_example_gradient_norms(fn, *args).numpy()
    flat = np.concatenate([np.reshape(r, (B, -1)) for r in want], axis=1)
    np.testing.assert_allclose(norms, np.linalg.norm(flat, axis=1), rtol=RTOL)
    # the per-example gradients add up to the batch gradient exactly
    with tf.GradientTape() as tape:
        loss = fn(*args)
    batch = tape.gradient(loss, model.trainable_variables)
    for g, b in zip(got, batch):
        total = tf.reduce_sum(g, 0) if reduction == "sum" else tf.reduce_mean(g, 0)
        np.testing.assert_allclose(total.numpy(), tf.convert_to_tensor(b).numpy(),
                                   rtol=RTOL, atol=1e-12)


@pytest.mark.parametrize("form", ["masked_mean", "keras_ignore_class", "flattened"] + [
    pytest.param(f, marks=pytest.mark.slow) for f in ("keras_sample_weight", "bernoulli_masked")])
def test_verify_passes_on_per_token_forms(form):
    _float64()
    model = _token_model()
    args = _data()
    report = kg.verify(_registered(model, form), *args, examples=B)
    assert report.passed, report.table()
    statuses = {c.name: c.status for row in report.rows for c in row.checks}
    assert statuses["one-example"] == "pass"


def test_verify_says_why_when_token_weights_are_no_multiple_of_the_batch_of_ones():
    """A divisor per position (sum over the batch of w[:, t]) weighs an
    example's tokens by different ratios in the batch and on its own."""
    _float64()
    model = _token_model()
    report = kg.verify(_registered(model, "per_position_mean"), *_data(), examples=B)
    statuses = {c.name: c.status for row in report.rows for c in row.checks}
    assert statuses["one-example"] == "skipped" and report.passed, report.table()
    assert any("token weights in the batch are not a multiple of its own" in note
               for note in report.notes), report.notes
