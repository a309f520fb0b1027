"""The re-imported graph: same loss, per-example loss terms, layer tensors,
and output gradients that equal a brute-force loop over examples."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph.taps import LayerTaps


def _model_and_loss(reduction):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.LayerNormalization(), keras.layers.Dense(3)])
    reduce = tf.reduce_mean if reduction == "mean" else tf.reduce_sum

    @kg.auto_register
    def loss_fn(x, y):
        return 0.5 * reduce(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    return model, loss_fn


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_taps_match_a_loop_over_examples(reduction, jit):
    model, loss_fn = _model_and_loss(reduction)
    x = tf.random.stateless_normal([5, 5], seed=[1, 2])
    y = tf.constant([0, 1, 2, 0, 1])
    reg = loss_fn.registration(x, y)

    @tf.function(jit_compile=jit)
    def run(x, y):
        taps = LayerTaps.build(reg, (x, y))
        return taps.loss, taps.per_example_loss, taps.outputs[2][0], taps.output_gradients()[2][0]

    loss, terms, logits, g = run(x, y)
    np.testing.assert_allclose(loss, loss_fn(x, y), rtol=1e-6)
    np.testing.assert_allclose(logits, model(x), rtol=1e-5, atol=1e-6)
    for i in range(5):
        xi, yi = x[i:i + 1], y[i:i + 1]
        zi = tf.Variable(model(xi))
        with tf.GradientTape() as tape:
            term = 0.5 * tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(yi, zi))
        np.testing.assert_allclose(terms[i], term, rtol=1e-5)
        np.testing.assert_allclose(g[i], tape.gradient(term, zi)[0], rtol=1e-5, atol=1e-7)
    batch_term = tf.reduce_mean(terms) if reduction == "mean" else tf.reduce_sum(terms)
    np.testing.assert_allclose(batch_term, loss, rtol=1e-5)


def test_taps_refuse_eager_mode():
    _, loss_fn = _model_and_loss("mean")
    x, y = tf.zeros([2, 5]), tf.zeros([2], tf.int32)
    with pytest.raises(RuntimeError, match="inside a tf.function"):
        LayerTaps.build(loss_fn.registration(x, y), (x, y))
