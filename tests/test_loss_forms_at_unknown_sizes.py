"""Every way of writing a per-token loss reads alike at any signature.

A loss traced with sizes left unknown (``input_signature`` ``[None, T]``,
``[B, None]`` or ``[None, None]``: a SavedModel's, ``kfac-rewrite``'s, a
relaxed step's) divides by sizes the graph computes at run time where a
static trace holds constants. For each form below, ``kg.KFAC``'s steps
(exact mode, float64) and ``kg.per_example_gradients`` under each
signature equal the static trace's to 1e-10: the reduction, the scale,
the token weights and the sizes read at run time (``LossSpec.sizes``)
give the same curvature and terms. A mean over logits flattened to
``[B T, V]`` read as a mean over the batch alone at unknown sizes (scale 1,
not ``1/T``) until its rows were followed through the cross-entropy.
Three cases run in the fast set; every form and signature with ``-m slow``.
"""
import numpy as np
import pytest
import tensorflow as tf
import keras

import kfac_graph as kg

B, T, V = 3, 5, 7
F64 = tf.float64


def _mask(y):
    return tf.cast(y > 1, F64)


def _ce(y, z):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(y, z)


def _scce(**kwargs):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kwargs)


def _one_hot(y):
    return tf.one_hot(y, V, dtype=F64)


def _flat_ce(y, z):
    return _ce(tf.reshape(y, [-1]), tf.reshape(z, [-1, V]))


FORMS = {  # (logits z [B, T, V], targets y [B, T]) -> the loss
    "mean": lambda z, y: tf.reduce_mean(_ce(y, z)),
    "mean_of_sums": lambda z, y: tf.reduce_mean(tf.reduce_sum(_ce(y, z), 1)),
    "mean_of_means": lambda z, y: tf.reduce_mean(tf.reduce_mean(_ce(y, z), 1)),
    "sum_over_B": lambda z, y: tf.reduce_sum(_ce(y, z)) / tf.cast(tf.shape(z)[0], F64),
    "sum_over_BT": lambda z, y: tf.reduce_sum(_ce(y, z)) / tf.cast(tf.size(y), F64),
    "sum_over_T": lambda z, y: tf.reduce_sum(_ce(y, z)) / tf.cast(tf.shape(z)[1], F64),
    "weighted_mean": lambda z, y: tf.reduce_mean(_ce(y, z) * _mask(y)),
    "masked_mean": lambda z, y: tf.reduce_sum(_ce(y, z) * _mask(y)) / tf.reduce_sum(_mask(y)),
    "example_weights": lambda z, y: tf.reduce_mean(_ce(y, z) * tf.cast(y[:, :1] > 2, F64)),
    "keras": lambda z, y: _scce()(y, z),
    "keras_sample_weight": lambda z, y: _scce()(y, z, sample_weight=_mask(y)),
    "keras_ignore_class": lambda z, y: _scce(ignore_class=0)(y, z),
    "keras_sum": lambda z, y: _scce(reduction="sum")(y, z),
    "flat": lambda z, y: tf.reduce_mean(_flat_ce(y, z)),
    "flat_weighted": lambda z, y: tf.reduce_mean(_flat_ce(y, z) * tf.reshape(_mask(y), [-1])),
    "flat_keras": lambda z, y: _scce()(tf.reshape(y, [-1]), tf.reshape(z, [-1, V])),
    "one_hot_keras": lambda z, y: keras.losses.CategoricalCrossentropy(from_logits=True)(
        _one_hot(y), z),
    "squared_error": lambda z, y: tf.reduce_mean(tf.square(z - _one_hot(y))),
    "keras_mse": lambda z, y: keras.losses.MeanSquaredError()(_one_hot(y), z),
    "sigmoid": lambda z, y: tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
        _one_hot(y), z)),
    "keras_bce": lambda z, y: keras.losses.BinaryCrossentropy(from_logits=True)(_one_hot(y), z),
    "compat_v1": lambda z, y: tf.compat.v1.losses.sparse_softmax_cross_entropy(y, z),
    "compat_v1_weights": lambda z, y: tf.compat.v1.losses.sparse_softmax_cross_entropy(
        y, z, weights=_mask(y)),
}
SPECS = {"batch": [None, T], "length": [B, None], "both": [None, None]}
FAST = {("flat_keras", "both"), ("keras_sample_weight", "length"), ("sum_over_T", "batch")}


def _run(form, spec, x, y):
    """(weights after 2 exact-mode K-FAC steps, curvature scale, per-example
    gradients) of ``form`` traced at ``spec`` (None: at the batch's shapes)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((None,), dtype="int32"),
                              keras.layers.Embedding(V, 4), keras.layers.Dense(V)])

    def loss(a, b):
        return FORMS[form](model(a), b)

    fn = kg.auto_register(loss if spec is None else tf.function(
        loss, input_signature=[tf.TensorSpec(spec, tf.int32)] * 2))
    opt = kg.KFAC(fn, estimation_mode="exact", momentum_type="regular", learning_rate=0.1,
                  damping=1e-2)
    for _ in range(2):
        opt.step(x, y)
    return ([v.numpy() for v in model.trainable_variables], float(opt.curvature_scale),
            [g.numpy() for g in kg.per_example_gradients(fn, x, y)])


CASES = [pytest.param(form, spec, id=f"{form}-{spec}",
                      marks=() if (form, spec) in FAST else (pytest.mark.slow,))
         for form in FORMS for spec in SPECS]


@pytest.mark.parametrize("form,spec", CASES)
def test_a_loss_traced_at_unknown_sizes_steps_as_at_known_ones(keras_float64, form, spec):
    rng = np.random.default_rng(0)
    x, y = (tf.constant(rng.integers(0, V, (B, T)), tf.int32) for _ in range(2))
    static, dynamic = _run(form, None, x, y), _run(form, SPECS[spec], x, y)
    assert dynamic[1] == pytest.approx(static[1], rel=1e-12)
    for got, want in [*zip(dynamic[0], static[0]), *zip(dynamic[2], static[2])]:
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
