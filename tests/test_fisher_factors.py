"""Factors and the debiased moving average, with values written by hand."""

import numpy as np
import pytest
import tensorflow as tf

from kfac_graph import fisher
from kfac_graph.fisher import factors_base, linalg
from kfac_graph.layers import conv_geometry as cg

F64 = tf.float64


def test_dense_input_factor_by_hand():
    """Inputs [[1,2],[3,4]] with a bias, decay 0.5, then [[0,2],[2,0]].

    Batch 1 (rows [1,2,1], [3,4,1]): A1 = [[5,7,2],[7,10,3],[2,3,1]].
    Batch 2 (rows [0,2,1], [2,0,1]): A2 = [[2,0,1],[0,2,1],[1,1,1]].
    Debiased EMA: (0.25 A1 + 0.5 A2) / (1 - 0.25) = (A1 + 2 A2) / 3.
    """
    factor = fisher.DenseInputFactor(2, True, dtype=F64)
    factor.update([tf.constant([[1.0, 2.0], [3.0, 4.0]], F64)], 0.5)
    np.testing.assert_allclose(factor.value(), [[5, 7, 2], [7, 10, 3], [2, 3, 1]])
    factor.update([tf.constant([[0.0, 2.0], [2.0, 0.0]], F64)], 0.5)
    np.testing.assert_allclose(factor.value(), np.array([[9, 7, 4], [7, 14, 5], [4, 5, 3]]) / 3)


def test_block_update_uses_the_same_average():
    block = fisher.FullyConnectedKroneckerBlock([(2, 1), (1,)], dtype=F64, ema_decay=0.5)
    for a in ([[1.0, 2.0], [3.0, 4.0]], [[1.0, 2.0], [3.0, 4.0]]):
        block.update((tf.constant(a, F64), tf.ones([2, 1], F64)))
    np.testing.assert_allclose(block.input_factor.value(), [[5, 7, 2], [7, 10, 3], [2, 3, 1]])
    np.testing.assert_allclose(block.output_factor.value(), [[1.0]])


def test_ema_with_changing_decay():
    ema = fisher.DebiasedEMA([], F64)
    assert ema.value().numpy() == 0.0
    for x, d in ((4.0, 0.9), (1.0, 0.5), (7.0, 0.0)):
        ema.update(tf.constant(x, F64), d)
        if d == 0.9:
            assert ema.value().numpy() == pytest.approx(4.0)
        if d == 0.5:  # weights: 4 -> 0.1*0.5, 1 -> 0.5
            assert ema.value().numpy() == pytest.approx((0.05 * 4 + 0.5) / 0.55)
    assert ema.value().numpy() == pytest.approx(7.0)


def test_output_factor_sources_and_uses():
    g1 = np.array([[1.0, 0.0], [0.0, 2.0]])
    g2 = np.array([[1.0, 1.0], [1.0, 1.0]])
    factor = fisher.OutputFactor(2, dtype=F64)
    factor.update([[tf.constant(g1), tf.constant(g2)]], 0.0)  # two sources add up
    want = g1.T @ g1 / 2 + g2.T @ g2 / 2
    np.testing.assert_allclose(factor.value(), want)
    w = 2 ** -0.5  # the mean over two sources: each scaled by 1/sqrt(2)
    factor.update([[tf.constant(w * g1), tf.constant(w * g2)]], 0.0)
    np.testing.assert_allclose(factor.value(), want / 2)
    factor.update([tf.constant(g1), tf.constant(g2)], 0.0)  # two uses
    np.testing.assert_allclose(factor.value(), (g1.T @ g1 + g2.T @ g2) / 4)


def test_lag_one_by_hand():
    factor = fisher.DenseInputFactor(1, False, lag_one=True, dtype=F64)
    uses = [
        tf.constant([[1.0], [2.0]], F64),
        tf.constant([[3.0], [4.0]], F64),
        tf.constant([[5.0], [6.0]], F64),
    ]
    factor.update(uses, 0.0)
    # C1 = (3*1 + 4*2 + 5*3 + 6*4) / 6 rows; C0 = (1+4+9+16+25+36) / 6.
    np.testing.assert_allclose(factor.lag_one_value(), [[50.0 / 6]])
    np.testing.assert_allclose(factor.value(), [[91.0 / 6]])


def test_embedding_factor_counts_without_one_hot():
    factor = fisher.EmbeddingInputFactor(4, dtype=F64)
    factor.update([tf.constant([[1, 1], [3, 1]]), tf.constant([[0, 0], [0, 0]])], 0.0)
    np.testing.assert_allclose(factor.value(), [4 / 8, 3 / 8, 0, 1 / 8])


def test_diagonal_and_grouped_factors():
    x = np.arange(12.0).reshape(3, 2, 2)  # rows, groups, dim
    full = fisher.CovarianceFactor(2, groups=2, dtype=F64)
    full.update_rows([[tf.constant(x)]], 0.0)
    np.testing.assert_allclose(full.value(), np.einsum("ngi,ngj->gij", x, x) / 3)
    diag = fisher.CovarianceFactor(2, groups=2, diagonal=True, dtype=F64)
    diag.update_rows([[tf.constant(x)]], 0.0)
    np.testing.assert_allclose(diag.value(), (x**2).sum(0) / 3)


def test_conv_geometry_validation():
    kernel = (3, 3, 1, 1)
    with pytest.raises(ValueError, match="padding"):
        cg.ConvAttrs.from_attrs(kernel, {"padding": "CAUSAL"})
    with pytest.raises(ValueError, match="EXPLICIT"):
        cg.ConvAttrs.from_attrs(kernel, {"padding": b"EXPLICIT"})
    g = cg.ConvAttrs.from_attrs(
        kernel, {"strides": [1, 1, 2, 3], "data_format": b"NCHW", "padding": b"SAME"}
    )
    assert g.strides_hw == (2, 3) and g.padding == "SAME"


@pytest.mark.parametrize("rows", [7, 20])  # below and above 4 x the width: copied / border
@pytest.mark.parametrize("diagonal", [False, True])
@pytest.mark.parametrize("grouped", [False, True])
def test_homogeneous_border_equals_appended_ones(diagonal, grouped, rows):
    rng = np.random.default_rng(3)
    shape = (rows, 2, 3) if grouped else (rows, 3)
    uses = [tf.constant(rng.standard_normal(shape)) for _ in range(3)]
    appended = [linalg.append_ones(x) for x in uses]
    for sources in ([uses], [uses, uses[::-1]]):  # one source, two
        appended_sources = [[linalg.append_ones(x) for x in s] for s in sources]
        got = factors_base.second_moment(sources, diagonal, ones=True)
        want = factors_base.second_moment(appended_sources, diagonal)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12)
    if not (diagonal or grouped):
        got = factors_base.lag_one_moment([uses, uses[::-1]], ones=True)
        want = factors_base.lag_one_moment([appended, appended[::-1]])
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12)
