"""Full and diagonal blocks against a brute-force Fisher, every layer kind.

Reference: (1/B) sum_i J_i^T F_i J_i with J_i the per-example Jacobian of the
model output w.r.t. the layer's parameters (GradientTape) and F_i the
distribution's closed-form Fisher.  The blocks only see the layer input and
the output gradients for each column of the Fisher square root (exact mode),
or per-example parameter gradients computed one example at a time.
"""

import numpy as np
import pytest
import tensorflow as tf

from kfac_graph import fisher
from fisher_reference import F64, brute_fisher, column_grads_wrt

B = 3


def _const(rng, *shape):
    return tf.constant(rng.normal(size=shape), F64)


def _head(rng, s, k):
    flat_s = tf.reshape(tf.tanh(s), [s.shape[0], -1])
    h = tf.constant(np.random.default_rng(7).normal(size=(flat_s.shape[1], k)), F64)
    return tf.matmul(flat_s, h)


def dense_case(rng):
    params = [tf.Variable(_const(rng, 3, 4)), tf.Variable(_const(rng, 4))]
    x = _const(rng, B, 2, 3)  # two positions per example

    def parts(p, x, tape=None):
        s = tf.einsum("bti,io->bto", x, p[0]) + p[1]
        return x, s, _head(rng, s, 3)

    return dict(
        params=params,
        x=x,
        parts=parts,
        dist=fisher.Categorical,
        attrs=None,
        full=None,
        diag=fisher.FullyConnectedDiagonalBlock,
    )


def dense_single_case(rng):
    params = [tf.Variable(_const(rng, 3, 2)), tf.Variable(_const(rng, 2))]
    x = _const(rng, B, 3)

    def parts(p, x, tape=None):
        s = tf.matmul(x, p[0]) + p[1]
        return x, s, _head(rng, s, 3)

    return dict(
        params=params,
        x=x,
        parts=parts,
        dist=fisher.Bernoulli,
        attrs=None,
        full=None,
        diag=fisher.FullyConnectedDiagonalBlock,
    )


def conv_case(rng, fmt="NHWC", padding="SAME", stride=2, dilation=1):
    params = [tf.Variable(_const(rng, 2, 2, 2, 3)), tf.Variable(_const(rng, 3))]
    x = _const(rng, B, 5, 5, 2)
    pad_arg = padding
    explicit = []
    if padding == "EXPLICIT":
        pad_arg = [[0, 0], [1, 0], [0, 2], [0, 0]]
        explicit = [0, 0, 1, 0, 0, 2, 0, 0]

    # CPU conv gradients lack dilation: dilate the kernel with zeros instead.
    place = np.zeros([(2 - 1) * dilation + 1, 2])
    place[np.arange(2) * dilation, np.arange(2)] = 1.0

    def parts(p, x, tape=None):
        xin = tf.transpose(x, [0, 2, 3, 1]) if fmt == "NCHW" else x
        kernel = tf.einsum("Hh,Ww,hwio->HWio", place, place, p[0])
        s = tf.nn.conv2d(xin, kernel, stride, pad_arg) + p[1]
        if fmt == "NCHW":
            s = tf.transpose(s, [0, 3, 1, 2])
        return x, s, _head(rng, s, 2)

    if fmt == "NCHW":
        x = tf.transpose(x, [0, 3, 1, 2])
        spatial = lambda v: [1, 1, v, v]
        if explicit:
            explicit = [0, 0, 0, 0, 1, 0, 0, 2]
    else:
        spatial = lambda v: [1, v, v, 1]
    attrs = dict(
        strides=spatial(stride),
        dilations=spatial(dilation),
        padding=padding,
        explicit_paddings=explicit,
        data_format=fmt,
    )
    return dict(
        params=params,
        x=x,
        parts=parts,
        dist=fisher.Normal,
        attrs=attrs,
        full=None,
        diag=fisher.ConvDiagonalBlock,
    )


def depthwise_case(rng):
    params = [tf.Variable(_const(rng, 2, 2, 2, 2)), tf.Variable(_const(rng, 4))]
    x = _const(rng, B, 4, 4, 2)

    def parts(p, x, tape=None):
        s = tf.nn.depthwise_conv2d(x, p[0], [1, 1, 1, 1], "SAME") + p[1]
        return x, s, _head(rng, s, 3)

    attrs = dict(strides=[1, 1, 1, 1], padding="SAME", data_format="NHWC")
    return dict(
        params=params,
        x=x,
        parts=parts,
        dist=fisher.Bernoulli,
        attrs=attrs,
        full=None,
        diag=fisher.DepthwiseConvDiagonalBlock,
    )


def scale_shift_case(rng):
    params = [tf.Variable(_const(rng, 1, 3, 1, 1)), tf.Variable(_const(rng, 1, 3, 1, 1))]
    x = _const(rng, B, 3, 2, 2)

    def parts(p, x, tape=None):
        s = p[0] * x + p[1]
        return x, s, _head(rng, s, 3)

    return dict(
        params=params,
        x=x,
        parts=parts,
        dist=fisher.Categorical,
        attrs=None,
        full=fisher.ScaleAndShiftFullBlock,
        diag=fisher.ScaleAndShiftDiagonalBlock,
    )


def scale_only_case(rng):
    params = [tf.Variable(_const(rng, 2))]
    x = _const(rng, B, 3, 2)

    def parts(p, x, tape=None):
        s = p[0] * x
        return x, s, _head(rng, s, 2)

    return dict(
        params=params,
        x=x,
        parts=parts,
        dist=fisher.Normal,
        attrs=None,
        full=fisher.ScaleAndShiftFullBlock,
        diag=fisher.ScaleAndShiftDiagonalBlock,
    )


def embedding_case(rng):
    params = [tf.Variable(_const(rng, 5, 3))]
    x = tf.constant([[0, 2], [2, 2], [4, 1]], tf.int32)

    def parts(p, x, tape=None):
        s = tf.einsum("btv,vd->btd", tf.one_hot(x, 5, dtype=F64), p[0])
        return x, s, _head(rng, s, 3)

    return dict(
        params=params, x=x, parts=parts, dist=fisher.Categorical, attrs=None, full=None, diag=None
    )


CASES = {
    "dense_positions": dense_case,
    "dense": dense_single_case,
    "conv_same_s2": conv_case,
    "conv_nchw_dilated": lambda r: conv_case(r, "NCHW", "VALID", 1, 2),
    "conv_explicit": lambda r: conv_case(r, "NHWC", "EXPLICIT", 1, 1),
    "depthwise": depthwise_case,
    "scale_shift": scale_shift_case,
    "scale_only": scale_only_case,
    "embedding": embedding_case,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_full_and_diagonal_blocks_match_brute_force(name):
    rng = np.random.default_rng(1)
    case = CASES[name](rng)
    params, x, parts, dist = case["params"], case["x"], case["parts"], case["dist"]
    expected = brute_fisher(lambda p, xx: parts(p, xx)[2], params, x, lambda z: dist(z).fisher())
    a, gs, pex = column_grads_wrt(parts, params, x, lambda z: dist(z).sqrt_fisher_columns())
    shapes = [p.shape for p in params]
    kw = dict(dtype=F64, ema_decay=0.0)

    naive_full = fisher.NaiveFullBlock(shapes, **kw)
    naive_full.update(pex)
    np.testing.assert_allclose(naive_full.full_matrix(), expected, atol=1e-10)
    naive_diag = fisher.NaiveDiagonalBlock(shapes, **kw)
    naive_diag.update(pex)
    np.testing.assert_allclose(naive_diag.full_matrix(), np.diag(np.diag(expected)), atol=1e-10)
    for key, want in (("full", expected), ("diag", np.diag(np.diag(expected)))):
        if case[key] is None:
            continue
        block = case[key](shapes, case["attrs"], **kw)
        block.update([(a, gs)])
        np.testing.assert_allclose(block.full_matrix(), want, atol=1e-10)


def test_multi_use_diagonal_is_exact():
    """A dense layer applied twice (shared weights): the diagonal block sums
    the uses' gradients before squaring, so it matches brute force."""
    rng = np.random.default_rng(2)
    params = [tf.Variable(_const(rng, 2, 2)), tf.Variable(_const(rng, 2))]
    x = _const(rng, B, 2)

    def model(p, x):
        h1 = tf.matmul(x, p[0]) + p[1]
        h2 = tf.matmul(tf.tanh(h1), p[0]) + p[1]
        return h1, h2, _head(rng, h2, 3)

    expected = brute_fisher(
        lambda p, xx: model(p, xx)[2], params, x, lambda z: fisher.Categorical(z).fisher()
    )
    with tf.GradientTape(persistent=True) as tape:
        h1, h2, z = model(params, x)
        cols = [tf.stop_gradient(c) for c in fisher.Categorical(z).sqrt_fisher_columns()]
        us = [tf.reduce_sum(z * c) for c in cols]
    g1 = [tape.gradient(u, h1, unconnected_gradients="zero") for u in us]
    g2 = [tape.gradient(u, h2) for u in us]
    # Use 1: input x, output h1 (whose gradient flows through use 2);
    # use 2: input tanh(h1), output h2.
    block = fisher.FullyConnectedDiagonalBlock([p.shape for p in params], dtype=F64)
    block.update([(x, g1), (tf.tanh(h1), g2)])
    np.testing.assert_allclose(block.full_matrix(), np.diag(np.diag(expected)), atol=1e-10)
