"""The loss pass reads cross-entropies written out on probabilities.

Keras's ``BinaryCrossentropy`` on a sigmoid layer's output normally recovers
the logits itself; when the loss's dtype differs from the model's (a float32
loss on a float64 model, as when Keras's float type changes between making
the two) it casts its input first, loses the sigmoid, and writes
``-(y log(clip(p)) + (1 - y) log(1 - clip(p)))``. The pass must still find a
Bernoulli loss on the pre-sigmoid logits, with the per-example terms that
give the per-example gradients (checked against a loop of one-example
gradients; the loss arithmetic is float32, hence rtol 1e-5). The categorical
cross-entropies do the same on a softmax: ``-sum(y * log(clip(p / sum p)))``
(dense targets) or sparse softmax cross-entropy on ``log(clip(p / sum p))``;
the pass must find a categorical loss on the pre-softmax logits."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg


def _problem():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,), dtype="float64"),
                              keras.layers.Dense(5, activation="tanh", dtype="float64"),
                              keras.layers.Dense(3, activation="sigmoid", dtype="float64")])
    bce = keras.losses.BinaryCrossentropy(dtype="float32")
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(7, 4)))
    y = tf.constant(rng.integers(0, 2, (7, 3)).astype(np.float64))
    return model, kg.auto_register(lambda x, y: bce(y, model(x))), x, y


def test_written_out_binary_cross_entropy_is_bernoulli():
    model, loss_fn, x, y = _problem()
    reg = loss_fn.registration(x, y)
    assert (reg.loss.kind, reg.loss.reduction) == ("bernoulli", "mean")
    assert reg.loss.scale == pytest.approx(1 / 3)  # Keras averages over the 3 outputs
    assert reg.loss.output.endswith("BiasAdd:0"), reg.loss.output  # the logits, not p
    ops = {data["op"] for _, data in reg.ir.nodes(data=True)}
    assert {"Minimum", "Maximum", "Log"} <= ops  # the written-out form, not tf.nn's
    assert [layer.kind for layer in reg.layers] == ["dense", "dense"]


def test_per_example_gradients_match_a_loop():
    model, loss_fn, x, y = _problem()
    grads = kg.per_example_gradients(loss_fn, x, y)
    variables = list(loss_fn.registration(x, y).variables)
    for i in range(int(x.shape[0])):
        with tf.GradientTape() as tape:
            loss = loss_fn(x[i:i + 1], y[i:i + 1])
        for got, want in zip(grads, tape.gradient(loss, variables)):
            np.testing.assert_allclose(got[i].numpy(), want.numpy(), rtol=1e-5, atol=1e-7)


def test_a_probability_that_is_not_a_sigmoid_is_no_likelihood():
    """A cross-entropy on clipped ``x w``, no sigmoid: no Bernoulli the pass
    reads, so its curvature is its Hessian at ``x w`` (kind "ggn"; zero
    where the clip holds, as here)."""
    w = tf.Variable(tf.ones([4, 3], tf.float64))
    bce = keras.losses.BinaryCrossentropy(dtype="float32")
    fn = kg.auto_register(lambda x, y: bce(y, tf.clip_by_value(x @ w, 0.0, 1.0)))
    x, y = tf.ones([2, 4], tf.float64), tf.ones([2, 3], tf.float64)
    reg = fn.registration(x, y)
    assert (reg.loss.kind, reg.loss.output) == ("ggn", "matmul:0")
    est = kg.FisherEstimator(fn, estimation_mode="exact")
    est.update(x, y)
    assert not np.any(est.blocks[0].full_matrix().numpy())


def _softmax_problem(sparse):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,), dtype="float64"),
                              keras.layers.Dense(5, activation="tanh", dtype="float64"),
                              keras.layers.Dense(3, activation="softmax", dtype="float64")])
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(7, 4)))
    labels = rng.integers(0, 3, (7,))
    if sparse:
        loss, y = keras.losses.SparseCategoricalCrossentropy(dtype="float32"), tf.constant(labels)
    else:
        loss = keras.losses.CategoricalCrossentropy(dtype="float32")
        y = tf.one_hot(labels, 3, dtype=tf.float64)
    return model, kg.auto_register(lambda x, y: loss(y, model(x))), x, y


@pytest.mark.parametrize("sparse", [False, True], ids=["dense_targets", "sparse_targets"])
def test_written_out_categorical_cross_entropy_is_categorical(sparse):
    model, loss_fn, x, y = _softmax_problem(sparse)
    reg = loss_fn.registration(x, y)
    assert (reg.loss.kind, reg.loss.reduction, reg.loss.scale) == ("categorical", "mean", 1.0)
    assert reg.loss.output.endswith("BiasAdd:0"), reg.loss.output  # the logits, not log p
    ops = {data["op"] for _, data in reg.ir.nodes(data=True)}
    assert {"Minimum", "Maximum", "Log", "Softmax"} <= ops  # the written-out form
    grads = kg.per_example_gradients(loss_fn, x, y)
    for i in range(int(x.shape[0])):
        with tf.GradientTape() as tape:
            loss = loss_fn(x[i:i + 1], y[i:i + 1])
        for got, want in zip(grads, tape.gradient(loss, list(reg.variables))):
            np.testing.assert_allclose(got[i].numpy(), want.numpy(), rtol=1e-5, atol=1e-7)


def test_a_log_that_is_not_of_a_softmax_is_no_likelihood():
    """``-sum(y log(clip(x w)))`` reads no distribution (the log is of no
    softmax): its curvature is its Hessian at ``z = x w``, ``diag(y / z^2)``
    inside the clip (kind "ggn", ``tests/test_ggn_loss.py``)."""
    w = tf.Variable(np.full([4, 3], 0.1))
    fn = kg.auto_register(
        lambda x, y: -tf.reduce_sum(y * tf.math.log(tf.clip_by_value(x @ w, 1e-7, 1.0))))
    x = tf.constant(np.random.default_rng(0).uniform(0.2, 1.0, (2, 4)))
    y = tf.ones([2, 3], tf.float64)
    reg = fn.registration(x, y)
    assert (reg.loss.kind, reg.loss.output, reg.loss.reduction) == ("ggn", "matmul:0", "sum")
    est = kg.FisherEstimator(fn, estimation_mode="exact", approximations={"dense": "full"})
    est.update(x, y)
    z = (x @ w).numpy()
    # d z_ik / d w_dk = x_id; F = (1/B) sum_i J_i^T diag(1 / z_i^2) J_i, params (d, k) row-major
    want = sum(np.kron(np.outer(xi, xi), np.diag(1.0 / zi ** 2)) for xi, zi in zip(x.numpy(), z))
    np.testing.assert_allclose(est.blocks[0].full_matrix().numpy(), want / 2, rtol=1e-10)
