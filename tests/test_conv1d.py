"""Conv1D (Conv2D on a unit axis, as TensorFlow writes it) with every
padding: per-example gradients verified, the full Fisher block against the
exact Fisher, KFC factors sized by the 1-D kernel, and kg.KFAC training."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg


def _model(padding):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((12, 3)),
        keras.layers.Conv1D(4, 3, padding=padding, activation="relu"),
        keras.layers.Conv1D(5, 2, strides=2, padding=padding),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    x = tf.random.stateless_normal([8, 12, 3], seed=[1, 2])
    y = tf.constant([0, 1, 2, 0, 1, 2, 0, 1])
    return loss_fn, (x, y)


@pytest.mark.parametrize("padding", ["same", pytest.param("valid", marks=pytest.mark.slow),
                                     pytest.param("causal", marks=pytest.mark.slow)])
def test_conv1d_verifies_and_trains(padding):
    loss_fn, args = _model(padding)
    reg = loss_fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == ["conv2d", "conv2d", "dense"]
    report = kg.verify(loss_fn, *args, estimation_mode="exact")
    assert report.passed, report.table()
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact")
    est.update(*args)
    assert [b.input_factor.dim for b in est.blocks[:2]] == [3 * 3 + 1, 2 * 4 + 1]
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(5)]
    assert all(np.isfinite(losses)) and int(opt.skipped_steps) == 0
    assert losses[-1] < losses[0]
