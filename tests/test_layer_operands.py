"""Rule inputs recovered from the graph: for every normaliser,
xhat * scale + shift must reproduce the layer's output."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph.taps import LayerTaps, layer_operands

GAMMA = tf.Variable(tf.constant([1.5, -0.5, 2.0]), name="gamma")
BETA = tf.Variable(tf.constant([0.1, 0.2, -0.3]), name="beta")


def _keras(layer_cls, training):
    keras.utils.set_random_seed(3)
    layer = layer_cls()
    layer.build((None, 4, 4, 3))
    layer.gamma.assign([1.5, -0.5, 2.0])
    layer.beta.assign([0.1, 0.2, -0.3])
    if hasattr(layer, "moving_variance"):
        layer.moving_mean.assign([0.3, -0.1, 0.2])
        layer.moving_variance.assign([2.0, 0.5, 1.5])
    return lambda x: layer(x, training=training)


def _fused(training):
    def apply(x):
        mean = tf.constant([0.3, -0.1, 0.2]) if not training else None
        var = tf.constant([2.0, 0.5, 1.5]) if not training else None
        return tf.compat.v1.nn.fused_batch_norm(x, GAMMA, BETA, mean, var, epsilon=1e-3,
                                                is_training=training)[0]
    return apply


@pytest.mark.parametrize("name, apply", [
    ("keras_bn_train", _keras(keras.layers.BatchNormalization, True)),
    ("keras_bn_infer", _keras(keras.layers.BatchNormalization, False)),
    ("keras_ln", _keras(keras.layers.LayerNormalization, True)),
    ("fused_train", _fused(True)),
    ("fused_infer", _fused(False)),
    ("mul_add", lambda x: x * GAMMA + BETA),
])
def test_normalised_input_reproduces_the_output(name, apply):
    @kg.auto_register
    def loss_fn(x):
        return tf.reduce_sum(tf.square(apply(x)))

    x = tf.random.stateless_normal([2, 4, 4, 3], seed=[4, 5])
    reg = loss_fn.registration(x)
    (layer,) = [layer for layer in reg.layers if layer.kind == "scale_and_shift"]
    scale, shift = layer.variables

    @tf.function
    def run(x):
        taps = LayerTaps.build(reg, (x,))
        index = reg.layers.index(layer)
        xhat, _ = layer_operands(reg, taps, [taps.output_gradients()])[index][0]
        return xhat, taps.outputs[index][0]

    xhat, out = run(x)
    np.testing.assert_allclose(xhat * scale + shift, out, rtol=1e-4, atol=1e-5)


def test_conv1d_tensors_take_the_op_shapes():
    keras.utils.set_random_seed(0)
    conv = keras.layers.Conv1D(2, 3)

    @kg.auto_register
    def loss_fn(x):
        return tf.reduce_sum(tf.square(conv(x)))

    x = tf.ones([2, 6, 4])
    reg = loss_fn.registration(x)
    (layer,) = reg.layers

    @tf.function
    def run(x):
        taps = LayerTaps.build(reg, (x,))
        a, (g,) = layer_operands(reg, taps, [taps.output_gradients()])[0][0]
        return a, g

    a, g = run(x)
    assert a.shape == (2, 1, 6, 4) and g.shape == (2, 1, 4, 2)
