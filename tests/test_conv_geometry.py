"""Patches by one gather against `tf.image.extract_patches`."""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from kfac_graph.layers import conv_geometry as cg

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None)


def _reference(x_nhwc, kernel, geometry):
    """`tf.image.extract_patches` on the explicitly padded input, flattened."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, geometry.strides_hw, geometry.dilations_hw
    padding = geometry.padding
    if padding == "EXPLICIT":
        (pt, pb), (pl, pr) = geometry.explicit_paddings_hw
        x_nhwc = tf.pad(x_nhwc, [[0, 0], [pt, pb], [pl, pr], [0, 0]])
        padding = "VALID"
    p = tf.image.extract_patches(x_nhwc, [1, kh, kw, 1], [1, sh, sw, 1], [1, dh, dw, 1], padding)
    return tf.reshape(p, [p.shape[0], -1, p.shape[3]])


@st.composite
def conv_cases(draw):
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    strides = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilations = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    padding = draw(st.sampled_from(["SAME", "VALID", "EXPLICIT"]))
    fmt = draw(st.sampled_from(["NHWC", "NCHW"]))
    size = [draw(st.integers(1, 9)), draw(st.integers(1, 9))]
    pads = [draw(st.integers(0, 2)) for _ in range(4)] if padding == "EXPLICIT" else [0] * 4
    if padding != "SAME":  # the kernel must fit the (padded) input
        for i in range(2):
            span = (kernel[i] - 1) * dilations[i] + 1
            size[i] = max(size[i], span - pads[2 * i] - pads[2 * i + 1])
    channels, batch = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    return kernel, strides, dilations, padding, fmt, tuple(size), pads, channels, batch


def _geometry(strides, dilations, padding, fmt, pads, kernel=(1, 1)):
    def four(hw, fill):
        return (fill, fill, *hw) if fmt == "NCHW" else (fill, *hw, fill)

    spatial = [pads[0], pads[1], pads[2], pads[3]]
    explicit = ((0, 0, 0, 0, *spatial) if fmt == "NCHW" else (0, 0, *spatial, 0, 0))
    attrs = {"strides": four(strides, 1), "dilations": four(dilations, 1),
             "padding": padding, "data_format": fmt}
    if padding == "EXPLICIT":
        attrs["explicit_paddings"] = explicit
    return cg.ConvAttrs.from_attrs((*kernel, 1, 1), attrs)


@SETTINGS
@given(conv_cases())
def test_gathered_patches_equal_extract_patches(case):
    kernel, strides, dilations, padding, fmt, size, pads, channels, batch = case
    geometry = _geometry(strides, dilations, padding, fmt, pads, kernel)
    x = np.random.default_rng(0).standard_normal((batch, *size, channels))
    x_in = np.transpose(x, [0, 3, 1, 2]) if fmt == "NCHW" else x
    got = cg.extract_patches(tf.constant(x_in), geometry)
    want = _reference(tf.constant(x), kernel, geometry)
    np.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.mark.parametrize("jit_compile", [False, True])
def test_dynamic_shapes_and_xla(jit_compile):
    geometry = _geometry((2, 1), (1, 2), "SAME", "NHWC", [0] * 4, (3, 2))
    x = tf.constant(np.random.default_rng(1).standard_normal((3, 7, 6, 2)), tf.float32)
    want = _reference(x, (3, 2), geometry).numpy()
    for shape in [(None, 7, 6, 2), (None, None, None, 2)]:  # gather, then the fallback
        fn = tf.function(lambda v: cg.extract_patches(v, geometry),
                         input_signature=[tf.TensorSpec(shape, tf.float32)],
                         jit_compile=jit_compile and shape[1] is not None)
        np.testing.assert_array_equal(fn(x).numpy(), want)


def test_too_small_input_is_rejected():
    with pytest.raises(ValueError, match="too small"):
        cg.gather_patches(tf.zeros([1, 4, 4, 1]), (3, 3), (1, 1), (1, 1), (3, 3))
