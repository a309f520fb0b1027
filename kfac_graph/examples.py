"""Small built-in examples: real models the command line and tests can run
without downloading anything."""
from __future__ import annotations

import keras
import tensorflow as tf

from kfac_graph.auto_register import auto_register


def small_cnn(batch_size: int = 8, num_classes: int = 10, seed: int = 0):
    """A Keras CNN on 16x16 RGB images (conv, batch norm, depthwise, 1x1 conv,
    pooling, dense) with a sparse softmax cross-entropy loss.

    Returns ``(model, loss_fn, (images, labels))``; ``loss_fn`` is
    auto-registered."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv"),
        keras.layers.BatchNormalization(name="batch_norm"),
        keras.layers.DepthwiseConv2D(3, strides=2, padding="same", activation="relu",
                                     name="depthwise"),
        keras.layers.Conv2D(32, 1, activation="relu", name="pointwise"),
        keras.layers.GlobalAveragePooling2D(name="pool"),
        keras.layers.Dense(num_classes, name="logits"),
    ], name="small_cnn")

    @auto_register
    def loss_fn(images, labels):
        logits = model(images, training=True)
        return tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))

    images = tf.random.stateless_normal([batch_size, 16, 16, 3], seed=[seed, 1])
    labels = tf.random.stateless_uniform([batch_size], [seed, 2], maxval=num_classes,
                                         dtype=tf.int32)
    return model, loss_fn, (images, labels)
