"""The registration zoo: small models whose registration is written by hand.

Each ``ZooCase`` has a ``build()`` that makes a fresh model and returns a
``Built``: the plain (unwrapped) loss function, a way to make example
arguments for any batch size, the objects to track when saving it, and the
EXPECTED registration, layer by layer (kind, variables in order, uses), and
the loss (kind, reduction, scale). Expected variables are the model's own
objects (``keras.Variable`` or ``tf.Variable``), or a callable giving them;
compare them with ``same_variable``.

The layer cases' builders are in tests/zoo_layers.py.

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
from zoo_layers import (
    batchnorm_inference, batchnorm_training, conv1d, conv_dilation, conv_same_valid, conv_stride2,
    depthwise, embedding, prelu_alpha, generic_sin, layer_called_twice, rnn_unrolled,
    rnn_zero_state, separable, tied_tf_transpose, tied_transpose_b, weight_penalty)


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
    ZooCase("prelu_alpha", prelu_alpha),
    ZooCase("generic_sin", generic_sin),
    ZooCase("weight_penalty", weight_penalty),
)
