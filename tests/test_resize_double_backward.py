"""The quadratic model through a nearest-neighbour resize.

`kg.KFAC`'s default step (`momentum_type="qmodel"`) takes Jacobian-vector
products by differentiating a backward pass again; TensorFlow has no
gradient for `ResizeNearestNeighborGrad` (the backward pass of
`keras.layers.Resizing(interpolation="nearest")`, MobileNetV5's multi-scale
fusion), so the first step stopped with "No gradient defined". With
`kfac_graph.double_backward` the products equal central differences
(float64), for both corner conventions,
and K-FAC with its defaults trains the model.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph.optimizer import exact_fisher


def _model(half_pixel_centers):
    keras.utils.set_random_seed(0)
    conv1 = keras.layers.Conv2D(3, 3, padding="same", dtype="float64")
    conv2 = keras.layers.Conv2D(2, 3, dtype="float64")
    head = keras.layers.Dense(3, dtype="float64")

    def logits(x):
        h = tf.tanh(conv1(x))
        h = tf.raw_ops.ResizeNearestNeighbor(images=h, size=[11, 9], align_corners=False,
                                             half_pixel_centers=half_pixel_centers)
        return head(tf.reduce_mean(tf.tanh(conv2(h)), axis=[1, 2]))

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits(x)))

    rng = np.random.default_rng(0)
    args = (tf.constant(rng.normal(size=(3, 6, 5, 2))), tf.constant([0, 2, 1]))
    loss_fn(*args)
    return loss_fn, logits, args


@pytest.mark.parametrize("half_pixel_centers", [False, True])
def test_jacobian_vector_products_equal_forward_mode(half_pixel_centers):
    loss_fn, logits, args = _model(half_pixel_centers)
    reg = loss_fn.registration(*args)
    rng = np.random.default_rng(1)
    u = [tf.constant(rng.normal(size=v.shape)) for v in reg.variables]
    got, _ = tf.function(lambda x, y: exact_fisher.jacobian_vector_products(
        reg, (x, y), [u]))(*args)
    # central differences (forward mode would need the same missing gradient)
    eps, base = 1e-5, [v.numpy() for v in reg.variables]
    sides = []
    for sign in (1, -1):
        for v, b, d in zip(reg.variables, base, u):
            v.assign(b + sign * eps * d.numpy())
        sides.append(logits(args[0]).numpy())
    for v, b in zip(reg.variables, base):
        v.assign(b)
    np.testing.assert_allclose(got[0], (sides[0] - sides[1]) / (2 * eps), rtol=1e-7, atol=1e-9)


def test_kfac_defaults_train_through_a_nearest_resize():
    loss_fn, _, args = _model(True)
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(8)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses
