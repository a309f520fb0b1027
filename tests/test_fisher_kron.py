"""Kronecker blocks against hand-computed factors and brute force.

References: A and G computed in numpy from patches cut by hand, the damped
block built as R (A + pi r I) (x) (G + r/pi I) in numpy, and the brute-force
Fisher where K-FAC is exact (one example; a linear model with a normal loss).
"""

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest
import tensorflow as tf

from kfac_graph import fisher
from kfac_graph.layers.conv import ConvSpec
from fisher_reference import (
    F64,
    brute_fisher,
    cov,
    homog,
    np_patches,
    operator_matrix,
    out_size,
    pi_damped_kron,
)

LAM = 0.3
KW = dict(dtype=F64, ema_decay=0.0, damping=LAM)


def _check_products(block, damped):
    """multiply / inverse / powers / Cholesky against a damped matrix."""
    shapes = block.var_shapes
    block.update_inverses()
    np.testing.assert_allclose(
        operator_matrix(block.multiply, shapes), damped, rtol=1e-9, atol=1e-10
    )
    inv = operator_matrix(block.multiply_inverse, shapes)
    np.testing.assert_allclose(inv, np.linalg.inv(damped), rtol=1e-7, atol=1e-9)
    half = operator_matrix(lambda v: block.multiply_matpower(v, 0.5), shapes)
    np.testing.assert_allclose(half @ half, damped, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(
        operator_matrix(lambda v: block.multiply_matpower(v, -0.5), shapes),
        np.linalg.inv(half),
        rtol=1e-6,
        atol=1e-8,
    )
    chol = operator_matrix(block.multiply_cholesky, shapes)
    np.testing.assert_allclose(chol @ chol.T, damped, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(
        operator_matrix(lambda v: block.multiply_cholesky(v, True), shapes), chol.T, atol=1e-10
    )
    np.testing.assert_allclose(
        operator_matrix(block.multiply_cholesky_inverse, shapes),
        np.linalg.inv(chol),
        rtol=1e-7,
        atol=1e-9,
    )
    np.testing.assert_allclose(
        operator_matrix(lambda v: block.multiply_cholesky_inverse(v, True), shapes),
        np.linalg.inv(chol.T),
        rtol=1e-7,
        atol=1e-9,
    )
    return chol


# --- where K-FAC is exact -------------------------------------------------------


def test_dense_one_example_and_linear_normal_model_are_exact():
    rng = np.random.default_rng(0)
    params = [tf.Variable(rng.normal(size=(3, 4))), tf.Variable(rng.normal(size=4))]
    h = tf.constant(rng.normal(size=(4, 3)))

    def nonlinear(p, x, tape=None):
        s = tf.matmul(x, p[0]) + p[1]
        return x, s, tf.matmul(tf.tanh(s), h)

    def linear(p, x, tape=None):
        s = tf.matmul(x, p[0]) + p[1]
        return x, s, s

    for parts, dist, batch in ((nonlinear, fisher.Categorical, 1), (linear, fisher.Normal, 5)):
        x = tf.constant(rng.normal(size=(batch, 3)))
        want = brute_fisher(lambda p, xx: parts(p, xx)[2], params, x, lambda z: dist(z).fisher())
        gs = _grads_wrt(parts, params, x, dist)
        block = fisher.FullyConnectedKroneckerBlock([p.shape for p in params], **KW)
        block.update((x, gs))
        np.testing.assert_allclose(block.full_matrix(), want, atol=1e-10)


def _grads_wrt(parts, params, x, dist):
    out = []
    with tf.GradientTape(persistent=True) as tape:
        _, s, z = parts(params, x)
        cols = dist(z).sqrt_fisher_columns()
        us = [tf.reduce_sum(z * tf.stop_gradient(c)) for c in cols]
    for u in us:
        out.append(tape.gradient(u, s))
    return out


@pytest.mark.parametrize("kind", ["conv", "depthwise", "embedding"])
def test_single_location_one_example_is_exact(kind):
    rng = np.random.default_rng(1)
    h = tf.constant(rng.normal(size=(3, 2)))
    attrs = dict(strides=[1, 1, 1, 1], padding="VALID")
    if kind == "conv":
        params = [tf.Variable(rng.normal(size=(2, 2, 2, 3))), tf.Variable(rng.normal(size=3))]
        x = tf.constant(rng.normal(size=(1, 2, 2, 2)))
        op = lambda p, x: tf.nn.conv2d(x, p[0], 1, "VALID") + p[1]
        cls = fisher.ConvKroneckerBlock
    elif kind == "depthwise":
        params = [tf.Variable(rng.normal(size=(2, 2, 1, 3))), tf.Variable(rng.normal(size=3))]
        x = tf.constant(rng.normal(size=(1, 2, 2, 1)))
        op = lambda p, x: tf.nn.depthwise_conv2d(x, p[0], [1] * 4, "VALID") + p[1]
        cls = fisher.DepthwiseConvKroneckerBlock
    else:
        params = [tf.Variable(rng.normal(size=(4, 3)))]
        x = tf.constant([[2]])
        op = lambda p, x: tf.einsum("btv,vd->btd", tf.one_hot(x, 4, dtype=F64), p[0])
        cls = fisher.EmbeddingKroneckerBlock

    def parts(p, x, tape=None):
        s = op(p, x)
        return x, s, tf.matmul(tf.reshape(tf.tanh(s), [x.shape[0], -1]), h)

    want = brute_fisher(
        lambda p, xx: parts(p, xx)[2], params, x, lambda z: fisher.Categorical(z).fisher()
    )
    gs = _grads_wrt(parts, params, x, fisher.Categorical)
    block = cls([p.shape for p in params], attrs, **KW)
    block.update([(x, gs)])
    np.testing.assert_allclose(block.full_matrix(), want, atol=1e-10)


# --- against hand-computed factors ----------------------------------------------


@pytest.mark.parametrize("combine", ["sum", "mean"])
def test_dense_positions_and_sources(combine):
    """Sources add up; a mean over samples is their sum scaled by 1/sqrt(S) each."""
    rng = np.random.default_rng(2)
    a = rng.normal(size=(3, 2, 4))
    gs = [rng.normal(size=(3, 2, 2)) for _ in range(3)]
    block = fisher.FullyConnectedKroneckerBlock([(4, 2), (2,)], **KW)
    weight = len(gs) ** -0.5 if combine == "mean" else 1.0
    block.update([(tf.constant(a), [tf.constant(weight * g) for g in gs])])
    a_np = cov(homog(a))
    g_np = sum(cov(g) for g in gs) / (len(gs) if combine == "mean" else 1)
    np.testing.assert_allclose(block.full_matrix(), 2 * np.kron(a_np, g_np), atol=1e-12)
    _check_products(block, pi_damped_kron(a_np, g_np, LAM, 2.0))


def test_dense_multi_use_independent():
    rng = np.random.default_rng(3)
    uses = [(rng.normal(size=(4, 3)), rng.normal(size=(4, 2))) for _ in range(3)]
    block = fisher.FullyConnectedMultiIndepBlock([(3, 2)], num_uses=3, **KW)
    block.update([(tf.constant(a), tf.constant(g)) for a, g in uses])
    a_np = cov(np.stack([a for a, _ in uses]))
    g_np = cov(np.stack([g for _, g in uses]))
    np.testing.assert_allclose(block.full_matrix(), 3 * np.kron(a_np, g_np), atol=1e-12)
    _check_products(block, pi_damped_kron(a_np, g_np, LAM, 3.0))


@pytest.mark.parametrize("which", ["input", "output"])
def test_dense_diagonal_factor_options(which):
    rng = np.random.default_rng(4)
    a, g = rng.normal(size=(5, 3)), rng.normal(size=(5, 2))
    block = fisher.FullyConnectedKroneckerBlock(
        [(3, 2), (2,)], diagonal_input=which == "input", diagonal_output=which == "output", **KW
    )
    block.update((tf.constant(a), tf.constant(g)))
    a_np, g_np = cov(homog(a)), cov(g)
    if which == "input":
        a_np = np.diag(np.diag(a_np))
    else:
        g_np = np.diag(np.diag(g_np))
    np.testing.assert_allclose(block.full_matrix(), np.kron(a_np, g_np), atol=1e-12)
    _check_products(block, pi_damped_kron(a_np, g_np, LAM, 1.0))


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
        _check_products(block, pi_damped_kron(a_np, g_np, LAM, float(t)))
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
        _check_products(block, damped)
    else:
        block.update_inverses()
        np.testing.assert_allclose(
            operator_matrix(block.multiply_inverse, block.var_shapes),
            np.linalg.inv(damped),
            rtol=1e-7,
            atol=1e-9,
        )


def test_embedding_against_id_counts():
    ids = np.array([[0, 3, 3], [1, 3, 0]])
    rng = np.random.default_rng(7)
    g = rng.normal(size=(2, 3, 2))
    block = fisher.EmbeddingKroneckerBlock([(5, 2)], **KW)
    block.update((tf.constant(ids), tf.constant(g)))
    a_np = np.diag([2, 1, 0, 3, 0]) / 6.0
    g_np = cov(g)
    np.testing.assert_allclose(block.full_matrix(), 3 * np.kron(a_np, g_np), atol=1e-12)
    _check_products(block, pi_damped_kron(a_np, g_np, LAM, 3.0))


def test_full_and_diagonal_block_products():
    rng = np.random.default_rng(8)
    xhat, g = rng.normal(size=(6, 3, 2)), rng.normal(size=(6, 3, 2))
    full = fisher.ScaleAndShiftFullBlock([(2,), (2,)], **KW)
    diag = fisher.ScaleAndShiftDiagonalBlock([(2,), (2,)], **KW)
    for block in (full, diag):
        block.update((tf.constant(xhat), tf.constant(g)))
    grads = np.concatenate([(xhat * g).sum(1), g.sum(1)], axis=1)
    f = grads.T @ grads / 6
    np.testing.assert_allclose(full.full_matrix(), f, atol=1e-12)
    chol = _check_products(full, f + LAM * np.eye(4))
    assert np.allclose(chol, np.tril(chol))
    _check_products(diag, np.diag(np.diag(f)) + LAM * np.eye(4))


def test_dense_and_conv_cholesky_is_lower_triangular():
    rng = np.random.default_rng(9)
    block = fisher.FullyConnectedKroneckerBlock([(2, 3), (3,)], **KW)
    block.update((tf.constant(rng.normal(size=(4, 2))), tf.constant(rng.normal(size=(4, 3)))))
    chol = operator_matrix(block.multiply_cholesky, block.var_shapes)
    np.testing.assert_allclose(chol, np.tril(chol), atol=1e-12)


def test_inverse_uses_snapshot_until_update_inverses():
    rng = np.random.default_rng(10)
    block = fisher.FullyConnectedKroneckerBlock([(2, 2)], **KW)
    batches = [
        (tf.constant(rng.normal(size=(4, 2))), tf.constant(rng.normal(size=(4, 2))))
        for _ in range(2)
    ]
    block.update(batches[0])
    block.update_inverses()
    before = operator_matrix(block.multiply_inverse, block.var_shapes)
    block.update(batches[1])
    np.testing.assert_allclose(operator_matrix(block.multiply_inverse, block.var_shapes), before)
    block.update_inverses()
    after = operator_matrix(block.multiply_inverse, block.var_shapes)
    damped = operator_matrix(block.multiply, block.var_shapes)
    np.testing.assert_allclose(after @ damped, np.eye(4), atol=1e-9)


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


def test_inverse_follows_a_damping_change_until_refreshed():
    """The cached inverses hold the damping of the last refresh; after a change
    ``multiply_inverse`` inverts the current factors with the new damping (and
    ``inverses_stale`` says so) until ``update_inverses`` caches them again."""
    rng = np.random.default_rng(12)
    damping = tf.Variable(LAM, dtype=F64)
    block = fisher.FullyConnectedKroneckerBlock([(3, 2), (2,)], **dict(KW, damping=damping))
    assert bool(block.inverses_stale())  # nothing cached yet
    block.update((tf.constant(rng.normal(size=(5, 3))), tf.constant(rng.normal(size=(5, 2)))))
    block.update_inverses()
    assert not bool(block.inverses_stale())
    cached = block.input_inverse.numpy()
    damping.assign(0.02)
    assert bool(block.inverses_stale())
    damped = operator_matrix(block.multiply, block.var_shapes)
    np.testing.assert_allclose(operator_matrix(block.multiply_inverse, block.var_shapes),
                               np.linalg.inv(damped), rtol=1e-7, atol=1e-9)
    np.testing.assert_array_equal(block.input_inverse.numpy(), cached)  # nothing written
    block.update_inverses()
    assert not bool(block.inverses_stale())
    np.testing.assert_allclose(operator_matrix(block.multiply_inverse, block.var_shapes),
                               np.linalg.inv(damped), rtol=1e-7, atol=1e-9)


def test_singular_undamped_inverse_is_not_finite_rather_than_an_error():
    """Zero damping on a rank-deficient factor: Cholesky fails, the cached
    inverse is NaN (the optimizer skips such a step), nothing raises."""
    block = fisher.FullyConnectedKroneckerBlock([(3, 2)], **dict(KW, damping=0.0))
    block.update((tf.ones([4, 3], F64), tf.ones([4, 2], F64)))
    block.update_inverses()
    assert not np.isfinite(block.multiply_inverse([tf.ones([3, 2], F64)])[0].numpy()).all()


@pytest.mark.parametrize("diagonal", [False, True])
def test_depthwise_and_diagonal_inverses_after_a_damping_change(diagonal):
    """Batched (per-channel) and diagonal factors take the same cached path."""
    rng = np.random.default_rng(13)
    damping = tf.Variable(LAM, dtype=F64)
    kw = dict(KW, damping=damping)
    if diagonal:
        block = fisher.FullyConnectedKroneckerBlock([(3, 2), (2,)], diagonal_input=True,
                                                    diagonal_output=True, **kw)
        block.update((tf.constant(rng.normal(size=(6, 3))), tf.constant(rng.normal(size=(6, 2)))))
    else:
        attrs = dict(strides=[1, 1, 1, 1], padding="SAME")
        block = fisher.DepthwiseConvKroneckerBlock([(2, 2, 2, 1), (2,)], attrs, **kw)
        block.update((tf.constant(rng.normal(size=(3, 3, 3, 2))),
                      tf.constant(rng.normal(size=(3, 3, 3, 2)))))
    for lam in (LAM, 0.05):
        damping.assign(lam)
        for refresh in (False, True):
            if refresh:
                block.update_inverses()
            damped = operator_matrix(block.multiply, block.var_shapes)
            np.testing.assert_allclose(operator_matrix(block.multiply_inverse, block.var_shapes),
                                       np.linalg.inv(damped), rtol=1e-7, atol=1e-9)


def test_refreshed_inverse_skips_the_staleness_check():
    """``multiply_inverse(vs, refreshed=True)`` reads the caches as they are
    (the optimizer refreshes them first): after a damping change it still
    gives the old damping's inverse, where the checked call follows the change."""
    rng = np.random.default_rng(14)
    damping = tf.Variable(LAM, dtype=F64)
    block = fisher.FullyConnectedKroneckerBlock([(3, 2), (2,)], **dict(KW, damping=damping))
    block.update((tf.constant(rng.normal(size=(5, 3))), tf.constant(rng.normal(size=(5, 2)))))
    block.update_inverses()
    cached = operator_matrix(block.multiply_inverse, block.var_shapes)
    np.testing.assert_allclose(cached, np.linalg.inv(operator_matrix(block.multiply,
                                                                     block.var_shapes)), rtol=1e-7)
    damping.assign(0.02)
    np.testing.assert_allclose(
        operator_matrix(lambda v: block.multiply_inverse(v, refreshed=True), block.var_shapes),
        cached, rtol=1e-12)
    assert not np.allclose(operator_matrix(block.multiply_inverse, block.var_shapes), cached)
