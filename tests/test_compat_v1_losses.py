"""tf.compat.v1.losses and tf.nn.l2_loss, as TF1-era training code calls them.

- With a constant weight (the default 1.0) and the default reduction
  (``SUM_BY_NONZERO_WEIGHTS``) or ``MEAN``, a v1 loss divides by the count
  (or sum) of the weights broadcast to the terms, ``num_present``: a mean
  over the batch, scaled by the weight. It was read as a sum divided by
  data, every per-example gradient 1/B of a batch of one's (and DP-SGD's
  clip B times too loose). Now each equals a one-example tape.
- With data weights, that divisor is a statistic of the batch's data: it is
  listed in ``reg.batch_statistics`` and DP-SGD refuses it, as it does the
  same loss written by hand (before, it ran: the ones the weights are
  broadcast against hid the examples' rows from the tracker).
- ``tf.nn.l2_loss(z - y)`` sums every squared error in one op: it is written
  out as ``0.5 * sum(square(z - y))`` and read as a Gaussian likelihood
  (before, refused, and named, K-FAC and DP-SGD stopped).

float64 model; the v1 losses compute in float32 inside, so 1e-6.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg

V1 = tf.compat.v1.losses
R = V1.Reduction
B = 5


def _model():
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
                             keras.layers.Dense(3)])


def _data():
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(B, 4)))
    return x, tf.constant(np.eye(3)[rng.integers(0, 3, B)]), tf.constant(rng.normal(size=(B, 3)))


def _tapes(loss, variables, *args):
    out = []
    for i in range(B):
        with tf.GradientTape() as tape:
            value = loss(*(a[i:i + 1] for a in args))
        out.append(tape.gradient(value, variables))
    return [np.stack([o[k] for o in out]) for k in range(len(variables))]


CONSTANT_WEIGHT = {
    "softmax_default": lambda m: lambda x, y, t: V1.softmax_cross_entropy(y, m(x)),
    "softmax_mean_w0.7": lambda m: lambda x, y, t: V1.softmax_cross_entropy(
        y, m(x), weights=0.7, reduction=R.MEAN),
    "softmax_nonzero_w0.7_smoothed": lambda m: lambda x, y, t: V1.softmax_cross_entropy(
        y, m(x), weights=0.7, label_smoothing=0.1),
    "squared_error_default": lambda m: lambda x, y, t: V1.mean_squared_error(t, m(x)),
    "l2_loss_mean": lambda m: lambda x, y, t: tf.nn.l2_loss(m(x) - t) / tf.cast(
        tf.shape(x)[0], tf.float64),
}


@pytest.mark.parametrize("name", sorted(CONSTANT_WEIGHT))
def test_constant_weight_is_a_mean_and_equals_one_example_tapes(name):
    model = _model()
    loss = CONSTANT_WEIGHT[name](model)
    fn = kg.auto_register(loss)
    args = _data()
    reg = fn.registration(*args)
    assert (reg.loss.reduction, reg.loss.divisors, reg.batch_statistics) == ("mean", (), ())
    got = kg.per_example_gradients(fn, *args)
    for g, w in zip(got, _tapes(loss, reg.variables, *args)):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("reduction", ["MEAN", "SUM_BY_NONZERO_WEIGHTS"])
def test_data_weights_divide_by_a_batch_statistic_that_dp_refuses(reduction):
    model = _model()
    w = tf.constant([1.0, 0.0, 2.0, 0.5, 1.5], tf.float64)
    labels = tf.constant([0, 2, 1, 1, 0])

    def loss(x, y, w):
        return V1.sparse_softmax_cross_entropy(y, model(x), weights=w,
                                               reduction=getattr(R, reduction))
    fn = kg.auto_register(loss)
    x = _data()[0]
    reg = fn.registration(x, labels, w)
    assert reg.batch_statistics, "the weights' sum (or count) is a statistic of the batch"
    with pytest.raises(kg.KfacGraphError, match="statistic of the whole batch"):
        kg.dp_gradients(fn, x, labels, w, l2_norm_clip=1.0, noise_multiplier=0.0, seed=(1, 2))
    # each example's share of the batch gradient (its numerator over the batch's divisor)
    with tf.GradientTape() as tape:
        value = loss(x, labels, w)
    whole = tape.gradient(value, reg.variables)
    for g, want in zip(kg.per_example_gradients(fn, x, labels, w), whole):
        np.testing.assert_allclose(tf.reduce_sum(g, 0).numpy(), want.numpy(), rtol=1e-6,
                                   atol=1e-9)


def test_l2_loss_is_a_gaussian_likelihood_that_kfac_and_dp_train():
    model = _model()
    x, _, t = _data()
    fn = kg.auto_register(lambda x, t: tf.nn.l2_loss(model(x) - t) / B)
    reg = fn.registration(x, t)
    assert (reg.loss.kind, reg.loss.reduction, reg.loss.scale) == ("normal", "mean", 0.5)
    est = kg.FisherEstimator(fn, estimation_mode="exact")
    est.update(x, t)
    opt = kg.KFAC(fn)
    losses = [float(opt.step(x, t)) for _ in range(5)]
    assert losses[-1] < 0.5 * losses[0], losses
    kg.dp_gradients(fn, x, t, l2_norm_clip=1.0, noise_multiplier=1.0, seed=(1, 2))
