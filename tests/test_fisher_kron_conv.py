"""Convolution and depthwise Kronecker blocks against factors from patches
cut by hand in numpy (every format, padding, stride and dilation; several
uses; random geometry), the damped block built as
R (A + pi r I) (x) (G + r/pi I) in numpy."""

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest
import tensorflow as tf

from kfac_graph import fisher
from kfac_graph.layers.conv import ConvSpec
from fisher_checks import assert_all_products
from fisher_reference import F64, cov, homog, np_patches, operator_matrix, out_size, pi_damped_kron

LAM = 0.3
KW = dict(dtype=F64, ema_decay=0.0, damping=LAM)


CONV_CASES = [  # (format, padding, stride, dilation)
    ("NHWC", "SAME", 1, 1),
    ("NHWC", "VALID", 2, 1),
    ("NHWC", "SAME", 2, 2),
    ("NCHW", "VALID", 1, 2),
    ("NCHW", "SAME", 2, 1),
    ("NHWC", "EXPLICIT", 2, 1),
]


def _conv_setup(rng, fmt, padding, stride, dilation, kh=2, kw=3, cin=2):
    x = rng.normal(size=(2, 5, 6, cin))
    pads = ((1, 0), (2, 1)) if padding == "EXPLICIT" else None
    p = np_patches(x, kh, kw, (stride, stride), (dilation, dilation), padding, pads)
    oh = out_size(5, kh, stride, dilation, padding, pads[0] if pads else (0, 0))
    ow = out_size(6, kw, stride, dilation, padding, pads[1] if pads else (0, 0))
    assert p.shape[1] == oh * ow
    sp = lambda v: [1, 1, v, v] if fmt == "NCHW" else [1, v, v, 1]
    explicit = []
    if pads:
        flat_pads = [0, 0, *pads[0], *pads[1], 0, 0]
        explicit = [0, 0, 0, 0, *pads[0], *pads[1]] if fmt == "NCHW" else flat_pads
    attrs = dict(
        strides=sp(stride),
        dilations=sp(dilation),
        padding=padding.encode(),
        explicit_paddings=explicit,
        data_format=fmt,
    )
    to_fmt = (lambda t: np.transpose(t, [0, 3, 1, 2])) if fmt == "NCHW" else (lambda t: t)
    return x, p, (oh, ow), attrs, to_fmt


@pytest.mark.parametrize("case", CONV_CASES)
def test_conv_kronecker_against_hand_patches(case):
    rng = np.random.default_rng(5)
    x, p, (oh, ow), attrs, to_fmt = _conv_setup(rng, *case)
    g = rng.normal(size=(2, oh, ow, 3))
    block = fisher.ConvKroneckerBlock([(2, 3, 2, 3), (3,)], attrs, **KW)
    block.update([(tf.constant(to_fmt(x)), tf.constant(to_fmt(g)))])
    t = oh * ow
    a_np, g_np = cov(homog(p)), cov(g)
    np.testing.assert_allclose(block.full_matrix(), t * np.kron(a_np, g_np), atol=1e-11)
    if case == CONV_CASES[1]:
        assert_all_products(block, pi_damped_kron(a_np, g_np, LAM, float(t)))
    else:
        block.update_inverses()
        inv = operator_matrix(block.multiply_inverse, block.var_shapes)
        np.testing.assert_allclose(
            inv, np.linalg.inv(pi_damped_kron(a_np, g_np, LAM, float(t))), rtol=1e-7, atol=1e-9
        )


def _depthwise_reference(p, g, kh, kw, c, m, lam, t, damped):
    """Per-channel R (A_c (x) G_c), placed at canonical indices by loops."""
    k = kh * kw
    p4 = p.reshape(p.shape[0], p.shape[1], k, c)
    g4 = g.reshape(g.shape[0], -1, c, m)
    n = k * c * m + c * m
    full = np.zeros((n, n))
    for ch in range(c):
        a_c = cov(homog(p4[..., ch]))
        g_c = cov(g4[:, :, ch, :])
        blk = pi_damped_kron(a_c, g_c, lam, t) if damped else t * np.kron(a_c, g_c)
        idx = [
            ((j * c + ch) * m + mm) if j < k else (k * c * m + ch * m + mm)
            for j in range(k + 1)
            for mm in range(m)
        ]
        full[np.ix_(idx, idx)] = blk
    return full


@pytest.mark.parametrize("case", [CONV_CASES[0], CONV_CASES[2], CONV_CASES[3]])
def test_depthwise_kronecker_against_hand_patches(case):
    rng = np.random.default_rng(6)
    x, p, (oh, ow), attrs, to_fmt = _conv_setup(rng, *case)
    g = rng.normal(size=(2, oh, ow, 4))
    block = fisher.DepthwiseConvKroneckerBlock([(2, 3, 2, 2), (4,)], attrs, **KW)
    block.update([(tf.constant(to_fmt(x)), tf.constant(to_fmt(g)))])
    t = float(oh * ow)
    np.testing.assert_allclose(
        block.full_matrix(), _depthwise_reference(p, g, 2, 3, 2, 2, LAM, t, False), atol=1e-11
    )
    damped = _depthwise_reference(p, g, 2, 3, 2, 2, LAM, t, True)
    if case == CONV_CASES[0]:
        assert_all_products(block, damped)
    else:
        block.update_inverses()
        np.testing.assert_allclose(
            operator_matrix(block.multiply_inverse, block.var_shapes),
            np.linalg.inv(damped),
            rtol=1e-7,
            atol=1e-9,
        )


def test_conv_multi_use_independent():
    rng = np.random.default_rng(11)
    attrs = dict(strides=[1, 1, 1, 1], padding="VALID")
    xs = [rng.normal(size=(2, 3, 3, 1)) for _ in range(2)]
    gs = [rng.normal(size=(2, 2, 2, 2)) for _ in range(2)]
    block = fisher.ConvMultiIndepBlock([(2, 2, 1, 2), (2,)], attrs, num_uses=2, **KW)
    block.update([(tf.constant(x), tf.constant(g)) for x, g in zip(xs, gs)])
    a_np = cov(homog(np.stack([np_patches(x, 2, 2) for x in xs])))
    g_np = cov(np.stack(gs))
    np.testing.assert_allclose(block.full_matrix(), 8 * np.kron(a_np, g_np), atol=1e-12)
    block.update_inverses()
    np.testing.assert_allclose(
        operator_matrix(block.multiply_inverse, block.var_shapes),
        np.linalg.inv(pi_damped_kron(a_np, g_np, LAM, 8.0)),
        rtol=1e-7,
        atol=1e-9,
    )


@hypothesis.settings(max_examples=15, deadline=None, database=None)
@hypothesis.given(
    size=st.tuples(st.integers(3, 6), st.integers(3, 6)),
    kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    stride=st.integers(1, 2),
    dilation=st.integers(1, 2),
    padding=st.sampled_from(["SAME", "VALID"]),
    fmt=st.sampled_from(["NHWC", "NCHW"]),
)
def test_conv_input_factor_property(size, kernel, stride, dilation, padding, fmt):
    """Random geometry: A equals the covariance of hand-cut patches."""
    (h, w), (kh, kw) = size, kernel
    if padding == "VALID" and min(h - (kh - 1) * dilation, w - (kw - 1) * dilation) < 1:
        return
    x = np.random.default_rng(h * w).normal(size=(2, h, w, 2))
    sp = [1, 1, stride, stride] if fmt == "NCHW" else [1, stride, stride, 1]
    dl = [1, 1, dilation, dilation] if fmt == "NCHW" else [1, dilation, dilation, 1]
    spec = ConvSpec.from_attrs(
        (kh, kw, 2, 1), dict(strides=sp, dilations=dl, padding=padding, data_format=fmt),
        has_bias=True)
    factor = fisher.ConvInputFactor(spec, dtype=F64)
    xin = np.transpose(x, [0, 3, 1, 2]) if fmt == "NCHW" else x
    factor.update([tf.constant(xin)], 0.0)
    want = cov(homog(np_patches(x, kh, kw, (stride, stride), (dilation, dilation), padding)))
    np.testing.assert_allclose(factor.value(), want, atol=1e-12)
