"""The registration zoo: small models whose registration is written by hand.

Each ``ZooCase`` has a ``build()`` that makes a fresh model and returns a
``Built``: the plain (unwrapped) loss function, a way to make example
arguments for any batch size, the objects to track when saving it, and the
EXPECTED registration, layer by layer (kind, variables in order, uses), and
the loss (kind, reduction, scale). Expected variables are the model's own
objects (``keras.Variable`` or ``tf.Variable``), or a callable giving them;
compare them with ``same_variable``.

Shared by tests/test_registration_zoo.py (the trace front end) and
tests/test_saved_model_frontend.py (the SavedModel front end).
"""
from __future__ import annotations

from typing import Sequence

import keras
import tensorflow as tf

from zoo_support import (  # noqa: F401 - re-exported for the tests
    B, L, Built, ZooCase, bits, kb, labels, normal, one_hot, same_variable, sparse_ce,
    tf_variable, var, variable_name, xy_sparse)


# --- Keras Sequential / functional / subclassed -------------------------------

def seq_mlp():
    """Sequential MLP; dense with and without bias; tf.nn sparse CE, mean."""
    model = keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(6, activation="relu"),
        keras.layers.Dense(4, use_bias=False, activation="tanh"),
        keras.layers.Dense(3),
    ])
    d1, d2, d3 = model.layers

    def loss_fn(x, y):
        return tf.reduce_mean(sparse_ce(y, model(x)))

    return Built(loss_fn, xy_sparse(5, 3), [L("dense", kb(d1)), L("dense", [d2.kernel]),
                                            L("dense", kb(d3))], "categorical", track=model)


def functional_residual_sum():
    """Functional model with a residual connection; tf.nn sparse CE, sum."""
    inputs = keras.Input((4,))
    d1 = keras.layers.Dense(5, activation="tanh")
    d2 = keras.layers.Dense(5)
    d3 = keras.layers.Dense(3)
    h = d1(inputs)
    h = keras.layers.Add()([d2(h), h])
    model = keras.Model(inputs, d3(keras.layers.Activation("relu")(h)))

    def loss_fn(x, y):
        return tf.reduce_sum(sparse_ce(y, model(x)))

    return Built(loss_fn, xy_sparse(4, 3, seed=1),
                 [L("dense", kb(d1)), L("dense", kb(d2)), L("dense", kb(d3))],
                 "categorical", "sum", track=model)


class SubclassedNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = keras.layers.Dense(6)
        self.norm = keras.layers.LayerNormalization()
        self.d2 = keras.layers.Dense(3)

    def call(self, x):
        return self.d2(tf.nn.relu(self.norm(self.d1(x))))


def subclassed_layernorm_scce_logits():
    """Subclassed model with LayerNormalization; Keras SCCE(from_logits=True)."""
    model = SubclassedNet(name="subclassed_net")
    make_args = xy_sparse(5, 3, seed=2)
    model(make_args(B)[0])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss_fn(x, y):
        return loss(y, model(x))

    return Built(loss_fn, make_args,
                 [L("dense", kb(model.d1)), L("scale_and_shift", [model.norm.gamma, model.norm.beta]),
                  L("dense", kb(model.d2))], "categorical", track=model)


def seq_softmax_scce_probs():
    """Softmax output; Keras SCCE(from_logits=False) reads through the softmax."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=False)

    def loss_fn(x, y):
        return loss(y, model(x))

    return Built(loss_fn, xy_sparse(4, 3, seed=3),
                 [L("dense", kb(model.layers[0])), L("dense", kb(model.layers[1]))],
                 "categorical", track=model)


def functional_cce_onehot():
    """Functional model; Keras CategoricalCrossentropy on one-hot targets."""
    inputs = keras.Input((4,))
    d1, d2 = keras.layers.Dense(6, activation="relu"), keras.layers.Dense(3)
    model = keras.Model(inputs, d2(d1(inputs)))
    loss = keras.losses.CategoricalCrossentropy(from_logits=True)

    def loss_fn(x, y):
        return loss(y, model(x))

    return Built(loss_fn, lambda b: (normal([b, 4], 4), one_hot(b, 3, 4)),
                 [L("dense", kb(d1)), L("dense", kb(d2))], "categorical", track=model)


def keras_bce_logits():
    """Multi-label output (K=4); Keras BinaryCrossentropy(from_logits=True):
    the mean over the 4 outputs gives scale 1/4."""
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="relu"),
                              keras.layers.Dense(4)])
    loss = keras.losses.BinaryCrossentropy(from_logits=True)

    def loss_fn(x, y):
        return loss(y, model(x))

    return Built(loss_fn, lambda b: (normal([b, 5], 5), bits(b, 4, 5)),
                 [L("dense", kb(model.layers[0])), L("dense", kb(model.layers[1]))],
                 "bernoulli", scale=1 / 4, track=model)


def keras_bce_probs():
    """Sigmoid output (K=4); Keras BinaryCrossentropy(from_logits=False)."""
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="relu"),
                              keras.layers.Dense(4, activation="sigmoid")])
    loss = keras.losses.BinaryCrossentropy(from_logits=False)

    def loss_fn(x, y):
        return loss(y, model(x))

    return Built(loss_fn, lambda b: (normal([b, 5], 6), bits(b, 4, 6)),
                 [L("dense", kb(model.layers[0])), L("dense", kb(model.layers[1]))],
                 "bernoulli", scale=1 / 4, track=model)


def keras_mse():
    """Regression (K=3); Keras MeanSquaredError: scale 1/3."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
                              keras.layers.Dense(3)])
    loss = keras.losses.MeanSquaredError()

    def loss_fn(x, y):
        return loss(y, model(x))

    return Built(loss_fn, lambda b: (normal([b, 4], 7), normal([b, 3], 8)),
                 [L("dense", kb(model.layers[0])), L("dense", kb(model.layers[1]))],
                 "normal", scale=1 / 3, track=model)


# --- raw tf.Variable code ---------------------------------------------------

def raw_mlp_sum_over_batch():
    """tf.Variable + tf.matmul; sparse CE summed then divided by the batch."""
    w1, b1 = var([4, 5], "w1", 1), tf.Variable(tf.zeros([5]), name="b1")
    w2, b2 = var([5, 3], "w2", 2), tf.Variable(tf.zeros([3]), name="b2")

    def loss_fn(x, y):
        h = tf.nn.relu(tf.matmul(x, w1) + b1)
        return tf.reduce_sum(sparse_ce(y, tf.matmul(h, w2) + b2)) / x.shape[0]

    return Built(loss_fn, xy_sparse(4, 3, seed=9), [L("dense", [w1, b1]), L("dense", [w2, b2])],
                 "categorical", track=[w1, b1, w2, b2])


def raw_square_sum():
    """tf.reduce_sum(tf.square(y - f(x))): normal, sum."""
    w1, b1 = var([3, 5], "w1", 3), tf.Variable(tf.zeros([5]), name="b1")
    w2 = var([5, 2], "w2", 4)

    def loss_fn(x, y):
        return tf.reduce_sum(tf.square(y - tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2)))

    return Built(loss_fn, lambda b: (normal([b, 3], 10), normal([b, 2], 11)),
                 [L("dense", [w1, b1]), L("dense", [w2])], "normal", "sum", track=[w1, b1, w2])


def raw_log_softmax_onehot():
    """-sum(y * log_softmax(z)) by hand, one-hot targets, mean."""
    w, b = var([4, 3], "w", 5), tf.Variable(tf.zeros([3]), name="b")

    def loss_fn(x, y):
        logp = tf.nn.log_softmax(tf.matmul(x, w) + b)
        return tf.reduce_mean(-tf.reduce_sum(y * logp, axis=-1))

    return Built(loss_fn, lambda b_: (normal([b_, 4], 12), one_hot(b_, 3, 12)),
                 [L("dense", [w, b])], "categorical", track=[w, b])


def raw_sigmoid_xent_sum():
    """tf.nn.sigmoid_cross_entropy_with_logits, summed: bernoulli, sum."""
    w, b = var([4, 3], "w", 6), tf.Variable(tf.zeros([3]), name="b")

    def loss_fn(x, y):
        return tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(y, tf.matmul(x, w) + b))

    return Built(loss_fn, lambda b_: (normal([b_, 4], 13), bits(b_, 3, 13)),
                 [L("dense", [w, b])], "bernoulli", "sum", track=[w, b])


def raw_sigmoid_xent_mean_all():
    """tf.reduce_mean over batch and the K=3 outputs: bernoulli, mean, 1/3."""
    w = var([4, 3], "w", 7)

    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(y, tf.matmul(x, w)))

    return Built(loss_fn, lambda b_: (normal([b_, 4], 14), bits(b_, 3, 14)),
                 [L("dense", [w])], "bernoulli", scale=1 / 3, track=[w])


def nested_tf_functions():
    """Layers inside inner tf.functions (raw and Keras), called from an outer
    tf.function that auto_register receives as is."""
    w, b = var([4, 5], "w", 8), tf.Variable(tf.zeros([5]), name="b")
    head = keras.layers.Dense(3)
    head.build((None, 5))

    @tf.function
    def hidden(x):
        return tf.nn.relu(tf.matmul(x, w) + b)

    @tf.function
    def logits(h):
        return head(h)

    @tf.function
    def loss_fn(x, y):
        return tf.reduce_mean(sparse_ce(y, logits(hidden(x))))

    return Built(loss_fn, xy_sparse(4, 3, seed=15), [L("dense", [w, b]), L("dense", kb(head))],
                 "categorical", track=[w, b, head])


def mixed_float16():
    """Layers under the "mixed_float16" policy (float32 variables, float16
    compute); the logits are cast back to float32 for the loss."""
    old = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="relu"),
                                  keras.layers.Dense(3)])
    finally:
        keras.mixed_precision.set_global_policy(old)
    assert model.layers[0].compute_dtype == "float16"

    def loss_fn(x, y):
        return tf.reduce_mean(sparse_ce(y, tf.cast(model(x), tf.float32)))

    return Built(loss_fn, xy_sparse(4, 3, seed=16),
                 [L("dense", kb(model.layers[0])), L("dense", kb(model.layers[1]))],
                 "categorical", track=model)


def dense_sequence():
    """Dense on a [B, T=3, 4] input; per-position CE averaged over B and T:
    mean, scale 1/3."""
    model = keras.Sequential([keras.Input((3, 4)), keras.layers.Dense(5, activation="relu"),
                              keras.layers.Dense(2)])

    def loss_fn(x, y):
        return tf.reduce_mean(sparse_ce(y, model(x)))

    return Built(loss_fn, lambda b: (normal([b, 3, 4], 17), labels(b, 2, 17, shape=(3,))),
                 [L("dense", kb(model.layers[0])), L("dense", kb(model.layers[1]))],
                 "categorical", scale=1 / 3, track=model,
                 output_is_last_layer=False, targets_arg=None)  # tf.nn flattens [B, T]


def einsum_dense():
    """keras.layers.EinsumDense with a bias."""
    model = keras.Sequential([keras.Input((4,)),
                              keras.layers.EinsumDense("ab,bc->ac", output_shape=5, bias_axes="c"),
                              keras.layers.Dense(3)])
    e, d = model.layers

    def loss_fn(x, y):
        return tf.reduce_mean(sparse_ce(y, model(tf.nn.relu(x))))

    return Built(loss_fn, xy_sparse(4, 3, seed=18), [L("dense", [e.kernel, e.bias]), L("dense", kb(d))],
                 "categorical", track=model)


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
    """The usual way to write it: h_0 = zeros, then T=3 steps. The recurrent
    weights are a dense layer used T times (or T-1, if the use on the
    constant zero state is dropped), not a generic one."""
    wx, b = var([2, 4], "wx", 16), tf.Variable(tf.zeros([4]), name="b")
    wh = var([4, 4], "wh", 17)
    head = var([4, 3], "head", 18)

    def loss_fn(x, y):
        h = tf.zeros([x.shape[0], 4])
        for t in range(steps):
            h = tf.tanh(tf.matmul(x[:, t], wx) + b + tf.matmul(h, wh))
        return tf.reduce_mean(sparse_ce(y, tf.matmul(h, head)))

    return Built(loss_fn, xy_sparse(None, 3, seed=35, x_shape=(steps, 2)),
                 [L("dense", [wx, b], uses=steps), L("dense", [wh], uses=(steps, steps - 1)),
                  L("dense", [head])], "categorical", track=[wx, b, wh, head])


# --- what no pattern matches --------------------------------------------------------

def generic_prelu():
    """keras PReLU's alpha matches no pattern: a generic layer, between the
    dense layers; its weights are applied once."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5), keras.layers.PReLU(),
                              keras.layers.Dense(3)])
    d1, prelu, d2 = model.layers

    def loss_fn(x, y):
        return tf.reduce_mean(sparse_ce(y, model(x)))

    return Built(loss_fn, xy_sparse(4, 3, seed=32),
                 [L("dense", kb(d1)), L("generic", [prelu.alpha]), L("dense", kb(d2))],
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


CASES: Sequence[ZooCase] = (
    ZooCase("seq_mlp", seq_mlp, fast_saved=True),
    ZooCase("functional_residual_sum", functional_residual_sum),
    ZooCase("subclassed_layernorm_scce_logits", subclassed_layernorm_scce_logits, fast_saved=True),
    ZooCase("seq_softmax_scce_probs", seq_softmax_scce_probs),
    ZooCase("functional_cce_onehot", functional_cce_onehot),
    ZooCase("keras_bce_logits", keras_bce_logits),
    ZooCase("keras_bce_probs", keras_bce_probs),
    ZooCase("keras_mse", keras_mse),
    ZooCase("raw_mlp_sum_over_batch", raw_mlp_sum_over_batch, fast_saved=True),
    ZooCase("raw_square_sum", raw_square_sum),
    ZooCase("raw_log_softmax_onehot", raw_log_softmax_onehot),
    ZooCase("raw_sigmoid_xent_sum", raw_sigmoid_xent_sum),
    ZooCase("raw_sigmoid_xent_mean_all", raw_sigmoid_xent_mean_all),
    ZooCase("nested_tf_functions", nested_tf_functions),
    ZooCase("mixed_float16", mixed_float16),
    ZooCase("dense_sequence", dense_sequence),
    ZooCase("einsum_dense", einsum_dense),
    ZooCase("conv_same_valid", conv_same_valid, fast_saved=True),
    ZooCase("conv_stride2", conv_stride2),
    ZooCase("conv_dilation", conv_dilation),
    ZooCase("conv1d", conv1d),
    ZooCase("depthwise", depthwise),
    ZooCase("separable", separable),
    ZooCase("batchnorm_training", batchnorm_training),
    ZooCase("batchnorm_inference", batchnorm_inference),
    ZooCase("embedding", embedding),
    ZooCase("tied_transpose_b", tied_transpose_b),
    ZooCase("tied_tf_transpose", tied_tf_transpose),
    ZooCase("layer_called_twice", layer_called_twice),
    ZooCase("rnn_unrolled", rnn_unrolled),
    ZooCase("rnn_zero_state", rnn_zero_state),
    ZooCase("generic_prelu", generic_prelu),
    ZooCase("generic_sin", generic_sin),
    ZooCase("weight_penalty", weight_penalty),
)
