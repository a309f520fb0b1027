"""Kronecker blocks against hand-computed factors and brute force (the
convolution and depthwise blocks' patches: tests/test_fisher_kron_conv.py).

References: A and G computed in numpy from patches cut by hand, the damped
block built as R (A + pi r I) (x) (G + r/pi I) in numpy, and the brute-force
Fisher where K-FAC is exact (one example; a linear model with a normal loss).
"""

import numpy as np
import pytest
import tensorflow as tf

from kfac_graph import fisher
from fisher_checks import assert_all_products
from fisher_reference import F64, brute_fisher, cov, homog, operator_matrix, pi_damped_kron

LAM = 0.3
KW = dict(dtype=F64, ema_decay=0.0, damping=LAM)


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
    assert_all_products(block, pi_damped_kron(a_np, g_np, LAM, 2.0))


def test_dense_multi_use_independent():
    rng = np.random.default_rng(3)
    uses = [(rng.normal(size=(4, 3)), rng.normal(size=(4, 2))) for _ in range(3)]
    block = fisher.FullyConnectedMultiIndepBlock([(3, 2)], num_uses=3, **KW)
    block.update([(tf.constant(a), tf.constant(g)) for a, g in uses])
    a_np = cov(np.stack([a for a, _ in uses]))
    g_np = cov(np.stack([g for _, g in uses]))
    np.testing.assert_allclose(block.full_matrix(), 3 * np.kron(a_np, g_np), atol=1e-12)
    assert_all_products(block, pi_damped_kron(a_np, g_np, LAM, 3.0))


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
    assert_all_products(block, pi_damped_kron(a_np, g_np, LAM, 1.0))


def test_embedding_against_id_counts():
    ids = np.array([[0, 3, 3], [1, 3, 0]])
    rng = np.random.default_rng(7)
    g = rng.normal(size=(2, 3, 2))
    block = fisher.EmbeddingKroneckerBlock([(5, 2)], **KW)
    block.update((tf.constant(ids), tf.constant(g)))
    a_np = np.diag([2, 1, 0, 3, 0]) / 6.0
    g_np = cov(g)
    np.testing.assert_allclose(block.full_matrix(), 3 * np.kron(a_np, g_np), atol=1e-12)
    assert_all_products(block, pi_damped_kron(a_np, g_np, LAM, 3.0))


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
    chol = assert_all_products(full, f + LAM * np.eye(4))
    assert np.allclose(chol, np.tril(chol))
    assert_all_products(diag, np.diag(np.diag(f)) + LAM * np.eye(4))


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
