"""The registration zoo's layer cases (tests/zoo.py lists them all):
convolutions, batch norm, embeddings (tied too), a layer called twice,
unrolled recurrences, generic layers and a weight penalty; each ``build()``
returns a ``Built`` with the registration written by hand."""
from __future__ import annotations

import keras
import tensorflow as tf

from zoo_support import L, Built, kb, labels, normal, sparse_ce, var, xy_sparse

# --- convolutions -------------------------------------------------------------

def _cnn_case(conv_layers, seed, shape=(6, 6, 2), classes=3, pool=None):
    pool = pool or keras.layers.GlobalAveragePooling2D()
    head = keras.layers.Dense(classes)
    model = keras.Sequential([keras.Input(shape), *conv_layers, pool, head])

    def loss_fn(x, y):
        return tf.reduce_mean(sparse_ce(y, model(x)))

    return model, head, loss_fn, xy_sparse(None, classes, seed, x_shape=shape)


def conv_same_valid():
    """Conv2D SAME with bias, VALID without bias."""
    c1 = keras.layers.Conv2D(4, 3, padding="same", activation="relu")
    c2 = keras.layers.Conv2D(3, 3, padding="valid", use_bias=False)
    model, head, loss_fn, make_args = _cnn_case([c1, c2], 19)
    return Built(loss_fn, make_args, [L("conv2d", kb(c1)), L("conv2d", [c2.kernel]),
                                      L("dense", kb(head))], "categorical", track=model)


def conv_stride2():
    """Conv2D with stride 2 (SAME and VALID)."""
    c1 = keras.layers.Conv2D(4, 3, strides=2, padding="same", activation="relu")
    c2 = keras.layers.Conv2D(3, 2, strides=2, padding="valid")
    model, head, loss_fn, make_args = _cnn_case([c1, c2], 20, shape=(8, 8, 2))
    return Built(loss_fn, make_args, [L("conv2d", kb(c1)), L("conv2d", kb(c2)),
                                      L("dense", kb(head))], "categorical", track=model)


def conv_dilation():
    """Conv2D with dilation 2, with a bias."""
    c1 = keras.layers.Conv2D(3, 3, dilation_rate=2, padding="valid", activation="relu")
    model, head, loss_fn, make_args = _cnn_case([c1], 21, shape=(7, 7, 2))
    return Built(loss_fn, make_args, [L("conv2d", kb(c1)), L("dense", kb(head))],
                 "categorical", track=model)


def conv1d():
    """Conv1D (ExpandDims + Conv2D + Squeeze) with a bias, on [B, 6, 3]."""
    c1 = keras.layers.Conv1D(4, 3, activation="relu")
    model, head, loss_fn, make_args = _cnn_case(
        [c1], 22, shape=(6, 3), pool=keras.layers.GlobalAveragePooling1D())
    return Built(loss_fn, make_args, [L("conv2d", kb(c1)), L("dense", kb(head))],
                 "categorical", track=model)


def depthwise():
    """DepthwiseConv2D with a bias, then without (depth multiplier 2)."""
    c1 = keras.layers.DepthwiseConv2D(3, padding="same", activation="relu")
    c2 = keras.layers.DepthwiseConv2D(3, depth_multiplier=2, use_bias=False)
    model, head, loss_fn, make_args = _cnn_case([c1, c2], 23)
    return Built(loss_fn, make_args, [L("depthwise_conv2d", kb(c1)),
                                      L("depthwise_conv2d", [c2.kernel]), L("dense", kb(head))],
                 "categorical", track=model)


def separable():
    """SeparableConv2D: a depthwise layer (no bias) and a 1x1 conv2d (bias)."""
    c1 = keras.layers.SeparableConv2D(4, 3, padding="same", activation="relu")
    model, head, loss_fn, make_args = _cnn_case([c1], 24)
    return Built(loss_fn, make_args, [L("depthwise_conv2d", [c1.depthwise_kernel]),
                                      L("conv2d", [c1.pointwise_kernel, c1.bias]),
                                      L("dense", kb(head))], "categorical", track=model)


# --- normalisation, embedding -------------------------------------------------

def batchnorm_training():
    """Dense -> BatchNormalization (training=True) -> Dense."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6),
                              keras.layers.BatchNormalization(), keras.layers.ReLU(),
                              keras.layers.Dense(3)])
    d1, bn, _, d2 = model.layers

    def loss_fn(x, y):
        return tf.reduce_mean(sparse_ce(y, model(x, training=True)))

    return Built(loss_fn, xy_sparse(4, 3, seed=25),
                 [L("dense", kb(d1)), L("scale_and_shift", [bn.gamma, bn.beta]), L("dense", kb(d2))],
                 "categorical", track=model)


def batchnorm_inference():
    """Conv -> BN (training=False) -> relu -> BN(scale=False, training=False)."""
    c1 = keras.layers.Conv2D(3, 3, padding="same", use_bias=False)
    bn1 = keras.layers.BatchNormalization()
    bn2 = keras.layers.BatchNormalization(scale=False)
    model, head, _, make_args = _cnn_case([c1, bn1, keras.layers.ReLU(), bn2], 26)

    def loss_fn(x, y):
        return tf.reduce_mean(sparse_ce(y, model(x, training=False)))

    return Built(loss_fn, make_args,
                 [L("conv2d", [c1.kernel]), L("scale_and_shift", [bn1.gamma, bn1.beta]),
                  L("scale_and_shift", [bn2.beta]), L("dense", kb(head))],
                 "categorical", track=model)


def embedding():
    """Embedding -> mean over the sequence -> Dense."""
    emb = keras.layers.Embedding(10, 4)
    head = keras.layers.Dense(3)
    model = keras.Sequential([keras.Input((5,), dtype="int32"), emb,
                              keras.layers.GlobalAveragePooling1D(), head])

    def loss_fn(ids, y):
        return tf.reduce_mean(sparse_ce(y, model(ids)))

    return Built(loss_fn, lambda b: (labels(b, 10, 27, shape=(5,)), labels(b, 3, 28)),
                 [L("embedding", [emb.embeddings]), L("dense", kb(head))], "categorical",
                 track=model)


# --- shared weights -------------------------------------------------------------

def _tied(transpose_b: bool):
    w = var([5, 3], "w", 9)
    b_enc, b_dec = tf.Variable(tf.zeros([3]), name="b_enc"), tf.Variable(tf.zeros([5]), name="b_dec")

    def loss_fn(x):
        h = tf.tanh(tf.matmul(x, w) + b_enc)
        if transpose_b:
            out = tf.matmul(h, w, transpose_b=True) + b_dec
        else:
            out = tf.matmul(h, tf.transpose(w)) + b_dec
        return tf.reduce_sum(tf.square(x - out))

    return Built(loss_fn, lambda b: (normal([b, 5], 29),),
                 [L("dense", [w], uses=2), L("scale_and_shift", [b_enc]),
                  L("scale_and_shift", [b_dec])], "normal", "sum", track=[w, b_enc, b_dec],
                 targets_arg=0)


def tied_transpose_b():
    """Autoencoder, decoder matmul(h, W, transpose_b=True), separate biases:
    W one dense layer with 2 uses; each bias its own shift layer."""
    return _tied(True)


def tied_tf_transpose():
    """The same autoencoder written with tf.transpose(W)."""
    return _tied(False)


def layer_called_twice():
    """One Keras Dense applied twice: one layer, uses=2."""
    shared = keras.layers.Dense(4, activation="tanh")
    head = keras.layers.Dense(3)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, head(shared(shared(inputs))))

    def loss_fn(x, y):
        return tf.reduce_mean(sparse_ce(y, model(x)))

    return Built(loss_fn, xy_sparse(4, 3, seed=30),
                 [L("dense", kb(shared), uses=2), L("dense", kb(head))], "categorical", track=model)


def rnn_unrolled(steps: int = 3):
    """An RNN cell unrolled by a Python loop over T=3 steps: the input
    weights are used T times, the recurrent weights T-1 times (h_0 comes from
    the first input)."""
    wx, b = var([2, 4], "wx", 10), tf.Variable(tf.zeros([4]), name="b")
    wh = var([4, 4], "wh", 11)
    head = var([4, 3], "head", 12)

    def loss_fn(x, y):
        h = tf.tanh(tf.matmul(x[:, 0], wx) + b)
        for t in range(1, steps):
            h = tf.tanh(tf.matmul(x[:, t], wx) + b + tf.matmul(h, wh))
        return tf.reduce_mean(sparse_ce(y, tf.matmul(h, head)))

    return Built(loss_fn, xy_sparse(None, 3, seed=31, x_shape=(steps, 2)),
                 [L("dense", [wx, b], uses=steps), L("dense", [wh], uses=steps - 1),
                  L("dense", [head])], "categorical", track=[wx, b, wh, head])


def rnn_zero_state(steps: int = 3):
    """The usual way to write it: h_0 = zeros, then T=3 steps. The cell
    ``(x @ wx + b) + h @ wh`` is one stacked dense layer ``[x, h] @ [wx; wh]
    + b`` used T times, not a generic one."""
    wx, b = var([2, 4], "wx", 16), tf.Variable(tf.zeros([4]), name="b")
    wh = var([4, 4], "wh", 17)
    head = var([4, 3], "head", 18)

    def loss_fn(x, y):
        h = tf.zeros([x.shape[0], 4])
        for t in range(steps):
            h = tf.tanh(tf.matmul(x[:, t], wx) + b + tf.matmul(h, wh))
        return tf.reduce_mean(sparse_ce(y, tf.matmul(h, head)))

    return Built(loss_fn, xy_sparse(None, 3, seed=35, x_shape=(steps, 2)),
                 [L("dense", [wx, wh, b], uses=steps), L("dense", [head])], "categorical", track=[wx, b, wh, head])


# --- what no pattern matches --------------------------------------------------------

def prelu_alpha():
    """keras PReLU's alpha, ``relu(x) - alpha * relu(-x)``: a scale of
    ``relu(-x)`` through a negation (scale-and-shift), between the dense
    layers; its weights are applied once."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5), keras.layers.PReLU(),
                              keras.layers.Dense(3)])
    d1, prelu, d2 = model.layers

    def loss_fn(x, y):
        return tf.reduce_mean(sparse_ce(y, model(x)))

    return Built(loss_fn, xy_sparse(4, 3, seed=32),
                 [L("dense", kb(d1)), L("scale_and_shift", [prelu.alpha]), L("dense", kb(d2))],
                 "categorical", track=model)


def generic_sin():
    """A tf.Variable read through tf.sin: a generic layer."""
    w, b = var([4, 5], "w", 13), tf.Variable(tf.zeros([5]), name="b")
    a = tf.Variable(tf.ones([5]), name="a")
    w2 = var([5, 3], "w2", 14)

    def loss_fn(x, y):
        h = (tf.matmul(x, w) + b) * tf.sin(a)
        return tf.reduce_mean(sparse_ce(y, tf.matmul(h, w2)))

    return Built(loss_fn, xy_sparse(4, 3, seed=33),
                 [L("dense", [w, b]), L("generic", [a]), L("dense", [w2])], "categorical",
                 track=[w, b, a, w2])


def weight_penalty():
    """A data-independent L2 penalty added to the loss (which the loss pass
    reads through): the kernel is still a dense layer."""
    w, b = var([4, 3], "w", 15), tf.Variable(tf.zeros([3]), name="b")

    def loss_fn(x, y):
        data = tf.reduce_mean(sparse_ce(y, tf.matmul(x, w) + b))
        return data + 1e-3 * tf.reduce_sum(tf.square(w))

    return Built(loss_fn, xy_sparse(4, 3, seed=34), [L("dense", [w, b])], "categorical",
                 track=[w, b])
