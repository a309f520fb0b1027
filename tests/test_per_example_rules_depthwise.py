"""Depthwise conv rule against brute-force per-example gradients."""

import pytest
import tensorflow as tf

from kfac_graph import per_example as pe
from test_per_example_rules_conv import dilate_kernel, out_shape
from per_example_reference import check, DEFAULT, MODE_IDS, MODES


def depthwise_op(spec):
    """The TF op; NCHW via NHWC where the CPU lacks it, dilation by a
    zero-dilated kernel (no float64 dilated CPU kernel)."""

    def op(a, kernel, *bias):
        if spec.dilations_hw != (1, 1):
            kernel = dilate_kernel(kernel, *spec.dilations_hw)
        s, nchw_by_hand = spec, False
        if spec.data_format == "NCHW" and (a.dtype == tf.float64 or spec.padding == "EXPLICIT"):
            nchw_by_hand = True
            a = tf.transpose(a, [0, 2, 3, 1])
            perm = (0, 2, 3, 1)
            pads = (
                tuple(p for d in perm for p in spec.explicit_paddings[2 * d : 2 * d + 2])
                if (spec.explicit_paddings)
                else ()
            )
            s = pe.DepthwiseSpec(
                spec.kernel_shape,
                tuple(spec.strides[d] for d in perm),
                padding=spec.padding,
                explicit_paddings=pads,
            )
        out = tf.raw_ops.DepthwiseConv2dNative(
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


def use_shape(spec, batch, h, w):
    kh, kw, c, m = spec.kernel_shape
    conv_like = pe.ConvSpec(
        (kh, kw, c, c * m),
        spec.strides,
        spec.dilations,
        spec.padding,
        spec.explicit_paddings,
        spec.data_format,
    )
    a = (batch, h, w, c) if spec.data_format == "NHWC" else (batch, c, h, w)
    return a, out_shape(conv_like, batch, h, w)


def weight_shapes(spec):
    kh, kw, c, m = spec.kernel_shape
    return [spec.kernel_shape] + ([(c * m,)] if spec.has_bias else [])


S = pe.DepthwiseSpec
CASES = {
    "m1_same_bias": (S((3, 3, 3, 1), padding="SAME", has_bias=True), 3, [(6, 7)]),
    "m2_same": (S((3, 3, 3, 2), padding="SAME"), 3, [(6, 6)]),
    "m1_valid": (S((3, 2, 2, 1), padding="VALID"), 3, [(6, 6)]),
    "m2_valid_bias": (S((3, 3, 2, 2), padding="VALID", has_bias=True), 3, [(7, 6)]),
    "stride2_same_m1": (
        S((3, 3, 3, 1), strides=(1, 2, 2, 1), padding="SAME", has_bias=True),
        3,
        [(7, 7)],
    ),
    "stride2_valid_m2": (S((3, 3, 2, 2), strides=(1, 2, 2, 1), padding="VALID"), 3, [(8, 7)]),
    "explicit": (
        S((3, 3, 2, 2), padding="EXPLICIT", explicit_paddings=(0, 0, 2, 1, 0, 1, 0, 0)),
        3,
        [(5, 6)],
    ),
    "dilation2": (
        S((3, 3, 2, 2), dilations=(1, 2, 2, 1), padding="SAME", has_bias=True),
        3,
        [(7, 7)],
    ),
    "nchw_stride2": (
        S((3, 3, 2, 2), strides=(1, 1, 2, 2), padding="SAME", data_format="NCHW", has_bias=True),
        3,
        [(6, 7)],
    ),
    "batch1": (S((3, 3, 2, 2), padding="SAME", has_bias=True), 1, [(5, 5)]),
    "multi_use": (S((3, 3, 2, 2), padding="SAME", has_bias=True), 3, [(5, 5), (4, 6)]),
    "gram_norms": (S((3, 3, 2, 2), padding="VALID", has_bias=True), 3, [(3, 3)]),
    "gram_norms_multi_use": (S((3, 3, 2, 3), padding="VALID"), 3, [(3, 3), (3, 3)]),
}


def _check(rule, name, dtype, mode):
    spec, batch, sizes = CASES[name]
    uses = [use_shape(spec, batch, h, w) for h, w in sizes]
    check(rule, spec, depthwise_op(spec), weight_shapes(spec), uses, dtype, mode)


def test_gram_cases_take_the_gram_branch():
    rule = DEFAULT["depthwise_conv2d"]
    assert rule.use_gram(CASES["gram_norms"][0], 1)
    assert rule.use_gram(CASES["gram_norms_multi_use"][0], 2)
    assert not rule.use_gram(CASES["m2_same"][0], 36)


@pytest.mark.parametrize("dtype,mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_depthwise_matches_brute_force(name, dtype, mode):
    _check(DEFAULT["depthwise_conv2d"], name, dtype, mode)


@pytest.mark.parametrize("method", ["taps", "grouped"])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("name", ["stride2_valid_m2", "explicit", "multi_use", "nchw_stride2"])
def test_depthwise_methods(method, dtype, name):
    rule = pe.DepthwiseRule(method=method, norm_method="materialize")
    _check(rule, name, dtype, "function")


def test_depthwise_forced_gram_norms():
    _check(pe.DepthwiseRule(norm_method="gram"), "stride2_same_m1", tf.float64, "eager")


@pytest.mark.parametrize("mode", ["function", "xla"])
def test_depthwise_dynamic_batch(mode):
    spec = CASES["stride2_valid_m2"][0]
    a, g = use_shape(spec, 3, 8, 7)
    sig = [tf.TensorSpec((None,) + a[1:], tf.float64), tf.TensorSpec((None,) + g[1:], tf.float64)]
    check(
        DEFAULT["depthwise_conv2d"],
        spec,
        depthwise_op(spec),
        weight_shapes(spec),
        [(a, g)],
        tf.float64,
        mode,
        input_signature=sig,
    )
