"""Loss terms proven >= 0 from the graph (passes/loss_bounds.py), and the
quadratic model's cap they allow on losses that are no likelihood.

Hand-written expectations: Keras's absolute, Huber and hinge losses are
proven >= 0, tf.compat.v1's Huber too; log-cosh, Poisson and cosine losses
are not; a select's branch is bounded where its comparison holds, and only
there. Then K-FAC's quadratic model on a Huber loss at damping 1e-2 falls
where, without the cap, it rose from 0.26 to 9.4 in 12 steps.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from passes import loss_bounds

X = np.random.default_rng(0).standard_normal((4, 4))
Y_REAL = np.abs(np.random.default_rng(1).standard_normal((4, 3)))
Y_HOT = np.eye(3)[[0, 1, 2, 1]]


def _registration(loss, y, activation=None):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
                              keras.layers.Dense(3, activation=activation)])
    fn = kg.auto_register(lambda x, t: loss(t, model(x)))
    return fn.registration(tf.constant(X, tf.float32), tf.constant(y, tf.float32))


@pytest.mark.parametrize("name,y,activation,expected", [
    ("MeanAbsoluteError", Y_REAL, None, True),
    ("MeanAbsolutePercentageError", Y_REAL, None, True),
    ("Huber", Y_REAL, None, True),
    ("Hinge", Y_HOT, None, True),
    ("SquaredHinge", Y_HOT, None, True),
    ("CategoricalHinge", Y_HOT, None, True),
    ("CategoricalCrossentropy", Y_HOT, "softmax", True),  # a likelihood
    ("LogCosh", Y_REAL, None, False),  # x + softplus(-2x) - log 2: not proven
    ("Poisson", Y_REAL, "softplus", False),  # y_pred - y log y_pred: may be < 0
    ("CosineSimilarity", Y_REAL, None, False),  # in [-1, 1]
])
def test_keras_losses(name, y, activation, expected):
    reg = _registration(getattr(keras.losses, name)(), y, activation)
    assert reg.loss.nonnegative is expected, (reg.loss.kind, reg.per_example_loss)


def test_compat_v1_huber():
    """``min(|e|, delta)``: the linear part ``|e| - min(|e|, delta)`` is >= 0."""
    huber = lambda t, p: tf.compat.v1.losses.huber_loss(t, p, delta=0.5)
    assert _registration(huber, Y_REAL).loss.nonnegative


@pytest.mark.parametrize("slope,expected", [(2.0, True), (0.5, False)])
def test_select_branch_bounded_where_its_comparison_holds(slope, expected):
    """``where(|e| <= 1, e^2, slope |e| - 1)``: past the switch ``|e| > 1``, so
    the second branch is ``> slope - 1``: >= 0 for slope 2, not for 1/2
    (``|e| = 1.5`` gives -0.25)."""
    def loss(t, p):
        e = tf.abs(p - t)
        return tf.reduce_mean(tf.where(e <= 1.0, tf.square(e), slope * e - 1.0))
    reg = _registration(loss, Y_REAL)
    assert reg.loss.nonnegative is expected
    lo, _ = loss_bounds.interval(reg.ir, reg.per_example_loss)
    assert lo == (0.0 if expected else -0.5)


def test_a_branch_bounds_only_the_elements_its_comparison_holds_for():
    """``where(e > 1, mean(e) - 1/2, e^2)``: the elements past the switch are
    ``> 1``, but their row's mean reads the others too (``e = [3, 0, 0]``:
    the first element's branch is -1/2), so nothing is proven."""
    def loss(t, p):
        e = tf.abs(p - t)
        mean = tf.reduce_mean(e, axis=-1, keepdims=True)
        return tf.reduce_mean(tf.where(e > 1.0, mean - 0.5, tf.square(e)))
    assert not _registration(loss, Y_REAL).loss.nonnegative


def test_penalty_must_be_proven_too():
    """A likelihood with ``-0.1 sum(W)`` added is no longer known >= 0; with
    ``0.1 sum(W^2)`` it is."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    cce = keras.losses.CategoricalCrossentropy(from_logits=True)
    args = tf.constant(X, tf.float32), tf.constant(Y_HOT, tf.float32)
    kernel = model.layers[0].kernel
    minus = kg.auto_register(lambda x, t: cce(t, model(x)) + -0.1 * tf.reduce_sum(kernel))
    plus = kg.auto_register(lambda x, t: cce(t, model(x)) + 0.1 * tf.reduce_sum(kernel ** 2))
    assert plus.registration(*args).loss.nonnegative
    assert not minus.registration(*args).loss.nonnegative


def test_interval_is_sound_on_random_inputs():
    """Every term of the select loss above lies in the interval the pass
    gives, over inputs spread across both branches."""
    def terms(t, p):
        e = tf.abs(p - t)
        return tf.reduce_mean(tf.where(e <= 1.0, tf.square(e), 0.5 * e - 1.0), axis=-1)
    reg = _registration(lambda t, p: tf.reduce_mean(terms(t, p)), Y_REAL)
    lo, hi = loss_bounds.interval(reg.ir, reg.per_example_loss)
    values = terms(tf.zeros((1000, 3)), tf.random.stateless_normal((1000, 3), (1, 2)) * 3)
    assert lo <= float(tf.reduce_min(values)) and float(tf.reduce_max(values)) <= hi


def test_qmodel_on_huber_falls_with_the_cap():
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
                              keras.layers.Dense(3)])
    huber = keras.losses.Huber(delta=0.5)
    fn = kg.auto_register(lambda x, t: huber(t, model(x)))
    x = tf.constant(np.random.default_rng(0).standard_normal((3, 4)))
    y = tf.constant(np.random.default_rng(7).standard_normal((3, 3)))
    assert fn.registration(x, y).loss.nonnegative
    opt = kg.KFAC(fn, damping=1e-2)
    losses = [float(opt.step(x, y)) for _ in range(12)]
    assert max(losses) == losses[0] and losses[-1] < 1e-3 * losses[0], losses
