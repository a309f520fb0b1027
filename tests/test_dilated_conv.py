"""Dilated convolutions TensorFlow writes as SpaceToBatchND -> conv (dilation
1) -> BatchToSpaceND (Keras Conv1D, DepthwiseConv2D, SeparableConv2D, ...
with dilation_rate > 1; tf.nn.atrous_conv2d; tf.nn.convolution): registered
as the dilated convolution on the input of SpaceToBatchND, with EXPLICIT
padding read from the paddings and crops constants (passes/atrous.py).

Shown in float64: per-example gradients and norms equal a loop of
one-example gradients (rtol 1e-6), the bias belongs to the conv layer,
kg.verify passes (the exact Fisher's full blocks included), the Kronecker
block of a dilated Conv1D equals KFC's T (A (x) G) built in numpy from the
dilated patches, and kg.KFAC lowers the loss with no skipped step. A form
with no exact dilated convolution falls back to "generic", still right."""
import hypothesis
from hypothesis import strategies as st
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_reference import np_patches
from per_example_reference import assert_close, one_example_loop

F64 = "float64"
B = 4
SETTINGS = hypothesis.settings(max_examples=3, deadline=None, derandomize=True, database=None,
                               suppress_health_check=list(hypothesis.HealthCheck))


def _model(layers, shape, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input(shape, dtype=F64), *layers,
                              keras.layers.Flatten(dtype=F64),
                              keras.layers.Dense(3, dtype=F64)])

    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    x = tf.random.stateless_normal([B, *shape], [1, 2], dtype=tf.float64)
    y = tf.constant(np.arange(B) % 3)
    return model, loss_fn, (x, y)


def _assert_equal_loop(fn, loss_fn, args):
    reg = fn.registration(*args)
    got = kg.per_example_gradients(fn, *args)
    want = one_example_loop(loss_fn, args, reg.variables)
    for g, w, v in zip(got, want, reg.variables):
        assert g.shape == (B, *v.shape), v.name
        assert_close(g.numpy(), w.numpy(), 1e-6, v.name)
    want_norms = np.sqrt(sum(np.sum(np.reshape(w, (B, -1)) ** 2, 1) for w in want))
    assert_close(kg.per_example_gradient_norms(fn, *args).numpy(), want_norms, 1e-6, "norms")


def _assert_trains(fn, args, steps=3):
    opt = kg.KFAC(fn)
    losses = [float(opt.step(*args)) for _ in range(steps)]
    assert all(np.isfinite(losses)) and int(opt.skipped_steps) == 0, losses
    assert losses[-1] < losses[0], losses


def _conv1d(filters, k, d, padding, bias=True, activation="tanh"):
    return keras.layers.Conv1D(filters, k, dilation_rate=d, padding=padding, use_bias=bias,
                               activation=activation, dtype=F64)


def _pads(k, d, padding):
    """The (before, after) padding of the dilated Conv1D on its input."""
    span = d * (k - 1)
    return {"same": (span // 2, span - span // 2), "valid": (0, 0), "causal": (span, 0)}[padding]


# -- Conv1D -----------------------------------------------------------------------------------


def _conv1d_stack():
    """same (d=2, bias, first), valid (d=3, no bias), causal (d=2, bias) on
    an odd length."""
    return [_conv1d(4, 3, 2, "same"), _conv1d(3, 2, 3, "valid", bias=False),
            _conv1d(3, 3, 2, "causal")]


def test_conv1d_dilated_first_and_middle_layers():
    _, loss_fn, args = _model(_conv1d_stack(), (13, 2))
    fn = kg.auto_register(loss_fn)
    reg = fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == ["conv2d"] * 3 + ["dense"]
    assert [len(layer.variables) for layer in reg.layers] == [2, 1, 2, 2]  # the bias is the conv's
    attrs = [layer.attrs for layer in reg.layers[:3]]
    assert [a["dilations"] for a in attrs] == [(1, 1, 2, 1), (1, 1, 3, 1), (1, 1, 2, 1)]
    assert attrs[0]["padding"] == "EXPLICIT" and attrs[0]["explicit_paddings"] == (
        0, 0, 0, 0, 2, 2, 0, 0)
    assert attrs[1]["padding"] == attrs[2]["padding"] == "VALID"  # causal pads before (a Pad op)
    assert [a["input_shape"] for a in attrs] == [(B, 1, 13, 2), (B, 1, 13, 4), (B, 1, 14, 3)]
    _assert_equal_loop(fn, loss_fn, args)
    report = kg.verify(fn, *args)
    assert report.passed, report.table()


@pytest.mark.slow  # dilated forms' gradients and blocks against brute force stay fast
def test_dilated_forms_train_with_kfac():
    """Conv1D (same, valid, causal), then DepthwiseConv2D and SeparableConv2D."""
    layers = [*_conv1d_stack(), keras.layers.Reshape((2, 5, 3), dtype=F64),
              *_conv2d_stack()]
    _, loss_fn, args = _model(layers, (13, 2))
    fn = kg.auto_register(loss_fn)
    assert [layer.kind for layer in fn.registration(*args).layers] == [
        "conv2d"] * 3 + ["depthwise_conv2d", "depthwise_conv2d", "conv2d", "dense"]
    _assert_trains(fn, args)


@pytest.mark.parametrize("padding,d", [("same", 2), ("valid", 3), ("causal", 3)])
def test_conv1d_dilated_kronecker_block_is_kfc(padding, d):
    """T (A (x) G): A from the dilated patches of x cut in numpy, G from the
    per-example output gradients (empirical Fisher, one batch)."""
    k, length = 3, 11
    model, loss_fn, args = _model([_conv1d(4, k, d, padding, activation=None)], (length, 2))
    x, y = args
    est = kg.FisherEstimator(kg.auto_register(loss_fn), estimation_mode="empirical")
    est.update(*args)
    block = est.blocks[0]
    conv, rest = model.layers[0], model.layers[1:]
    with tf.GradientTape() as tape:
        s = conv(x)
        tape.watch(s)
        z = s
        for layer in rest:
            z = layer(z)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, z))
    g = B * tape.gradient(loss, s).numpy()  # d loss_i / d s_i
    patches = np_patches(x.numpy()[:, None], 1, k, dilations=(1, d), padding="EXPLICIT",
                         pads=((0, 0), _pads(k, d, padding)))
    t = patches.shape[1]
    assert t == g.shape[1]
    rows = np.concatenate([patches, np.ones(patches.shape[:2] + (1,))], -1).reshape(B * t, -1)
    a = rows.T @ rows / (B * t)
    g_rows = g.reshape(B * t, -1)
    want = t * np.kron(a, g_rows.T @ g_rows / (B * t))
    assert_close(block.full_matrix().numpy(), want, 1e-6, "kron block")


@st.composite
def _conv1d_forms(draw):
    k = draw(st.integers(2, 4))
    d = draw(st.integers(2, 3))
    padding = draw(st.sampled_from(["same", "valid", "causal"]))
    length = draw(st.integers(d * (k - 1) + 1, d * (k - 1) + 6))
    return k, d, padding, length, draw(st.booleans())


@SETTINGS
@hypothesis.given(_conv1d_forms())
def test_conv1d_dilated_property(form):
    """Any kernel, dilation, padding and length: the dilated conv on x."""
    k, d, padding, length, bias = form
    _, loss_fn, args = _model([_conv1d(3, k, d, padding, bias)], (length, 2))
    fn = kg.auto_register(loss_fn)
    layer = fn.registration(*args).layers[0]
    assert layer.kind == "conv2d" and len(layer.variables) == 1 + bias
    before, after = _pads(k, d, padding) if padding != "causal" else (0, 0)
    assert layer.attrs["dilations"] == (1, 1, d, 1)
    assert layer.attrs.get("explicit_paddings") in ((0, 0, 0, 0, before, after, 0, 0), ())
    assert (layer.attrs["padding"] == "VALID") == (before == after == 0)
    _assert_equal_loop(fn, loss_fn, args)


# -- depthwise and separable ------------------------------------------------------------------


def _conv2d_stack():
    return [keras.layers.DepthwiseConv2D(3, dilation_rate=2, padding="same", depth_multiplier=2,
                                         activation="tanh", dtype=F64),
            keras.layers.SeparableConv2D(3, 2, dilation_rate=(1, 3), padding="valid",
                                         activation="tanh", dtype=F64)]


def test_depthwise_and_separable_conv2d_dilated():
    """Per-example gradients, and the full Fisher blocks against the exact
    Fisher (kg.verify's check, at rtol 1e-12: every layer computes in float64)."""
    _, loss_fn, args = _model(_conv2d_stack(), (7, 8, 2))
    fn = kg.auto_register(loss_fn)
    reg = fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == [
        "depthwise_conv2d", "depthwise_conv2d", "conv2d", "dense"]
    assert [len(layer.variables) for layer in reg.layers] == [2, 1, 2, 2]
    assert [layer.attrs["dilations"] for layer in reg.layers[:2]] == [(1, 2, 2, 1), (1, 1, 3, 1)]
    _assert_equal_loop(fn, loss_fn, args)
    report = kg.verify(fn, *args, estimation_mode="exact", rtol=1e-12)
    assert report.passed, report.table()


@pytest.mark.slow
def test_depthwise_and_separable_conv1d_dilated():
    """Per-example gradients against the loop, kg.verify, and K-FAC trains
    (the 1-D depthwise Kronecker block reads the op's rank-4 kernel)."""
    layers = [keras.layers.DepthwiseConv1D(3, dilation_rate=2, padding="same",
                                           activation="tanh", dtype=F64),
              keras.layers.SeparableConv1D(3, 2, dilation_rate=3, padding="valid", dtype=F64)]
    _, loss_fn, args = _model(layers, (11, 2))
    fn = kg.auto_register(loss_fn)
    assert [layer.kind for layer in fn.registration(*args).layers] == [
        "depthwise_conv2d", "depthwise_conv2d", "conv2d", "dense"]
    _assert_equal_loop(fn, loss_fn, args)
    assert kg.verify(fn, *args).passed
    _assert_trains(fn, args)


# -- written by hand --------------------------------------------------------------------------


def _conv1d_op(h, w, padding="VALID", stride=1):
    return tf.nn.conv1d(h, w, stride, padding)


def _runtime_paddings(x):
    """Paddings [[0, 1]] that only the running graph knows."""
    return tf.constant([[0, 1]]) + tf.cast(0.0 * tf.reduce_sum(x), tf.int32)


RAW = {  # form, kind, the explicit paddings (or what the generic layer's reason says)
    # crops that are not zero and the conv's own SAME padding: EXPLICIT (3-1+2*1, 2-0+2*1)
    "crops_and_same": (lambda x, w: tf.batch_to_space(_conv1d_op(
        tf.space_to_batch(x, [2], [[3, 2]]), w, "SAME"), [2], [[1, 0]]), "conv2d",
                       (0, 0, 0, 0, 4, 4, 0, 0)),
    "nn_convolution": (lambda x, w: tf.nn.convolution(x, w, padding="SAME", dilations=3),
                       "conv2d", (0, 0, 0, 0, 3, 3, 0, 0)),
    # no dilated convolution on x computes these: generic, still right
    "crops_exceed_paddings": (lambda x, w: tf.batch_to_space(_conv1d_op(
        tf.space_to_batch(x, [2], [[0, 1]]), w), [2], [[2, 1]]), "generic",
                              "its crops exceed its paddings"),
    "strided_inner_conv": (lambda x, w: tf.batch_to_space(_conv1d_op(
        tf.space_to_batch(x, [2], [[0, 1]]), w, stride=2), [2], [[0, 0]]), "generic",
                           "the conv itself is strided or dilated"),
    "runtime_paddings": (lambda x, w: tf.batch_to_space(_conv1d_op(
        tf.space_to_batch(x, [2], _runtime_paddings(x)), w), [2], [[0, 1]]), "generic",
                         "its paddings are not constant"),
}


SLOW_RAW = ("strided_inner_conv", "runtime_paddings")  # crops_exceed_paddings stands for them


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_RAW else n
                                  for n in sorted(RAW)])
def test_hand_written_space_to_batch(name):
    form, kind, want = RAW[name]
    w = tf.Variable(tf.random.stateless_normal([3, 2, 3], [3, 4], dtype=tf.float64), name="w")
    head = tf.Variable(tf.random.stateless_normal([3, 2], [5, 6], dtype=tf.float64), name="head")

    def loss_fn(x, y):
        h = tf.reduce_sum(tf.tanh(form(x, w)), axis=1)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h @ head))

    args = (tf.random.stateless_normal([B, 9, 2], [1, 2], dtype=tf.float64),
            tf.constant(np.arange(B) % 2))
    fn = kg.auto_register(loss_fn)
    layer = fn.registration(*args).layers[0]
    assert layer.kind == kind, layer.reason
    if kind == "generic":
        assert want in layer.reason and "SpaceToBatchND" in layer.reason, layer.reason
        assert "\n" not in layer.reason
    else:
        assert layer.attrs["explicit_paddings"] == want
    _assert_equal_loop(fn, loss_fn, args)
