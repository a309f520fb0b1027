"""``graph_optimization`` of ``kg.per_example_gradients`` and
``kg.per_example_gradient_norms``: Grappler off by default for eager calls,
the same values either way, the caller's graph deciding inside a
``tf.function``, and a one-line error for an unknown mode; the norms of a
model whose layers compute in different floats."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import graph_options


def _conv_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 2)), keras.layers.Conv2D(3, 3, activation="relu"),
        keras.layers.Flatten(), keras.layers.Dense(4, dtype="float64")])
    x = tf.random.stateless_normal([5, 8, 8, 2], seed=[1, 2])
    y = tf.constant([0, 1, 2, 3, 1])

    def loss(x, y):
        logits = tf.cast(model(x), tf.float64)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    return kg.auto_register(loss), x, y


@pytest.fixture()
def modes_used(monkeypatch):
    used = []
    real = graph_options.call_options

    @contextlib.contextmanager
    def recording(mode):
        used.append(mode)
        with real(mode):
            yield

    monkeypatch.setattr(graph_options, "call_options", recording)
    return used


def test_eager_calls_skip_grappler_by_default_with_the_same_values(modes_used):
    fn, x, y = _conv_model()
    off = kg.per_example_gradients(fn, x, y)
    default = kg.per_example_gradients(fn, x, y, graph_optimization="default")
    norms_off = kg.per_example_gradient_norms(fn, x, y)
    norms_default = kg.per_example_gradient_norms(fn, x, y, graph_optimization="default")
    assert modes_used == ["off", "default", "off", "default"]
    for a, b in zip(off, default):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(norms_off.numpy(), norms_default.numpy(), rtol=1e-5)
    # against a loop of one-example gradients; the model mixes float32 (the
    # conv) and float64 (the dense layer), whose squared norms are summed in float64
    variables = fn.registration(x, y).variables
    for i in range(5):
        with tf.GradientTape() as tape:
            value = fn(x[i:i + 1], y[i:i + 1])
        for got, want in zip(off, tape.gradient(value, variables)):
            np.testing.assert_allclose(got[i].numpy(), want.numpy(), rtol=1e-4, atol=1e-6)
    assert norms_off.dtype == tf.float64
    whole = np.sqrt(sum(np.sum(np.reshape(g.numpy().astype(np.float64), [5, -1]) ** 2, 1)
                        for g in off))
    np.testing.assert_allclose(norms_off.numpy(), whole, rtol=1e-5)


def test_inside_a_tf_function_the_callers_graph_decides(modes_used):
    fn, x, y = _conv_model()

    @tf.function
    def norms(x, y):
        return kg.per_example_gradient_norms(fn, x, y)

    np.testing.assert_allclose(norms(x, y).numpy(),
                               kg.per_example_gradient_norms(fn, x, y).numpy(), rtol=1e-6)
    assert modes_used == ["off"]  # the eager call only


def test_unknown_mode_is_one_line_error():
    fn, x, y = _conv_model()
    with pytest.raises(ValueError, match=r"^graph_optimization must be one of .*'fast'$"):
        kg.per_example_gradients(fn, x, y, graph_optimization="fast")
