"""Conv2D rule against brute-force per-example gradients."""

import pytest
import tensorflow as tf

from kfac_graph import per_example as pe
from per_example_reference import check, DEFAULT, MODE_IDS, MODES


def _nhwc_spec(spec):
    """The same convolution written for NHWC tensors."""
    perm = (0, 2, 3, 1)
    pads = spec.explicit_paddings
    if pads:
        pads = tuple(p for d in perm for p in pads[2 * d : 2 * d + 2])
    return pe.ConvSpec(
        spec.kernel_shape,
        tuple(spec.strides[d] for d in perm),
        tuple(spec.dilations[d] for d in perm),
        spec.padding,
        pads,
        "NHWC",
        spec.has_bias,
    )


def dilate_kernel(kernel, dh, dw):
    """The kernel with `d-1` zeros between taps: dilation as a plain conv
    (TF's CPU kernels have no float64 dilated gradient)."""
    kh, kw = kernel.shape[0], kernel.shape[1]
    index = [[p * dh, q * dw] for p in range(kh) for q in range(kw)]
    taps = tf.reshape(kernel, [kh * kw] + kernel.shape[2:].as_list())
    shape = [(kh - 1) * dh + 1, (kw - 1) * dw + 1] + kernel.shape[2:].as_list()
    return tf.scatter_nd(index, taps, shape)


def conv_op(spec):
    """The TF op itself; NCHW through NHWC transposes where TF's CPU kernels
    lack it (float64, or EXPLICIT padding's input gradient),
    dilations by a zero-dilated kernel."""

    def op(a, kernel, *bias):
        s = spec
        if spec.dilations_hw != (1, 1):
            kernel = dilate_kernel(kernel, *spec.dilations_hw)
        nchw_by_hand = spec.data_format == "NCHW" and (
            a.dtype == tf.float64 or spec.padding == "EXPLICIT"
        )
        if nchw_by_hand:
            s, a = _nhwc_spec(spec), tf.transpose(a, [0, 2, 3, 1])
        out = tf.raw_ops.Conv2D(
            input=a,
            filter=kernel,
            strides=list(s.strides),
            padding=s.padding,
            explicit_paddings=list(s.explicit_paddings),
            data_format=s.data_format,
        )
        if bias:
            out = tf.nn.bias_add(out, bias[0], data_format=s.data_format)
        return tf.transpose(out, [0, 3, 1, 2]) if nchw_by_hand else out

    return op


def out_shape(spec, batch, h, w):
    """Expected Conv2D output shape in the spec's data format."""
    (kh, kw), (sh, sw), (dh, dw) = spec.kernel_hw, spec.strides_hw, spec.dilations_hw
    sizes = []
    for size, k, s, d, i in ((h, kh, sh, dh, 0), (w, kw, sw, dw, 1)):
        span = (k - 1) * d + 1
        if spec.padding == "SAME":
            sizes.append(-(-size // s))
        elif spec.padding == "VALID":
            sizes.append(-(-(size - span + 1) // s))
        else:
            before, after = spec.explicit_paddings_hw[i]
            sizes.append((size + before + after - span) // s + 1)
    cout = spec.kernel_shape[3]
    if spec.data_format == "NHWC":
        return (batch, sizes[0], sizes[1], cout)
    return (batch, cout, sizes[0], sizes[1])


def use_shape(spec, batch, h, w):
    cin = spec.kernel_shape[2]
    a = (batch, h, w, cin) if spec.data_format == "NHWC" else (batch, cin, h, w)
    return a, out_shape(spec, batch, h, w)


def weight_shapes(spec):
    return [spec.kernel_shape] + ([(spec.kernel_shape[3],)] if spec.has_bias else [])


S = pe.ConvSpec
CASES = {
    # name: (spec, batch, [(H, W) per use])
    "same_bias": (S((3, 3, 3, 4), padding="SAME", has_bias=True), 3, [(6, 7)]),
    "valid": (S((3, 3, 2, 4), padding="VALID"), 3, [(7, 7)]),
    "explicit": (
        S(
            (3, 2, 2, 3),
            padding="EXPLICIT",
            explicit_paddings=(0, 0, 1, 2, 2, 0, 0, 0),
            has_bias=True,
        ),
        3,
        [(6, 5)],
    ),
    "stride2_same_odd": (
        S((3, 3, 2, 4), strides=(1, 2, 2, 1), padding="SAME", has_bias=True),
        3,
        [(7, 7)],
    ),
    "stride2_same_even": (S((3, 3, 2, 3), strides=(1, 2, 2, 1), padding="SAME"), 2, [(8, 6)]),
    "stride2_valid": (S((3, 3, 2, 3), strides=(1, 2, 2, 1), padding="VALID"), 3, [(8, 7)]),
    "stride_1x2_rect": (S((2, 3, 2, 3), strides=(1, 1, 2, 1), padding="SAME"), 3, [(5, 7)]),
    "dilation2": (
        S((3, 3, 2, 3), dilations=(1, 2, 2, 1), padding="SAME", has_bias=True),
        3,
        [(7, 8)],
    ),
    "dilation2_valid": (S((2, 3, 2, 3), dilations=(1, 2, 2, 1), padding="VALID"), 3, [(7, 8)]),
    "one_by_one": (S((1, 1, 4, 3), padding="SAME", has_bias=True), 3, [(5, 5)]),
    "one_by_one_stride2": (S((1, 1, 4, 3), strides=(1, 2, 2, 1), padding="VALID"), 3, [(5, 6)]),
    "conv1d": (S((1, 3, 3, 4), padding="SAME", has_bias=True), 3, [(1, 9)]),
    "conv1d_stride2": (S((1, 3, 3, 4), strides=(1, 1, 2, 1), padding="VALID"), 3, [(1, 9)]),
    "batch1": (S((3, 3, 2, 3), padding="SAME", has_bias=True), 1, [(5, 5)]),
    "nchw_stride2": (
        S((3, 3, 2, 3), strides=(1, 1, 2, 2), padding="SAME", data_format="NCHW", has_bias=True),
        3,
        [(7, 6)],
    ),
    "nchw_explicit": (
        S(
            (2, 3, 2, 3),
            padding="EXPLICIT",
            data_format="NCHW",
            explicit_paddings=(0, 0, 0, 0, 1, 0, 2, 1),
        ),
        3,
        [(5, 5)],
    ),
    "multi_use": (S((3, 3, 2, 3), padding="SAME", has_bias=True), 3, [(5, 5), (4, 6)]),
    "gram_norms": (S((3, 3, 4, 8), padding="VALID", has_bias=True), 3, [(4, 4)]),
    "gram_norms_multi_use": (S((3, 3, 4, 8), padding="VALID"), 3, [(4, 4), (3, 3)]),
}


def _check(rule, name, dtype, mode):
    spec, batch, sizes = CASES[name]
    uses = [use_shape(spec, batch, h, w) for h, w in sizes]
    check(rule, spec, conv_op(spec), weight_shapes(spec), uses, dtype, mode)


def test_gram_cases_take_the_gram_branch():
    rule = DEFAULT["conv2d"]
    assert rule.use_gram(CASES["gram_norms"][0], 4)
    assert rule.use_gram(CASES["gram_norms_multi_use"][0], 5)
    assert not rule.use_gram(CASES["same_bias"][0], 42)


@pytest.mark.parametrize("dtype,mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_conv_matches_brute_force(name, dtype, mode):
    _check(DEFAULT["conv2d"], name, dtype, mode)


METHOD_CASES = [
    "stride2_same_odd",
    "explicit",
    "dilation2",
    "one_by_one",
    "multi_use",
    "nchw_stride2",
]


@pytest.mark.parametrize("method", ["taps", "gather", "im2col", "grouped"])
@pytest.mark.parametrize("name", METHOD_CASES)
def test_conv_methods(method, name):
    # The grouped filter gradient has a CPU kernel for float32 only.
    dtype = tf.float32 if method == "grouped" else tf.float64
    rule = pe.ConvRule(method=method, norm_method="materialize")
    _check(rule, name, dtype, "function")


@pytest.mark.parametrize("method", ["taps", "gather", "im2col"])
def test_conv_methods_under_xla(method):
    _check(pe.ConvRule(method=method), "stride2_same_odd", tf.float32, "xla")


def test_conv_auto_method():
    strided = S((3, 3, 2, 3), strides=(1, 2, 2, 1), padding="SAME")
    unit = S((3, 3, 2, 3), padding="SAME")
    assert pe.ConvRule(xla=False).choose_method(strided) == "gather"
    assert pe.ConvRule(xla=False).choose_method(unit) == "taps"
    assert pe.ConvRule(xla=True).choose_method(strided) == "im2col"
    assert pe.ConvRule(xla=True).choose_method(unit) == "taps"
    assert pe.ConvRule(method="im2col").choose_method(strided) == "im2col"
    with pytest.raises(ValueError, match="unknown conv method"):
        pe.ConvRule(method="loop").choose_method(unit)


def test_conv_forced_gram_norms():
    _check(pe.ConvRule(norm_method="gram"), "stride2_same_odd", tf.float64, "eager")


@pytest.mark.parametrize("mode", ["function", "xla"])
def test_conv_dynamic_batch(mode):
    spec = CASES["stride2_same_odd"][0]
    a, g = use_shape(spec, 3, 7, 7)
    sig = [tf.TensorSpec((None,) + a[1:], tf.float64), tf.TensorSpec((None,) + g[1:], tf.float64)]
    check(
        DEFAULT["conv2d"],
        spec,
        conv_op(spec),
        weight_shapes(spec),
        [(a, g)],
        tf.float64,
        mode,
        input_signature=sig,
    )


def test_wrong_output_shape_is_rejected():
    spec = S((3, 3, 2, 3), padding="VALID")
    with pytest.raises(ValueError):
        DEFAULT["conv2d"].per_example_grads((tf.zeros([2, 5, 5, 2]), tf.zeros([2, 5, 5, 3])), spec)
