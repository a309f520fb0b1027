"""Transposed convolutions (Conv2DTranspose; Conv1DTranspose on a unit axis):
TensorFlow's Conv2DBackpropInput registered as kind "conv2d_transpose".

Per-example gradients against one-example GradientTape loops (the rule on
raw ops, and whole Keras models through kg.per_example_gradients and
kg.verify); the kernel and bias blocks against the
brute-force Fisher where KFC is exact (one example, one input position);
kg.KFAC on a small encoder-decoder. float64, rtol 1e-6. The Kronecker blocks
against numpy patches cut by hand: tests/test_conv_transpose_blocks.py.
"""
import hypothesis
from hypothesis import strategies as st
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_reference import F64, brute_fisher, out_size
from kfac_graph import fisher
from kfac_graph.layers.conv_transpose import ConvTransposeRule, ConvTransposeSpec
from per_example_reference import assert_close, check, one_example_loop

RTOL = 1e-6

# -- the rule on raw ops, against one-example tapes ----------------------------------


def _dilate(w, d):
    """The kernel with zeros between its taps: a dilated transposed conv as
    an undilated one (TensorFlow's CPU kernels reject dilations)."""
    def place(k):
        out = np.zeros([(k - 1) * d + 1, k])
        out[np.arange(k) * d, np.arange(k)] = 1.0
        return out

    return tf.einsum("ap,bq,pqco->abco", place(w.shape[0]), place(w.shape[1]), w)


def _raw_case(kernel, stride, padding, extra=0, one_d=False, bias=True, pads=None, dilation=1,
              nchw=False):
    """``(spec, op, weight shapes, use shapes)``: y of size (forward input)
    5 + extra (extra: Keras's output_padding), x sized by the forward conv."""
    kh, kw = (1, kernel) if one_d else (kernel, kernel)
    hy, wy = (1, 5 + extra) if one_d else (5 + extra, 4 + extra)
    cout, cin = 2, 3
    hx = out_size(hy, kh, 1 if one_d else stride, dilation, padding, pads[0] if pads else (0, 0))
    wx = out_size(wy, kw, stride, dilation, padding, pads[1] if pads else (0, 0))
    strides = (1, 1 if one_d else stride, stride, 1)
    layout = (lambda t: (t[0], t[3], t[1], t[2])) if nchw else tuple  # NHWC -> data_format
    explicit = [p for pair in layout(((0, 0), *pads, (0, 0))) for p in pair] if pads else []
    spec = ConvTransposeSpec((kh, kw, cout, cin), strides=layout(strides), padding=padding,
                             dilations=layout((1, dilation, dilation, 1)),
                             explicit_paddings=explicit, data_format="NCHW" if nchw else "NHWC",
                             has_bias=bias)
    tf_padding = [[0, 0], list(pads[0]), list(pads[1]), [0, 0]] if pads else padding
    to_nhwc, from_nhwc = ((lambda t: tf.transpose(t, [0, 2, 3, 1])),
                          (lambda t: tf.transpose(t, [0, 3, 1, 2]))) if nchw else (tf.identity,) * 2

    def op(x, w, b=None):
        y = tf.nn.conv2d_transpose(to_nhwc(x), _dilate(w, dilation),
                                   [x.shape[0], hy, wy, cout], list(strides), tf_padding)
        return from_nhwc(y if b is None else y + b)

    weights = [(kh, kw, cout, cin)] + ([(cout,)] if bias else [])
    return spec, op, weights, [(layout((3, hx, wx, cin)), layout((3, hy, wy, cout)))]


RAW = {  # name: (kernel, stride, padding, output padding, 1-D, bias)
    "k3-s2-same": (3, 2, "SAME", 0, False, True),
    "k2-s2-valid": (2, 2, "VALID", 0, False, True),
    "k3-s1-valid-nobias": (3, 1, "VALID", 0, False, False),
    "k2-s1-same": (2, 1, "SAME", 0, False, True),
    "k3-s2-valid-outpad1": (3, 2, "VALID", 1, False, True),
    "k3-s3-same-outpad2": (3, 3, "SAME", 2, False, True),
    "1d-k3-s2-same": (3, 2, "SAME", 0, True, True),
    "1d-k2-s1-valid-nobias": (2, 1, "VALID", 0, True, False),
}


@pytest.mark.parametrize("name", sorted(RAW))
def test_rule_against_one_example_tapes(name):
    kernel, stride, padding, extra, one_d, bias = RAW[name]
    spec, op, weights, uses = _raw_case(kernel, stride, padding, extra, one_d, bias)
    check(ConvTransposeRule(), spec, op, weights, uses, F64, "eager")


@pytest.mark.parametrize("method", ["taps", "gather", "im2col"])
def test_rule_kernels_explicit_padding_dilation_nchw_and_two_uses(method):
    spec, op, weights, uses = _raw_case(3, 2, "EXPLICIT", pads=((1, 0), (0, 2)))
    check(ConvTransposeRule(method=method, norm_method="gram"), spec, op, weights, uses, F64,
          "eager")
    spec, op, weights, uses = _raw_case(2, 1, "SAME", dilation=2)
    check(ConvTransposeRule(method=method), spec, op, weights, uses, F64, "eager")
    spec, op, weights, uses = _raw_case(3, 2, "EXPLICIT", pads=((0, 1), (2, 0)), nchw=True)
    check(ConvTransposeRule(method=method), spec, op, weights, uses, F64, "eager")
    spec, op, weights, uses = _raw_case(2, 2, "SAME")
    check(ConvTransposeRule(method=method), spec, op, weights, uses * 2, F64, "eager")


@hypothesis.settings(max_examples=12, deadline=None, derandomize=True, database=None)
@hypothesis.given(kernel=st.integers(1, 3), stride=st.integers(1, 3),
                  padding=st.sampled_from(["SAME", "VALID"]), extra=st.integers(0, 2),
                  one_d=st.booleans(), bias=st.booleans(), dilation=st.integers(1, 2))
def test_rule_property(kernel, stride, padding, extra, one_d, bias, dilation):
    hypothesis.assume(extra < stride)  # Keras: output_padding < strides
    hypothesis.assume((kernel - 1) * dilation < 4)  # a VALID kernel fits the 5x4 output
    spec, op, weights, uses = _raw_case(kernel, stride, padding, extra, one_d, bias,
                                        dilation=dilation)
    check(ConvTransposeRule(), spec, op, weights, uses, F64, "eager")


@pytest.mark.slow
def test_rule_under_xla():
    spec, op, weights, uses = _raw_case(3, 2, "SAME")
    check(ConvTransposeRule(), spec, op, weights, uses, F64, "xla")


# -- Keras models ----------------------------------------------------------------------


def _keras_model(one_d, forms, seed=0):
    """A float64 classifier: transposed convs of ``forms`` (kernel, stride,
    padding, bias, output_padding), then a dense head."""
    keras.utils.set_random_seed(seed)
    layer = keras.layers.Conv1DTranspose if one_d else keras.layers.Conv2DTranspose
    shape = (3, 2) if one_d else (3, 3, 2)
    stack = [keras.Input(shape, dtype="float64")]
    for k, (kernel, stride, padding, bias, extra) in enumerate(forms):
        stack.append(layer(3 - k % 2, kernel, strides=stride, padding=padding, use_bias=bias,
                           output_padding=extra or None, activation="tanh", dtype="float64"))
    stack += [keras.layers.Flatten(dtype="float64"), keras.layers.Dense(3, dtype="float64")]
    model = keras.Sequential(stack)

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    x = tf.random.stateless_normal((4,) + shape, seed=[seed, 1], dtype=F64)
    return model, loss_fn, (x, tf.constant([0, 1, 2, 1]))


KERAS = {  # every stride, padding, kernel size and bias choice in the fast set
    "2d": (False, [(3, 2, "same", True, None), (2, 1, "valid", False, None)]),
    "1d": (True, [(2, 2, "valid", True, None), (3, 1, "same", False, None)]),
    "2d-outpad": (False, [(3, 2, "valid", False, 1), (2, 3, "same", True, 2)]),
    "1d-outpad": (True, [(3, 3, "same", True, 1), (2, 2, "valid", True, 1)]),
}


def _check_keras(one_d, forms, fisher_check=True):
    """Registered as transposed convs; per-example gradients and norms equal
    the one-example loop; kg.verify passes (with ``fisher_check``, the full
    Fisher block's check too)."""
    model, loss_fn, args = _keras_model(one_d, forms)
    reg = loss_fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == ["conv2d_transpose"] * len(forms) + ["dense"]
    for layer, form in zip(reg.layers, forms):
        assert len(layer.variables) == 1 + form[3]
        assert layer.attrs["op"] == "Conv2DBackpropInput"
    got = kg.per_example_gradients(loss_fn, *args)
    want = one_example_loop(loss_fn, args, reg.variables)
    for g, w in zip(got, want):
        assert_close(g.numpy(), w.numpy(), RTOL)
    norms = np.sqrt(sum(np.sum(np.reshape(w.numpy(), [4, -1]) ** 2, 1) for w in want))
    assert_close(kg.per_example_gradient_norms(loss_fn, *args).numpy(), norms, RTOL)
    report = kg.verify(loss_fn, *args, estimation_mode="exact" if fisher_check else None)
    assert report.passed, report.table()


@pytest.mark.parametrize("name", ["2d", "1d", pytest.param("2d-outpad", marks=pytest.mark.slow),
                                  pytest.param("1d-outpad", marks=pytest.mark.slow)])
def test_keras_per_example_gradients_norms_and_verify(name):
    _check_keras(*KERAS[name], fisher_check=name != "1d")


FORM = st.tuples(st.integers(1, 3), st.integers(1, 3), st.sampled_from(["same", "valid"]),
                 st.booleans(), st.integers(0, 2)).filter(lambda f: f[4] < f[1])


@pytest.mark.slow
@hypothesis.settings(max_examples=6, deadline=None, derandomize=True, database=None)
@hypothesis.given(one_d=st.booleans(), forms=st.lists(FORM, min_size=1, max_size=2))
def test_keras_property(one_d, forms):
    _check_keras(one_d, forms)


@pytest.mark.slow
def test_keras_shared_layer_two_uses():
    keras.utils.set_random_seed(1)
    shared = keras.layers.Conv2DTranspose(2, 3, strides=2, padding="same", activation="tanh",
                                          dtype="float64")
    head = keras.layers.Dense(3, dtype="float64")
    flat = keras.layers.Flatten(dtype="float64")

    @kg.auto_register
    def loss_fn(x, y):
        h = shared(x) + shared(tf.tanh(x))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, head(flat(h))))

    args = (tf.random.stateless_normal([4, 3, 3, 2], seed=[1, 1], dtype=F64),
            tf.constant([0, 1, 2, 1]))
    reg = loss_fn.registration(*args)
    assert [(layer.kind, layer.uses) for layer in reg.layers] == [("conv2d_transpose", 2),
                                                                 ("dense", 1)]
    for g, w in zip(kg.per_example_gradients(loss_fn, *args),
                    one_example_loop(loss_fn, args, reg.variables)):
        assert_close(g.numpy(), w.numpy(), RTOL)
    report = kg.verify(loss_fn, *args, estimation_mode="exact")
    assert report.passed, report.table()
    opt = kg.KFAC(loss_fn, learning_rate=0.1, damping=1e-2)
    losses = [float(opt.step(*args)) for _ in range(3)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0


@pytest.mark.slow
def test_keras_channels_first_float32():
    """NCHW (TensorFlow's CPU kernel has it for float32 only): the rule and
    the Kronecker factors read the op's data format."""
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((2, 3, 3)),
                              keras.layers.Conv2DTranspose(3, 3, strides=2, padding="same",
                                                           data_format="channels_first",
                                                           activation="tanh"),
                              keras.layers.Flatten(), keras.layers.Dense(3)])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    args = (tf.random.stateless_normal([4, 2, 3, 3], seed=[2, 1]), tf.constant([0, 1, 2, 1]))
    reg = loss_fn.registration(*args)
    assert reg.layers[0].kind == "conv2d_transpose"
    assert reg.layers[0].attrs["data_format"] == "NCHW"
    for g, w in zip(kg.per_example_gradients(loss_fn, *args),
                    one_example_loop(loss_fn, args, reg.variables)):
        assert_close(g.numpy(), w.numpy(), 1e-4)
    assert kg.verify(loss_fn, *args).passed
    opt = kg.KFAC(loss_fn, learning_rate=0.1, damping=1e-2)
    losses = [float(opt.step(*args)) for _ in range(3)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0


def test_keras_exact_where_kfc_is_exact():
    """One example, one input position (a 1x1 latent decoded by a VALID
    transposed conv): the Kronecker block's kernel and bias blocks equal the
    brute-force Fisher's, its cross terms are zero; the diagonal block is
    the exact diagonal (three examples)."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((1, 1, 2), dtype="float64"),
                              keras.layers.Conv2DTranspose(2, 3, strides=2, activation="tanh",
                                                           dtype="float64"),
                              keras.layers.Flatten(dtype="float64"),
                              keras.layers.Dense(3, dtype="float64")])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    x = tf.random.stateless_normal([3, 1, 1, 2], seed=[3, 1], dtype=F64)
    y = tf.constant([0, 2, 1])
    layer_vars = list(model.layers[0].trainable_variables)
    fisher_z = lambda z: fisher.Categorical(z).fisher()  # noqa: E731
    for batch, mode in ((1, "kron"), (3, "diagonal")):
        want = brute_fisher(lambda p, xx: model(xx), layer_vars, x[:batch], fisher_z)
        est = kg.FisherEstimator(loss_fn, estimation_mode="exact", cov_ema_decay=0.0,
                                 approximations={"conv2d_transpose": mode})
        est.update(x[:batch], y[:batch])
        got = est.blocks[0].full_matrix().numpy()
        if mode == "kron":
            n = 3 * 3 * 2 * 2
            want[:n, n:] = want[n:, :n] = 0.0  # the cross terms the block drops
            assert isinstance(est.blocks[0], fisher.ConvTransposeKroneckerBlock)
        else:
            want = np.diag(np.diag(want))
        assert_close(got, want, RTOL)


def test_kfac_trains_an_encoder_decoder():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 2), dtype="float64"),
        keras.layers.Conv2D(4, 3, strides=2, padding="same", activation="tanh", dtype="float64"),
        keras.layers.Conv2DTranspose(2, 3, strides=2, padding="same", dtype="float64")])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.square(model(x) - y))

    x = tf.random.stateless_normal([8, 8, 8, 2], seed=[0, 1], dtype=F64)
    args = (x, tf.tanh(x))
    assert [layer.kind for layer in loss_fn.registration(*args).layers] == [
        "conv2d", "conv2d_transpose"]
    opt = kg.KFAC(loss_fn, learning_rate=0.1, damping=1e-2)
    losses = [float(opt.step(*args)) for _ in range(3)]
    assert all(np.isfinite(losses)) and int(opt.skipped_steps) == 0
    assert losses[2] < losses[1] < losses[0], losses


# -- Conv3DTranspose: its own kind (more in tests/test_conv3d.py) ----------------------


@pytest.mark.slow
def test_conv3d_transpose_registers_and_is_right():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2, 2, 2, 1), dtype="float64"),
                              keras.layers.Conv3DTranspose(2, 2, strides=2, dtype="float64"),
                              keras.layers.Flatten(dtype="float64"),
                              keras.layers.Dense(2, dtype="float64")])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    args = (tf.random.stateless_normal([3, 2, 2, 2, 1], seed=[0, 1], dtype=F64),
            tf.constant([0, 1, 1]))
    reg = loss_fn.registration(*args)
    kernel = reg.layers[0]
    assert kernel.kind == "conv3d_transpose" and len(kernel.variables) == 2
    got = kg.per_example_gradients(loss_fn, *args)
    for g, w in zip(got, one_example_loop(loss_fn, args, reg.variables)):
        assert_close(g.numpy(), w.numpy(), RTOL)
