"""Property tests: random Keras MLP and CNN stacks whose registration is known
by construction (one layer per Keras layer with weights, in model order; a
SeparableConv2D gives two), with a random loss whose kind, reduction and
scale are known."""
import math

import keras
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import kfac_graph as kg
import zoo

SETTINGS = settings(max_examples=15, deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate],  # no shrinking: bounded time
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
CLASSES = 3

# (name, loss_fn(y_int, logits) -> scalar, kind, reduction, scale)
LOSSES = {
    "sparse_mean": (lambda y, z: tf.reduce_mean(zoo.sparse_ce(y, z)), "categorical", "mean", 1.0),
    "sparse_sum": (lambda y, z: tf.reduce_sum(zoo.sparse_ce(y, z)), "categorical", "sum", 1.0),
    "keras_scce": (lambda y, z: keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, z),
                   "categorical", "mean", 1.0),
    "sigmoid_sum": (lambda y, z: tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(
        tf.one_hot(y, CLASSES), z)), "bernoulli", "sum", 1.0),
    "keras_mse": (lambda y, z: keras.losses.MeanSquaredError()(tf.one_hot(y, CLASSES), z),
                  "normal", "mean", 1.0 / CLASSES),
    "square_sum": (lambda y, z: tf.reduce_sum(tf.square(tf.one_hot(y, CLASSES) - z)),
                   "normal", "sum", 1.0),
}

dense_block = st.fixed_dictionaries({
    "width": st.integers(3, 8), "bias": st.booleans(),
    "norm": st.sampled_from([None, None, "batch", "layer"]),
    "activation": st.sampled_from(["relu", "tanh", None])})

conv_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("conv"), "filters": st.integers(2, 5),
                           "kernel": st.integers(1, 3), "stride": st.integers(1, 2),
                           "padding": st.sampled_from(["same", "valid"]), "bias": st.booleans()}),
    st.fixed_dictionaries({"type": st.just("depthwise"), "multiplier": st.integers(1, 2),
                           "kernel": st.integers(1, 3), "stride": st.integers(1, 2),
                           "padding": st.sampled_from(["same", "valid"]), "bias": st.booleans()}),
    st.fixed_dictionaries({"type": st.just("separable"), "filters": st.integers(2, 4),
                           "kernel": st.integers(1, 3), "padding": st.sampled_from(["same", "valid"]),
                           "bias": st.booleans()}),
    st.fixed_dictionaries({"type": st.just("batch_norm"), "scale": st.booleans()}),
)


def _weights(layer, kind, names):
    """The expected layer; its variables are read once the model is built."""
    return zoo.L(kind, lambda: [getattr(layer, n) for n in names
                                if getattr(layer, n, None) is not None])


def check(loss_fn, args, expected, loss_name):
    reg = kg.auto_register(loss_fn).registration(*args)
    got = [(layer.kind, [zoo.variable_name(v) for v in layer.variables], layer.uses)
           for layer in reg.layers]
    want = [(e.kind, [zoo.variable_name(v) for v in e.resolved()], e.uses) for e in expected]
    assert got == want
    for layer, e in zip(reg.layers, expected):
        assert all(zoo.same_variable(a, b) for a, b in zip(layer.variables, e.resolved()))
    _, kind, reduction, scale = LOSSES[loss_name]
    assert (reg.loss.kind, reg.loss.reduction) == (kind, reduction)
    assert math.isclose(reg.loss.scale, scale, rel_tol=1e-5)


@SETTINGS
@given(blocks=st.lists(dense_block, min_size=1, max_size=4), head_bias=st.booleans(),
       training=st.booleans(), loss_name=st.sampled_from(sorted(LOSSES)),
       in_dim=st.integers(2, 6), batch=st.integers(2, 5))
def test_random_mlp(blocks, head_bias, training, loss_name, in_dim, batch):
    layers, expected = [keras.Input((in_dim,))], []
    for block in blocks:
        dense = keras.layers.Dense(block["width"], use_bias=block["bias"])
        layers.append(dense)
        expected.append(_weights(dense, "dense", ["kernel", "bias"]))
        if block["norm"] == "batch":
            norm = keras.layers.BatchNormalization()
        elif block["norm"] == "layer":
            norm = keras.layers.LayerNormalization()
        else:
            norm = None
        if norm is not None:
            layers.append(norm)
            expected.append(_weights(norm, "scale_and_shift", ["gamma", "beta"]))
        if block["activation"]:
            layers.append(keras.layers.Activation(block["activation"]))
    head = keras.layers.Dense(CLASSES, use_bias=head_bias)
    model = keras.Sequential(layers + [head])
    expected.append(_weights(head, "dense", ["kernel", "bias"]))
    loss = LOSSES[loss_name][0]

    def loss_fn(x, y):
        return loss(y, model(x, training=training))

    args = (zoo.normal([batch, in_dim], 1), zoo.labels(batch, CLASSES, 2))
    check(loss_fn, args, expected, loss_name)


def _out_size(size, kernel, stride, padding):
    return -(-size // stride) if padding == "same" else -(-(size - kernel + 1) // stride)


@SETTINGS
@given(blocks=st.lists(conv_block, min_size=1, max_size=4), training=st.booleans(),
       loss_name=st.sampled_from(sorted(LOSSES)), size=st.integers(4, 8),
       channels=st.integers(1, 3), batch=st.integers(2, 4))
def test_random_cnn(blocks, training, loss_name, size, channels, batch):
    layers, expected = [keras.Input((size, size, channels))], []
    for block in blocks:
        kind = block["type"]
        if kind == "batch_norm":
            norm = keras.layers.BatchNormalization(scale=block["scale"])
            layers.append(norm)
            expected.append(_weights(norm, "scale_and_shift", ["gamma", "beta"]))
            continue
        padding = block["padding"] if block["kernel"] <= size else "same"
        stride = block.get("stride", 1)
        if kind == "conv":
            layer = keras.layers.Conv2D(block["filters"], block["kernel"], strides=stride,
                                        padding=padding, use_bias=block["bias"], activation="relu")
            expected.append(_weights(layer, "conv2d", ["kernel", "bias"]))
        elif kind == "depthwise":
            layer = keras.layers.DepthwiseConv2D(block["kernel"], strides=stride, padding=padding,
                                                 depth_multiplier=block["multiplier"],
                                                 use_bias=block["bias"], activation="relu")
            expected.append(_weights(layer, "depthwise_conv2d", ["kernel", "bias"]))
        else:
            layer = keras.layers.SeparableConv2D(block["filters"], block["kernel"], padding=padding,
                                                 use_bias=block["bias"], activation="relu")
            expected.append(_weights(layer, "depthwise_conv2d", ["depthwise_kernel"]))
            expected.append(_weights(layer, "conv2d", ["pointwise_kernel", "bias"]))
        layers.append(layer)
        size = _out_size(size, block["kernel"], stride, padding)
    head = keras.layers.Dense(CLASSES)
    model = keras.Sequential(layers + [keras.layers.GlobalAveragePooling2D(), head])
    expected.append(_weights(head, "dense", ["kernel", "bias"]))
    loss = LOSSES[loss_name][0]

    def loss_fn(x, y):
        return loss(y, model(x, training=training))

    args = (zoo.normal([batch, *model.input_shape[1:]], 3), zoo.labels(batch, CLASSES, 4))
    check(loss_fn, args, expected, loss_name)


@pytest.mark.parametrize("size,kernel,stride,padding,want",
                         [(8, 3, 1, "same", 8), (8, 3, 2, "same", 4), (7, 3, 2, "valid", 3),
                          (4, 1, 2, "valid", 2)])
def test_out_size(size, kernel, stride, padding, want):
    assert _out_size(size, kernel, stride, padding) == want
