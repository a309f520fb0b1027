"""Batch normalisation on rank-3 input (after a Conv1D): the scale-and-shift
rule reads the normalised input right in inference mode (per-example
gradients equal a loop) and in training mode (their mean is the batch
gradient)."""
import keras
import pytest
import tensorflow as tf

import kfac_graph as kg


@pytest.mark.parametrize("training", [False, True])
def test_rank3_batch_norm_verifies(training):
    keras.utils.set_random_seed(0)
    bn = keras.layers.BatchNormalization()
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.Conv1D(4, 2), bn,
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    bn.moving_mean.assign([0.3, -0.2, 0.1, 0.0])
    bn.moving_variance.assign([2.0, 0.5, 1.5, 1.0])

    @kg.auto_register
    def loss_fn(x, y):
        logits = model(x, training=training)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    x = tf.random.stateless_normal([6, 5, 3], seed=[1, 2])
    y = tf.constant([0, 1, 2, 0, 1, 2])
    reg = loss_fn.registration(x, y)
    assert [layer.kind for layer in reg.layers] == ["conv2d", "scale_and_shift", "dense"]
    report = kg.verify(loss_fn, x, y)
    assert report.passed, report.table()
    bn_row = report.rows[1]
    assert bn_row.check("mean").status == "pass"
    assert bn_row.check("one-example").status == ("skipped" if training else "pass")
