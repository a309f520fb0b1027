"""Factors kept in diagonal blocks (`factor_block_size`), float64.

A full factor of width d over the block size m keeps its c = ceil(d / m)
diagonal blocks of k = ceil(d / c): the block is R (A_bd (x) G) (or with G_bd). The
references are the factors by definition (numpy), cut to their diagonal
blocks by hand, and the unbudgeted estimator's own factors cut the same
way; every product of the block (multiply, inverse, Cholesky and its
inverse, powers) against the damped reference matrix.
"""
import keras
import numpy as np
import pytest
import scipy.linalg
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import fisher
from kfac_graph.fisher.factor_blocks import BlockLayout
from kfac_graph.optimizer import costs
from fisher_reference import F64, cov, homog, operator_matrix, pi_damped_kron

LAM = 0.3
KW = dict(dtype=F64, ema_decay=0.0, damping=LAM)


def _blocks(m, size):
    """``m`` with every entry outside its diagonal blocks of ``size`` zeroed."""
    index = np.arange(len(m)) // size
    return np.where(index[:, None] == index[None, :], m, 0.0)


def test_layout_is_the_fewest_equal_blocks_within_the_budget():
    assert BlockLayout.for_budget(11, 4) == BlockLayout(11, 3, 4)
    assert BlockLayout.for_budget(4609, 2048) == BlockLayout(4609, 3, 1537)
    assert BlockLayout.for_budget(8, 4) == BlockLayout(8, 2, 4)
    assert BlockLayout(11, 3, 4).padding == 1 and BlockLayout(8, 2, 4).padding == 0


@pytest.mark.parametrize("d_in, d_out, size, size_a, size_g", [
    (10, 3, 4, 4, None),   # A: 11 wide, 3 blocks of 4 (one padded row)
    (3, 7, 4, None, 4),    # G: 7 wide, 2 blocks of 4 (one padded row)
    (7, 6, 3, 3, 3),       # both: A 8 wide in 3 of 3, G 6 wide in 2 of 3
    (3, 4, 4, None, None)])  # within the block size: full
def test_dense_block_in_diagonal_blocks(d_in, d_out, size, size_a, size_g):
    rng = np.random.default_rng(0)
    a, g = rng.normal(size=(9, 2, d_in)), rng.normal(size=(9, 2, d_out))
    block = fisher.FullyConnectedKroneckerBlock([(d_in, d_out), (d_out,)],
                                                factor_block_size=size, **KW)
    block.update((tf.constant(a), tf.constant(g)))
    want_a, want_g = cov(homog(a)), cov(g)
    if size_a:
        want_a = _blocks(want_a, size_a)
        assert block.input_factor.blocks.size == size_a and not block.input_factor.diagonal
    if size_g:
        want_g = _blocks(want_g, size_g)
        assert block.output_factor.blocks.size == size_g
    assert (block.input_factor.blocks is None) == (size_a is None)
    assert (block.output_factor.blocks is None) == (size_g is None)
    np.testing.assert_allclose(block.full_matrix(), 2 * np.kron(want_a, want_g), atol=1e-12)
    damped = pi_damped_kron(want_a, want_g, LAM, 2.0)
    shapes = block.var_shapes
    np.testing.assert_allclose(operator_matrix(block.multiply, shapes), damped, rtol=1e-9,
                               atol=1e-10)
    inverse = np.linalg.inv(damped)
    np.testing.assert_allclose(operator_matrix(block.multiply_inverse, shapes), inverse,
                               rtol=1e-7, atol=1e-9)
    block.update_inverses()  # the cached inverses, taken block by block
    np.testing.assert_allclose(
        operator_matrix(lambda vs: block.multiply_inverse(vs, refreshed=True), shapes),
        inverse, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(operator_matrix(lambda vs: block.multiply_matpower(vs, -0.5),
                                               shapes),
                               np.real(scipy.linalg.fractional_matrix_power(damped, -0.5)),
                               rtol=1e-6, atol=1e-8)
    chol = operator_matrix(block.multiply_cholesky, shapes)
    chol_t = operator_matrix(lambda vs: block.multiply_cholesky(vs, transpose=True), shapes)
    np.testing.assert_allclose(chol @ chol.T, damped, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(chol_t, chol.T, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(operator_matrix(block.multiply_cholesky_inverse, shapes),
                               np.linalg.inv(chol), rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(
        operator_matrix(lambda vs: block.multiply_cholesky_inverse(vs, transpose=True), shapes),
        np.linalg.inv(chol).T, rtol=1e-7, atol=1e-9)


def test_conv_input_factor_in_blocks_equals_the_full_factors_blocks():
    rng = np.random.default_rng(1)
    attrs = dict(strides=[1, 1, 1, 1], padding="VALID", data_format="NHWC")
    x = tf.constant(rng.normal(size=(3, 5, 5, 3)))
    g = tf.constant(rng.normal(size=(3, 4, 4, 4)))
    full = fisher.ConvKroneckerBlock([(2, 2, 3, 4), (4,)], attrs, dtype=F64, ema_decay=0.0)
    wide = fisher.ConvKroneckerBlock([(2, 2, 3, 4), (4,)], attrs, factor_block_size=8, **KW)
    for block in (full, wide):
        block.update([(x, g)])
    assert wide.input_factor.blocks == BlockLayout(13, 2, 7)  # 2*2*3 + 1 > 8
    assert wide.output_factor.blocks is None
    want = full.replicas.numpy() * np.kron(_blocks(full.input_factor.value().numpy(), 7),
                                           full.output_factor.value().numpy())
    np.testing.assert_allclose(wide.full_matrix(), want, rtol=1e-10, atol=1e-12)
    # inside XLA too
    vs = [tf.constant(rng.normal(size=s)) for s in wide.var_shapes]
    plain = wide.multiply_inverse(vs)
    compiled = tf.function(wide.multiply_inverse, jit_compile=True)(vs)
    for p, c in zip(plain, compiled):
        np.testing.assert_allclose(c, p, rtol=1e-9)


def test_only_full_ungrouped_factors_within_max_factor_size_take_blocks():
    conv = dict(strides=[1, 1, 1, 1], padding="VALID", data_format="NHWC")
    depthwise = fisher.DepthwiseConvKroneckerBlock([(3, 3, 2, 1), (2,)], conv,
                                                   factor_block_size=4, **KW)
    assert depthwise.input_factor.groups == 2 and depthwise.input_factor.blocks is None
    # over max_factor_size: diagonal, whatever the block size
    dense = fisher.FullyConnectedKroneckerBlock([(9, 3), (3,)], max_factor_size=8,
                                                factor_block_size=4, **KW)
    assert dense.input_factor.diagonal and dense.input_factor.blocks is None
    emb = fisher.EmbeddingKroneckerBlock([(12, 6)], factor_block_size=4, **KW)
    assert emb.input_factor.diagonal and emb.input_factor.blocks is None  # by design
    assert emb.output_factor.blocks == BlockLayout(6, 2, 3)
    series = fisher.FullyConnectedSeriesBlock([(5, 3), (3,)], factor_block_size=2, **KW)
    assert series.input_factor.blocks is None and not series.input_factor.diagonal


def _mlp(rng, width=9):
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    hidden = keras.layers.Dense(width, activation="tanh")
    head = keras.layers.Dense(3)
    x = tf.constant(rng.normal(size=(16, 6)))
    y = tf.constant(rng.integers(0, 3, size=16))

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, head(hidden(x))))

    return loss_fn, x, y


def test_estimator_blocks_equal_the_unbudgeted_factors_cut_to_blocks():
    rng = np.random.default_rng(2)
    loss_fn, x, y = _mlp(rng)
    full = kg.FisherEstimator(loss_fn, estimation_mode="exact", max_factor_size=None)
    wide = kg.FisherEstimator(loss_fn, estimation_mode="exact", max_factor_size=None,
                              factor_block_size=5)
    for est in (full, wide):
        est.update(x, y)
    # hidden: A 7 wide -> 2 blocks of 4, G 9 wide -> 2 blocks of 5; head: A 10 -> 2 of 5
    layouts = [(b.input_factor.blocks, b.output_factor.blocks) for b in wide.blocks]
    assert layouts == [(BlockLayout(7, 2, 4), BlockLayout(9, 2, 5)),
                       (BlockLayout(10, 2, 5), None)]
    for f, w, (la, lg) in zip(full.blocks, wide.blocks, layouts):
        a, g = f.input_factor.value().numpy(), f.output_factor.value().numpy()
        want = f.replicas.numpy() * np.kron(_blocks(a, la.size),
                                            _blocks(g, lg.size) if lg else g)
        np.testing.assert_allclose(w.full_matrix(), want, rtol=1e-10, atol=1e-14)
    text = wide.summary()
    assert "input 7 blocks 2 x 4" in text and "output 9 blocks 2 x 5" in text
    assert "max_factor_size: none; factors kept diagonal for it: none" in text
    names = ", ".join(layer.name for layer in loss_fn.registration(x, y).layers)
    assert "factor_block_size: 5; factors kept in diagonal blocks for it: " + names in text
    assert "factor_block_size" not in full.summary()
    # memory: hidden's statistics A 2x4x4 and G 2x5x5, each with a debiasing
    # weight, and the block's replica count; its inverses the same blocks and a damping
    hidden = wide.memory()["layers"][0]
    assert hidden["factors_bytes"] == (32 + 1 + 50 + 1 + 1) * 8
    assert hidden["inverses_bytes"] == (32 + 50 + 1) * 8


def test_costs_count_blocks():
    rng = np.random.default_rng(3)
    loss_fn, x, y = _mlp(rng)
    est = kg.FisherEstimator(loss_fn, factor_block_size=5)
    reg = est.build(x, y)
    hidden = costs.layer_costs(reg, est.blocks, 16)[0]
    # A: 7 wide in blocks of 4, G: 9 wide in blocks of 5; 16 rows
    assert hidden.precondition == 7 * 4 * 9 + 7 * 9 * 5
    assert hidden.inverse == pytest.approx((2 * 4 ** 3 + 2 * 5 ** 3) / costs.FACTORISATION_RATE)
    assert hidden.statistics == 16 * (7 * 4 + 9 * 5) + 2 * hidden.forward


def test_kfac_trains_with_factors_in_blocks():
    rng = np.random.default_rng(4)
    loss_fn, x, y = _mlp(rng)
    opt = kg.KFAC(loss_fn, damping=1e-2, momentum_type="regular", learning_rate=0.2,
                  factor_block_size=5, inverse_update_period=2)
    losses = [float(opt.step(x, y)) for _ in range(15)]
    assert losses[-1] < 0.7 * losses[0] and int(opt.skipped_steps) == 0
    assert opt.estimator.blocks[0].input_factor.blocks == BlockLayout(7, 2, 4)
    assert "blocks 2 x 4" in opt.summary()


def test_padded_rows_keep_the_blocks_invertible_at_zero_damping():
    rng = np.random.default_rng(5)
    a, g = rng.normal(size=(40, 6)), rng.normal(size=(40, 2))  # A: 7 wide, blocks of 4
    block = fisher.FullyConnectedKroneckerBlock([(6, 2), (2,)], factor_block_size=4,
                                                dtype=F64, ema_decay=0.0, damping=0.0)
    block.update((tf.constant(a), tf.constant(g)))
    value = block.input_factor.value().numpy()
    assert value[1, 3, 3] == 1.0 and value[1, 3, :3].tolist() == [0.0] * 3
    want_a, want_g = _blocks(cov(homog(a)), 4), cov(g)
    assert float(block.input_factor.trace()) == pytest.approx(np.trace(want_a), rel=1e-12)
    np.testing.assert_allclose(operator_matrix(block.multiply_inverse, block.var_shapes),
                               np.linalg.inv(np.kron(want_a, want_g)), rtol=1e-7)
