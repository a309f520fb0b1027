"""Series (RNN) blocks, options 1 and 2, against their defining sums.

On a small unrolled RNN (s_t = h_t W + b, h_{t+1} = tanh(s_t + x_t)), the
moments C0 and the lag-one C1 are computed in numpy, the lag-d moments as
M_d = (C1 C0^{-1})^d C0 (M_{-d} = M_d^T), and the Fisher as explicit sums
of Kronecker products: option 1 sum_{|d|<T} (T-|d|) M^A_d (x) M^G_d with C1
symmetrised; option 2 T sum_{|d|<=D} M^A_d (x) M^G_d truncated far out.
"""

import numpy as np
import pytest
import tensorflow as tf

from kfac_graph import fisher
from fisher_reference import F64, operator_matrix

LAM, STEPS, B = 0.05, 3, 6


def _rnn_data():
    rng = np.random.default_rng(0)
    w = tf.constant(rng.normal(size=(3, 3)) * 0.8)
    b = tf.constant(rng.normal(size=3) * 0.1)
    xs = [tf.constant(rng.normal(size=(B, 3))) for _ in range(STEPS + 1)]
    h_out = tf.constant(rng.normal(size=(3, 4)))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([w, b])
        h, hs, ss = xs[0], [], []
        for t in range(STEPS):
            s = tf.matmul(h, w) + b
            hs.append(h)
            ss.append(s)
            h = tf.tanh(s + xs[t + 1])
        z = tf.matmul(h, h_out)
        cols = fisher.Categorical(z).sqrt_fisher_columns()
        us = [tf.reduce_sum(z * tf.stop_gradient(c)) for c in cols]
    gs = [[tape.gradient(u, s) for u in us] for s in ss]
    return hs, gs


def _moments(seq):
    """seq: [T, N, d] -> (C0, C1) normalised by all T*N rows."""
    t, n, _ = seq.shape
    c0 = np.einsum("tni,tnj->ij", seq, seq) / (t * n)
    c1 = np.einsum("tni,tnj->ij", seq[1:], seq[:-1]) / (t * n)
    return c0, c1


def _factor_moments(hs, gs):
    a = np.stack([np.concatenate([h.numpy(), np.ones((B, 1))], 1) for h in hs])
    a0, a1 = _moments(a)
    g0 = g1 = 0
    for col in range(len(gs[0])):
        m0, m1 = _moments(np.stack([g[col].numpy() for g in gs]))
        g0, g1 = g0 + m0, g1 + m1
    return a0, a1, g0, g1


def _lag(c0, c1, d):
    m = np.linalg.matrix_power(c1 @ np.linalg.inv(c0), abs(d)) @ c0
    return m if d >= 0 else m.T


def _series(a0, a1, g0, g1, option, terms=400):
    if option == 1:
        a1, g1 = (a1 + a1.T) / 2, (g1 + g1.T) / 2
        ds = range(-(STEPS - 1), STEPS)
        weight = lambda d: STEPS - abs(d)
    else:
        ds = range(-terms, terms + 1)
        weight = lambda d: STEPS
    return sum(weight(d) * np.kron(_lag(a0, a1, d), _lag(g0, g1, d)) for d in ds)


def _damp(a0, g0):
    r = np.sqrt(LAM / STEPS)
    pi = np.sqrt((np.trace(a0) / len(a0)) / (np.trace(g0) / len(g0)))
    return a0 + pi * r * np.eye(len(a0)), g0 + r / pi * np.eye(len(g0))


@pytest.mark.parametrize("option", [1, 2])
def test_series_block_matches_its_formula(option):
    hs, gs = _rnn_data()
    a0, a1, g0, g1 = _factor_moments(hs, gs)
    block = fisher.FullyConnectedSeriesBlock(
        [(3, 3), (3,)], option=option, num_uses=STEPS, damping=LAM, ema_decay=0.0, dtype=F64
    )
    block.update(list(zip(hs, gs)))
    np.testing.assert_allclose(block.input_factor.lag_one_value(), a1, atol=1e-12)
    np.testing.assert_allclose(block.output_factor.lag_one_value(), g1, atol=1e-12)
    a0d, g0d = _damp(a0, g0)
    damped = _series(a0d, a1, g0d, g1, option)
    block.update_inverses()
    inv = operator_matrix(block.multiply_inverse, block.var_shapes)
    np.testing.assert_allclose(inv @ damped, np.eye(12), atol=1e-7)
    undamped = _series(a0, a1, g0, g1, option, terms=3000)
    np.testing.assert_allclose(block.full_matrix(), undamped, rtol=1e-6, atol=1e-8)
    if option == 1:
        np.testing.assert_allclose(
            operator_matrix(block.multiply, block.var_shapes), damped, rtol=1e-8, atol=1e-10
        )
    else:
        with pytest.raises(
            NotImplementedError, match="FullyConnectedSeriesBlock.multiply_matpower"
        ):
            block.multiply([tf.zeros([3, 3], F64), tf.zeros([3], F64)])
    with pytest.raises(NotImplementedError, match="FullyConnectedSeriesBlock.multiply_cholesky"):
        block.multiply_cholesky([tf.zeros([3, 3], F64), tf.zeros([3], F64)])


def test_series_option1_with_no_time_correlation_is_independent_block():
    """With C1 = 0 both options reduce to T (A (x) G) (the independent block)."""
    rng = np.random.default_rng(1)
    a = rng.normal(size=(4, 2))
    g = rng.normal(size=(4, 2))
    zeros = np.zeros_like(a)
    # Alternate a use with zeros so the lag-one moments vanish exactly.
    uses = [(tf.constant(a), tf.constant(g)), (tf.constant(zeros), tf.constant(zeros))]
    for option in (1, 2):
        series = fisher.FullyConnectedSeriesBlock(
            [(2, 2)], option=option, num_uses=2, dtype=F64, ema_decay=0.0, damping=LAM
        )
        indep = fisher.FullyConnectedMultiIndepBlock(
            [(2, 2)], num_uses=2, dtype=F64, ema_decay=0.0, damping=LAM
        )
        for block in (series, indep):
            block.update(uses)
            block.update_inverses()
        np.testing.assert_allclose(
            operator_matrix(series.multiply_inverse, series.var_shapes),
            operator_matrix(indep.multiply_inverse, indep.var_shapes),
            atol=1e-10,
        )
