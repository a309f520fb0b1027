"""Ops TensorFlow differentiates through a custom gradient (Keras's swish and
silu, tf.custom_gradient in user code, tf.recompute_grad): the re-run graph differentiates their
forward ops, so per-example gradients equal a loop of one-example tapes and
kg.KFAC trains the model."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg


@tf.custom_gradient
def softplus(x):
    """A numerically stable softplus with its own gradient, as users write them."""
    y = tf.nn.relu(x) + tf.math.log1p(tf.exp(-tf.abs(x)))
    return y, lambda dy: dy * tf.sigmoid(x)


def _models():
    keras.utils.set_random_seed(0)
    mlp = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="swish"),
                            keras.layers.Dense(4, activation="silu"), keras.layers.Dense(3)])
    cnn = keras.Sequential([keras.Input((6, 6, 2)), keras.layers.Conv2D(4, 3, activation="swish"),
                            keras.layers.DepthwiseConv2D(3, activation="swish"),
                            keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)])
    dense = keras.layers.Dense(4)
    head = keras.layers.Dense(3)
    user = lambda x: head(softplus(dense(x)))  # noqa: E731
    return {"mlp": (mlp, (6,)), "cnn": (cnn, (6, 6, 2)), "user": (user, (6,))}


@pytest.mark.parametrize("name", ["mlp", "cnn", "user"])
def test_per_example_gradients_equal_a_loop(name):
    model, shape = _models()[name]
    x = tf.random.stateless_normal([5, *shape], seed=[1, 2])
    y = tf.constant([0, 1, 2, 0, 1])

    def loss(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    fn = kg.auto_register(loss)
    reg = fn.registration(x, y)
    assert all(layer.kind != "generic" for layer in reg.layers), reg.summary()
    grads = kg.per_example_gradients(fn, x, y)
    for i in range(5):
        with tf.GradientTape() as tape:
            value = loss(x[i:i + 1], y[i:i + 1])
        want = tape.gradient(value, list(reg.variables))
        for got, ref in zip(grads, want):
            np.testing.assert_allclose(got[i], ref, rtol=1e-4, atol=1e-6)
    norms = kg.per_example_gradient_norms(fn, x, y)
    flat = tf.concat([tf.reshape(g, [5, -1]) for g in grads], 1)
    np.testing.assert_allclose(norms, tf.norm(flat, axis=1), rtol=1e-4)


def test_kfac_trains_through_swish():
    model, _ = _models()["cnn"]
    x = tf.random.stateless_normal([16, 6, 6, 2], seed=[3, 4])
    y = tf.random.stateless_uniform([16], [5, 6], maxval=3, dtype=tf.int32)

    @kg.auto_register
    def loss(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    opt = kg.KFAC(loss)
    losses = [float(opt.step(x, y)) for _ in range(5)]
    assert all(np.isfinite(losses)) and int(opt.skipped_steps) == 0
    assert losses[-1] < losses[0]


def test_recompute_grad_block_verifies_and_trains():
    """A block under tf.recompute_grad (a custom gradient that re-runs the
    forward pass): its dense layer registers, kg.verify passes in float64,
    and K-FAC trains."""
    inner = keras.layers.Dense(5, activation="tanh", dtype="float64")
    head = keras.layers.Dense(3, dtype="float64")
    inner.build((None, 4))
    head.build((None, 5))
    block = tf.recompute_grad(lambda h: inner(h))
    x = tf.random.stateless_normal([6, 4], [1, 2], dtype=tf.float64)
    y = tf.constant([0, 1, 2, 0, 1, 2])

    @kg.auto_register
    def loss(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, head(block(x))))

    reg = loss.registration(x, y)
    assert [layer.kind for layer in reg.layers] == ["dense", "dense"], reg.summary()
    report = kg.verify(loss, x, y)
    assert report.passed, report.table()
    opt = kg.KFAC(loss, damping=0.1)
    losses = [float(opt.step(x, y)) for _ in range(3)]
    assert int(opt.skipped_steps) == 0 and losses[-1] < losses[0], losses


@pytest.mark.slow
def test_efficientnet_b0_per_example_and_kfac():
    keras.utils.set_random_seed(0)
    model = keras.applications.EfficientNetB0(weights=None, input_shape=(32, 32, 3), classes=4)
    x = tf.random.stateless_normal([2, 32, 32, 3], seed=[7, 8])
    y = tf.constant([0, 3])

    @kg.auto_register
    def loss(x, y):
        logits = model(x, training=False)
        return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, logits))

    assert kg.verify(loss, x, y, examples=2).passed
    opt = kg.KFAC(loss)
    assert all(np.isfinite(float(opt.step(x, y))) for _ in range(2))
