"""Property tests: per-example gradients and norms of random float64
architectures equal a loop of one-example ``tf.GradientTape`` gradients.

Two generators: random Keras stacks (Dense, Conv2D, DepthwiseConv2D,
LayerNormalization, an Embedding front for integer inputs) with every layer
in float64, and random stacks of raw TensorFlow ops on float64
``tf.Variable``s (matmul either way round, conv2d and depthwise_conv2d with
SAME / VALID / explicit padding, a variable scale and shift)."""
import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import kfac_graph as kg

SETTINGS = settings(max_examples=8, deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate],  # no shrinking: bounded time
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
CLASSES = 3
RTOL = 1e-6
F64 = "float64"

ACTIVATIONS = ["relu", "tanh", "sigmoid", "gelu", None]


def _ce(y, z):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(y, z)


def _square(y, z):
    return tf.reduce_sum(tf.square(tf.one_hot(y, CLASSES, dtype=z.dtype) - z), axis=-1)


LOSSES = {
    "ce_mean": lambda y, z: tf.reduce_mean(_ce(y, z)),
    "ce_sum": lambda y, z: tf.reduce_sum(_ce(y, z)),
    "square_sum": lambda y, z: tf.reduce_sum(_square(y, z)),
    # a Keras loss computes in float32 unless told otherwise
    "keras_mse_mean": lambda y, z: keras.losses.MeanSquaredError(dtype=F64)(
        tf.one_hot(y, CLASSES, dtype=z.dtype), z),
}


# --- shared check ------------------------------------------------------------------


def one_example_loop(loss_fn, args, variables):
    """``[batch, *shape]`` per variable: the gradient of each example alone."""
    batch = int(args[0].shape[0])
    out = []
    for i in range(batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(*[a[i:i + 1] for a in args])
        out.append([tf.convert_to_tensor(g) for g in tape.gradient(loss, list(variables))])
    return [tf.stack(parts) for parts in zip(*out)]


def check_against_loop(loss_fn, args):
    fn = kg.auto_register(loss_fn)
    reg = fn.registration(*args)
    got = kg.per_example_gradients(fn, *args)
    want = one_example_loop(loss_fn, args, reg.variables)
    assert len(got) == len(want) == len(reg.variables)
    batch = int(args[0].shape[0])
    for g, w, v in zip(got, want, reg.variables):
        assert g.dtype == tf.float64, v.name
        assert tuple(g.shape) == (batch, *v.shape), v.name
        scale = float(tf.reduce_max(tf.abs(w))) + 1e-30
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * 1e-3 * scale, err_msg=v.name)
    norms = kg.per_example_gradient_norms(fn, *args)
    want_norms = np.sqrt(sum(np.sum(np.reshape(w, (batch, -1)) ** 2, axis=1) for w in want))
    assert tuple(norms.shape) == (batch,)
    np.testing.assert_allclose(norms, want_norms, rtol=RTOL, atol=1e-12)
    return reg


# --- random Keras stacks ---------------------------------------------------------------


def _out_size(size, eff_kernel, stride, padding):
    if padding == "same":
        return -(-size // stride)
    return -(-(size - eff_kernel + 1) // stride)


@st.composite
def spatial_block(draw, size):
    """A conv / depthwise / layer-norm block that fits a ``size`` x ``size`` map,
    and the map size after it."""
    kind = draw(st.sampled_from(["conv", "depthwise", "layer_norm"]))
    if kind == "layer_norm":
        center, scale = draw(st.sampled_from([(True, True), (True, False), (False, True)]))
        return {"type": kind, "center": center, "scale": scale}, size
    kernel = draw(st.integers(1, 3))
    dilation = draw(st.integers(1, 2)) if kernel > 1 else 1
    stride = 1 if dilation > 1 else draw(st.integers(1, 2))  # Keras: not both > 1
    padding = draw(st.sampled_from(["same", "valid"]))
    eff = dilation * (kernel - 1) + 1
    if eff > size:
        padding = "same"
    block = {"type": kind, "kernel": kernel, "stride": stride, "dilation": dilation,
             "padding": padding, "bias": draw(st.booleans()),
             "activation": draw(st.sampled_from(ACTIVATIONS))}
    if kind == "conv":
        block["filters"] = draw(st.integers(1, 4))
    else:
        block["multiplier"] = draw(st.integers(1, 2))
    return block, _out_size(size, eff, stride, padding)


dense_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("dense"), "width": st.integers(2, 5),
                           "bias": st.booleans(), "activation": st.sampled_from(ACTIVATIONS)}),
    st.fixed_dictionaries({"type": st.just("layer_norm"),
                           "center": st.booleans(), "scale": st.just(True)}),
)


@st.composite
def keras_architectures(draw):
    front = draw(st.sampled_from(["vector", "image", "tokens"]))
    arch = {"front": front, "batch": draw(st.integers(1, 4)),
            "loss": draw(st.sampled_from(sorted(LOSSES))), "seed": draw(st.integers(0, 999))}
    if front == "vector":
        arch["in_dim"] = draw(st.integers(1, 5))
    elif front == "image":
        size = draw(st.integers(3, 6))
        arch["size"], arch["channels"] = size, draw(st.integers(1, 3))
        blocks = []
        for _ in range(draw(st.integers(1, 3))):
            block, size = draw(spatial_block(size))
            blocks.append(block)
        arch["spatial"] = blocks
        arch["pool"] = draw(st.sampled_from(["average", "flatten"]))
    else:
        arch["vocab"], arch["length"] = draw(st.integers(2, 6)), draw(st.integers(1, 4))
        arch["dim"] = draw(st.integers(1, 4))
        # Dense applied along the sequence (unit batch or sequence axes too)
        arch["sequence_dense"] = draw(st.booleans())
    arch["dense"] = draw(st.lists(dense_block, min_size=0, max_size=2))
    arch["head_bias"] = draw(st.booleans())
    return arch


def _keras_layer(block):
    L = keras.layers
    if block["type"] == "layer_norm":
        return L.LayerNormalization(center=block["center"], scale=block["scale"], dtype=F64)
    if block["type"] == "dense":
        return L.Dense(block["width"], use_bias=block["bias"], activation=block["activation"],
                       dtype=F64)
    common = {"strides": block["stride"], "padding": block["padding"], "use_bias": block["bias"],
              "dilation_rate": block["dilation"], "activation": block["activation"], "dtype": F64}
    if block["type"] == "conv":
        return L.Conv2D(block["filters"], block["kernel"], **common)
    return L.DepthwiseConv2D(block["kernel"], depth_multiplier=block["multiplier"], **common)


def build_keras(arch):
    keras.utils.set_random_seed(arch["seed"])
    L = keras.layers
    batch, seed = arch["batch"], [arch["seed"], 1]
    if arch["front"] == "vector":
        layers = [keras.Input((arch["in_dim"],), dtype=F64)]
        x = tf.random.stateless_normal([batch, arch["in_dim"]], seed, dtype=tf.float64)
    elif arch["front"] == "image":
        shape = (arch["size"], arch["size"], arch["channels"])
        layers = [keras.Input(shape, dtype=F64)]
        layers += [_keras_layer(b) for b in arch["spatial"]]
        layers.append(L.GlobalAveragePooling2D(dtype=F64) if arch["pool"] == "average"
                      else L.Flatten(dtype=F64))
        x = tf.random.stateless_normal([batch, *shape], seed, dtype=tf.float64)
    else:
        layers = [keras.Input((arch["length"],), dtype="int32"),
                  L.Embedding(arch["vocab"], arch["dim"], dtype=F64)]
        if arch["sequence_dense"]:
            layers.append(L.Dense(3, activation="tanh", dtype=F64))
        layers.append(L.GlobalAveragePooling1D(dtype=F64))
        x = tf.random.stateless_uniform([batch, arch["length"]], seed, maxval=arch["vocab"],
                                        dtype=tf.int32)
    layers += [_keras_layer(b) for b in arch["dense"]]
    layers.append(L.Dense(CLASSES, use_bias=arch["head_bias"], dtype=F64))
    model = keras.Sequential(layers)
    y = tf.random.stateless_uniform([batch], [arch["seed"], 2], maxval=CLASSES, dtype=tf.int32)
    loss = LOSSES[arch["loss"]]

    def loss_fn(x, y):
        return loss(y, model(x, training=True))

    return model, loss_fn, (x, y)


@SETTINGS
@given(arch=keras_architectures())
def test_random_keras_float64(arch):
    model, loss_fn, args = build_keras(arch)
    reg = check_against_loop(loss_fn, args)
    # every trainable weight is covered, none as a generic fallback
    assert len(reg.variables) == len(model.trainable_variables)
    assert all(layer.kind != "generic" for layer in reg.layers), reg.summary()


@pytest.mark.parametrize("batch,length", [(3, 1), (1, 3)])
def test_dense_on_sequence_with_a_unit_axis(batch, length):
    dense = keras.layers.Dense(3, dtype=F64)

    def loss_fn(x):
        return tf.reduce_sum(tf.square(dense(x)))

    x = tf.random.stateless_normal([batch, length, 4], [0, 5], dtype=tf.float64)
    check_against_loop(loss_fn, (x,))


# --- random raw-op stacks on float64 tf.Variables ------------------------------------


@st.composite
def raw_architectures(draw):
    size = draw(st.integers(3, 6))
    arch = {"batch": draw(st.integers(1, 4)), "size": size, "channels": draw(st.integers(1, 3)),
            "loss": draw(st.sampled_from(["ce_mean", "ce_sum", "square_sum"])),
            "seed": draw(st.integers(0, 999)), "ops": []}
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["conv", "depthwise", "scale_shift"]))
        if kind == "scale_shift":
            arch["ops"].append({"type": kind, "shift": draw(st.booleans())})
            continue
        kernel = draw(st.integers(1, 3))
        dilation = draw(st.integers(1, 2)) if kernel > 1 else 1
        stride = 1 if dilation > 1 else draw(st.integers(1, 2))
        eff = dilation * (kernel - 1) + 1
        padding = draw(st.sampled_from(["SAME", "VALID", "EXPLICIT"]))
        pads = (draw(st.integers(0, 1)), draw(st.integers(0, 1)))  # before, after; both axes
        if padding == "EXPLICIT" and size + sum(pads) < eff:
            padding = "SAME"
        if padding == "VALID" and size < eff:
            padding = "SAME"
        op = {"type": kind, "kernel": kernel, "stride": stride, "dilation": dilation,
              "padding": padding, "pads": pads, "bias": draw(st.booleans()),
              "activation": draw(st.sampled_from(["relu", "tanh", None]))}
        op["out"] = draw(st.integers(1, 3)) if kind == "conv" else draw(st.integers(1, 2))
        if padding == "SAME":
            size = -(-size // stride)
        else:
            padded = size + (sum(pads) if padding == "EXPLICIT" else 0)
            size = -(-(padded - eff + 1) // stride)
        arch["ops"].append(op)
    arch["transpose_head"] = draw(st.booleans())
    arch["head_bias"] = draw(st.booleans())
    return arch


def build_raw(arch):
    rng = np.random.default_rng(arch["seed"])

    def var(shape, name):
        return tf.Variable(rng.normal(size=shape) * 0.5, dtype=tf.float64, name=name)

    steps, channels = [], arch["channels"]
    for i, op in enumerate(arch["ops"]):
        if op["type"] == "scale_shift":
            scale = var([channels], f"scale{i}")
            shift = var([channels], f"shift{i}") if op["shift"] else None
            steps.append((op, [scale, shift]))
            continue
        k = op["kernel"]
        if op["type"] == "conv":
            kernel = var([k, k, channels, op["out"]], f"conv{i}")
            channels = op["out"]
        else:
            kernel = var([k, k, channels, op["out"]], f"depthwise{i}")
            channels *= op["out"]
        bias = var([channels], f"bias{i}") if op["bias"] else None
        steps.append((op, [kernel, bias]))
    head = var([CLASSES, channels] if arch["transpose_head"] else [channels, CLASSES], "head")
    head_bias = var([CLASSES], "head_bias") if arch["head_bias"] else None
    loss = LOSSES[arch["loss"]]

    def padding_arg(op):
        if op["padding"] != "EXPLICIT":
            return op["padding"]
        before, after = op["pads"]
        return [[0, 0], [before, after], [before, after], [0, 0]]

    def loss_fn(x, y):
        h = x
        for op, (a, b) in steps:
            if op["type"] == "scale_shift":
                h = h * a + b if b is not None else h * a
                continue
            s, d = op["stride"], op["dilation"]
            if op["type"] == "conv" and d == 1:
                h = tf.nn.conv2d(h, a, [1, s, s, 1], padding_arg(op))
            elif op["type"] == "conv":  # tf.nn.conv2d's float64 CPU gradient has no dilation
                h = tf.nn.convolution(h, a, padding=padding_arg(op), dilations=d)
            else:
                h = tf.nn.depthwise_conv2d(h, a, [1, s, s, 1], padding_arg(op),
                                           dilations=[d, d])
            if b is not None:
                h = tf.nn.bias_add(h, b)
            if op["activation"] == "relu":
                h = tf.nn.relu(h)
            elif op["activation"] == "tanh":
                h = tf.tanh(h)
        h = tf.reduce_mean(h, axis=[1, 2])
        z = tf.matmul(h, head, transpose_b=arch["transpose_head"])
        if head_bias is not None:
            z = z + head_bias
        return loss(y, z)

    batch = arch["batch"]
    x = tf.random.stateless_normal([batch, arch["size"], arch["size"], arch["channels"]],
                                   [arch["seed"], 3], dtype=tf.float64)
    y = tf.random.stateless_uniform([batch], [arch["seed"], 4], maxval=CLASSES, dtype=tf.int32)
    variables = [v for _, vs in steps for v in vs if v is not None] + \
        [v for v in (head, head_bias) if v is not None]
    return variables, loss_fn, (x, y)


@SETTINGS
@given(arch=raw_architectures())
def test_random_raw_ops_float64(arch):
    variables, loss_fn, args = build_raw(arch)
    reg = check_against_loop(loss_fn, args)
    assert {id(v) for v in reg.variables} == {id(v) for v in variables}
    assert all(layer.kind != "generic" for layer in reg.layers), reg.summary()
