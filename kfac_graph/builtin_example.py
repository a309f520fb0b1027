"""The built-in example: a small Keras CNN (``small_cnn``) and its K-FAC
training run on scikit-learn's digits (``train_small_cnn``), a real model the
command line (``kfac-graph``) and tests can run without downloading anything."""
from __future__ import annotations

import keras
import numpy as np
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


def _to_small_cnn_images(pixels):
    """``[N, 8, 8]`` images in ``[0, 1]`` -> standardised ``[N, 16, 16, 3]``
    (bilinear upsampling, the grey channel repeated), the CNN's input."""
    x = tf.image.resize(tf.constant(pixels, tf.float32)[..., None], [16, 16])
    x = tf.tile(x, [1, 1, 1, 3])
    return (x - tf.reduce_mean(x)) / (tf.math.reduce_std(x) + 1e-6)


def training_data(seed: int = 0, num_classes: int = 10):
    """``(name, (train_images, train_labels), (test_images, test_labels))``
    for the small CNN: scikit-learn's 8x8 digits (shipped with the package,
    no download) upsampled to 16x16x3 when scikit-learn is importable, else
    a synthetic task (``name`` says which): 8x8 images whose mean is a fixed
    random pattern per class, plus unit noise."""
    rng = np.random.default_rng(seed)
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        load_digits = None
    if load_digits is not None:
        data = load_digits()
        pixels, labels = data.images / 16.0, data.target
        name = "scikit-learn digits (8x8, upsampled to 16x16x3)"
    else:
        n = 1800
        means = rng.uniform(0.0, 1.0, size=(num_classes, 8, 8))
        labels = rng.integers(0, num_classes, size=n)
        pixels = means[labels] + 0.5 * rng.normal(size=(n, 8, 8))
        name = "synthetic (class-dependent mean 8x8 images, noise)"
    order = rng.permutation(len(labels))
    pixels, labels = pixels[order], labels[order].astype("int32")
    images = _to_small_cnn_images(pixels)
    split = int(0.8 * len(labels))
    return (name, (images[:split], tf.constant(labels[:split])),
            (images[split:], tf.constant(labels[split:])))


def train_small_cnn(steps: int = 30, batch_size: int = 64, seed: int = 0,
                    log_every: int = 10, print_fn=print, **kfac_options):
    """Trains :func:`small_cnn` with ``kg.KFAC`` for ``steps`` steps on
    :func:`training_data`; prints the batch loss every ``log_every`` steps
    and the held-out accuracy (batch statistics in the batch norm).

    Returns ``(final batch loss, test accuracy)``."""
    from kfac_graph.optimizer.kfac import KFAC

    name, (x, y), (x_test, y_test) = training_data(seed)
    if "scikit-learn" not in name:
        print_fn("scikit-learn not importable: training on a synthetic task instead")
    print_fn(f"training the CNN with kg.KFAC for {steps} steps on {name}, "
             f"batch {batch_size}, {int(x.shape[0])} train / {int(x_test.shape[0])} test")
    shown = ", ".join(f"{k}={v!r}" for k, v in kfac_options.items())
    print_fn(f"kg.KFAC({shown or 'defaults'})")
    model, loss_fn, _ = small_cnn(batch_size=batch_size, seed=seed)
    opt = KFAC(loss_fn, **kfac_options)
    rng = np.random.default_rng(seed + 1)
    n = int(x.shape[0])
    loss = float("nan")
    for step in range(1, steps + 1):
        index = rng.choice(n, batch_size, replace=False)
        loss = float(opt.step(tf.gather(x, index), tf.gather(y, index)))
        if step == 1 or step % log_every == 0 or step == steps:
            print_fn(f"step {step:4d}  loss {loss:.4f}")
    logits = model(x_test, training=True)
    accuracy = float(tf.reduce_mean(tf.cast(
        tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y_test), tf.float32)))
    print_fn(f"test accuracy after {steps} steps: {accuracy:.3f}")
    return loss, accuracy
