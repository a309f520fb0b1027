"""Property test: random float64 Keras models built from every layer the pass
supports, each checked end to end:

1. nothing is registered ``generic`` (and every trainable variable is
   registered);
2. ``kg.verify`` passes (per-example gradients against the batch gradient,
   one-example gradients and the norms);
3. two ``kg.KFAC`` steps give finite losses and skip nothing.

The fronts: a vector (Dense), an image (Conv2D, DepthwiseConv2D,
SeparableConv2D, BatchNormalization, LayerNormalization; pooled or
flattened), a sequence (Conv1D with same / valid / causal padding) and
integer tokens (Embedding, optionally Conv1D after it). Then dense blocks
(relu / tanh / swish, with or without bias), optionally a Dense instance
applied on two branches whose outputs are added (shared weights: one layer,
``uses == 2``), and a head; the loss is the mean or the sum of sparse softmax
cross-entropy or a summed squared error. Batch normalisation runs with
``training=False`` so that the examples do not couple."""
import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import kfac_graph as kg

_COMMON = dict(deadline=None, derandomize=True, database=None,
               phases=[Phase.explicit, Phase.generate],  # no shrinking: bounded time
               suppress_health_check=[HealthCheck.function_scoped_fixture,
                                      HealthCheck.too_slow])
FAST = settings(max_examples=2, **_COMMON)   # per front: 8 models
SLOW = settings(max_examples=10, **_COMMON)  # per front: 40 models

F64 = "float64"
CLASSES = 3
ACTIVATIONS = ["relu", "tanh", "swish", None]


def _ce(y, z):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(y, z)


LOSSES = {
    "ce_mean": lambda y, z: tf.reduce_mean(_ce(y, z)),
    "ce_sum": lambda y, z: tf.reduce_sum(_ce(y, z)),
    "square_sum": lambda y, z: tf.reduce_sum(
        tf.square(tf.one_hot(y, CLASSES, dtype=z.dtype) - z)),
}


# --- the drawn architectures -------------------------------------------------------


def _out(size, kernel, stride, padding):
    if padding in ("same", "causal"):
        return -(-size // stride)
    return -(-(size - kernel + 1) // stride)


@st.composite
def image_block(draw, size):
    kind = draw(st.sampled_from(["conv", "depthwise", "separable", "batch_norm",
                                 "layer_norm"]))
    if kind == "batch_norm":
        center, scale = draw(st.sampled_from([(True, True), (True, False), (False, True),
                                              (False, False)]))
        return {"type": kind, "center": center, "scale": scale}, size
    if kind == "layer_norm":
        return {"type": kind, "center": draw(st.booleans()), "scale": draw(st.booleans())}, size
    kernel, stride = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    padding = draw(st.sampled_from(["same", "valid"]))
    if kernel > size:
        padding = "same"
    block = {"type": kind, "kernel": kernel, "stride": stride, "padding": padding,
             "bias": draw(st.booleans()), "activation": draw(st.sampled_from(ACTIVATIONS))}
    if kind == "depthwise":
        block["multiplier"] = draw(st.integers(1, 2))
    else:
        block["filters"] = draw(st.integers(1, 3))
    return block, _out(size, kernel, stride, padding)


@st.composite
def sequence_block(draw, length):
    kernel, stride = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    padding = draw(st.sampled_from(["same", "valid", "causal"]))
    if kernel > length:
        padding = "same"
    block = {"type": "conv1d", "kernel": kernel, "stride": stride, "padding": padding,
             "filters": draw(st.integers(1, 3)), "bias": draw(st.booleans()),
             "activation": draw(st.sampled_from(ACTIVATIONS))}
    return block, _out(length, kernel, stride, padding)


dense_block = st.fixed_dictionaries({
    "width": st.integers(2, 5), "bias": st.booleans(),
    "activation": st.sampled_from(ACTIVATIONS)})


FRONTS = ["vector", "image", "sequence", "tokens"]


@st.composite
def architectures(draw, front):
    arch = {"front": front, "batch": draw(st.integers(3, 4)),
            "loss": draw(st.sampled_from(sorted(LOSSES))), "seed": draw(st.integers(0, 999)),
            "blocks": []}
    if front == "vector":
        arch["in_dim"] = draw(st.integers(2, 5))
    elif front == "image":
        size = draw(st.integers(3, 6))
        arch["size"], arch["channels"] = size, draw(st.integers(1, 3))
        for _ in range(draw(st.integers(1, 3))):
            block, size = draw(image_block(size))
            arch["blocks"].append(block)
        arch["pool"] = draw(st.sampled_from(["average", "max", "flatten"]))
    else:
        length = draw(st.integers(3, 6))
        arch["length"] = length
        if front == "tokens":
            arch["vocab"], arch["dim"] = draw(st.integers(2, 6)), draw(st.integers(1, 3))
        else:
            arch["channels"] = draw(st.integers(1, 3))
        for _ in range(draw(st.integers(1 if front == "sequence" else 0, 2))):
            block, length = draw(sequence_block(length))
            arch["blocks"].append(block)
        arch["pool"] = draw(st.sampled_from(["average", "max", "flatten"]))
    arch["dense"] = draw(st.lists(dense_block, min_size=0, max_size=2))
    arch["shared"] = draw(st.booleans())
    arch["shared_width"] = draw(st.integers(2, 4))
    arch["head_bias"] = draw(st.booleans())
    return arch


def _layer(block):
    L = keras.layers
    kind = block["type"]
    if kind == "batch_norm":
        return L.BatchNormalization(center=block["center"], scale=block["scale"], dtype=F64)
    if kind == "layer_norm":
        return L.LayerNormalization(center=block["center"], scale=block["scale"], dtype=F64)
    common = {"strides": block["stride"], "padding": block["padding"], "use_bias": block["bias"],
              "activation": block["activation"], "dtype": F64}
    if kind == "conv":
        return L.Conv2D(block["filters"], block["kernel"], **common)
    if kind == "conv1d":
        return L.Conv1D(block["filters"], block["kernel"], **common)
    if kind == "separable":
        return L.SeparableConv2D(block["filters"], block["kernel"], **common)
    return L.DepthwiseConv2D(block["kernel"], depth_multiplier=block["multiplier"], **common)


def build(arch):
    """The model, its loss function and its arguments ``(x, y)``."""
    keras.utils.set_random_seed(arch["seed"])
    L = keras.layers
    batch, seed = arch["batch"], [arch["seed"], 1]
    if arch["front"] == "vector":
        inputs = keras.Input((arch["in_dim"],), dtype=F64)
        x = tf.random.stateless_normal([batch, arch["in_dim"]], seed, dtype=tf.float64)
        h = inputs
    elif arch["front"] == "tokens":
        inputs = keras.Input((arch["length"],), dtype="int32")
        x = tf.random.stateless_uniform([batch, arch["length"]], seed, maxval=arch["vocab"],
                                        dtype=tf.int32)
        h = L.Embedding(arch["vocab"], arch["dim"], dtype=F64)(inputs)
    else:
        shape = ((arch["size"], arch["size"]) if arch["front"] == "image"
                 else (arch["length"],)) + (arch["channels"],)
        inputs = keras.Input(shape, dtype=F64)
        x = tf.random.stateless_normal([batch, *shape], seed, dtype=tf.float64)
        h = inputs
    for block in arch["blocks"]:
        h = _layer(block)(h)
    if arch["front"] != "vector":
        two_d = arch["front"] == "image"
        pool = {"average": L.GlobalAveragePooling2D if two_d else L.GlobalAveragePooling1D,
                "max": L.GlobalMaxPooling2D if two_d else L.GlobalMaxPooling1D,
                "flatten": L.Flatten}[arch["pool"]]
        h = pool(dtype=F64)(h)
    for block in arch["dense"]:
        h = L.Dense(block["width"], use_bias=block["bias"], activation=block["activation"],
                    dtype=F64)(h)
    if arch["shared"]:
        width = arch["shared_width"]
        left = L.Dense(width, activation="tanh", dtype=F64)(h)
        right = L.Dense(width, activation="relu", dtype=F64)(h)
        shared = L.Dense(width, activation="tanh", dtype=F64, name="shared")
        h = L.Add(dtype=F64)([shared(left), shared(right)])
    outputs = L.Dense(CLASSES, use_bias=arch["head_bias"], dtype=F64)(h)
    model = keras.Model(inputs, outputs)
    y = tf.random.stateless_uniform([batch], [arch["seed"], 2], maxval=CLASSES, dtype=tf.int32)
    loss = LOSSES[arch["loss"]]

    @kg.auto_register
    def loss_fn(x, y):
        return loss(y, model(x, training=False))

    return model, loss_fn, (x, y)


# --- the check ------------------------------------------------------------------------


def check_model(model, loss_fn, args):
    # 1. every trainable variable registered, none generic
    reg = loss_fn.registration(*args)
    generic = [layer.name for layer in reg.layers if layer.kind == "generic"]
    assert generic == [], reg.summary()
    assert len(reg.variables) == len(model.trainable_variables), reg.summary()
    if any(layer.name == "shared" for layer in model.layers):
        assert max(layer.uses for layer in reg.layers) == 2, reg.summary()
    # 2. per-example gradients, one-example gradients and norms
    report = kg.verify(loss_fn, *args, examples=2)
    assert report.passed, report.table()
    # 3. two K-FAC steps, finite, none skipped
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(2)]
    assert np.all(np.isfinite(losses)), losses
    assert int(opt.skipped_steps.numpy()) == 0, losses


# the image and token fronts in the fast set (every conv kind, Conv1D, embeddings);
# all four under -m slow
@pytest.mark.parametrize("front", [pytest.param(f, marks=pytest.mark.slow)
                                   if f in ("vector", "sequence") else f for f in FRONTS])
def test_random_model(front):
    @FAST
    @given(arch=architectures(front))
    def run(arch):
        check_model(*build(arch))

    run()


@pytest.mark.slow
@pytest.mark.parametrize("front", FRONTS)
def test_random_model_many(front):
    @SLOW
    @given(arch=architectures(front))
    def run(arch):
        check_model(*build(arch))

    run()


def test_batch_norm_scale_without_center_inference():
    """Found by the property test: gamma of BatchNormalization(center=False)
    in inference (x * m + (-mean) * m, m = rsqrt * gamma) was generic."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,), dtype=F64)
    h = keras.layers.BatchNormalization(center=False, dtype=F64)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES, dtype=F64)(h))

    @kg.auto_register
    def loss_fn(x, y):
        return LOSSES["ce_mean"](y, model(x, training=False))

    x = tf.random.stateless_normal([3, 4], [0, 1], dtype=tf.float64)
    check_model(model, loss_fn, (x, tf.constant([0, 1, 2])))
