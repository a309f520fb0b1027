"""The factor size budget (`max_factor_size`) and the memory report, float64.

A factor wider than the budget keeps its diagonal and the block's other
factor stays full: the block is R (A (x) diag(G)) (or diag(A) (x) G). The
references are the factors by definition (numpy) and, through the
estimator, the unbudgeted estimator's own factors with one of them cut to
its diagonal. Memory: element counts times 8 bytes, counted by hand.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import fisher
from kfac_graph.fisher import report
from fisher_reference import F64, cov, homog, operator_matrix, pi_damped_kron

LAM = 0.3
KW = dict(dtype=F64, ema_decay=0.0, damping=LAM)


def _diag(m):
    return np.diag(np.diag(m))


@pytest.mark.parametrize("d_in, d_out, budget, wide", [
    (4, 3, 4, "input"), (2, 4, 3, "output"), (4, 3, 2, "both"), (4, 3, None, "none"),
    (4, 3, 5, "none")])
def test_dense_block_keeps_wide_factors_diagonal(d_in, d_out, budget, wide):
    rng = np.random.default_rng(0)
    a, g = rng.normal(size=(7, 2, d_in)), rng.normal(size=(7, 2, d_out))
    block = fisher.FullyConnectedKroneckerBlock([(d_in, d_out), (d_out,)],
                                                max_factor_size=budget, **KW)
    block.update((tf.constant(a), tf.constant(g)))
    want_a, want_g = cov(homog(a)), cov(g)  # widths d_in + 1 and d_out
    if wide in ("input", "both"):
        want_a = _diag(want_a)
    if wide in ("output", "both"):
        want_g = _diag(want_g)
    assert block.input_factor.wide == (wide in ("input", "both"))
    assert block.output_factor.wide == (wide in ("output", "both"))
    np.testing.assert_allclose(block.full_matrix(), 2 * np.kron(want_a, want_g), atol=1e-12)
    block.update_inverses()
    damped = pi_damped_kron(want_a, want_g, LAM, 2.0)
    np.testing.assert_allclose(operator_matrix(block.multiply, block.var_shapes), damped,
                               rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(operator_matrix(block.multiply_inverse, block.var_shapes),
                               np.linalg.inv(damped), rtol=1e-7, atol=1e-9)


def test_conv_and_embedding_blocks_respect_the_budget():
    rng = np.random.default_rng(1)
    attrs = dict(strides=[1, 1, 1, 1], padding="VALID", data_format="NHWC")
    conv = fisher.ConvKroneckerBlock([(2, 2, 3, 4), (4,)], attrs, max_factor_size=8, **KW)
    assert (conv.input_factor.wide, conv.output_factor.wide) == (True, False)  # 13 > 8 >= 4
    emb = fisher.EmbeddingKroneckerBlock([(6, 5)], max_factor_size=4, **KW)
    assert (emb.input_factor.diagonal, emb.input_factor.wide) == (True, False)  # by design
    assert emb.output_factor.wide
    ids = tf.constant(rng.integers(0, 6, size=(4, 3)))
    g = rng.normal(size=(4, 3, 5))
    emb.update([(ids, tf.constant(g))])
    counts = np.bincount(ids.numpy().ravel(), minlength=6) / 12
    want = 3 * np.kron(np.diag(counts), _diag(cov(g)))
    np.testing.assert_allclose(emb.full_matrix(), want, atol=1e-12)


def _lm(rng, vocab=12, width=4):
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    embed = keras.layers.Embedding(vocab, width)
    hidden = keras.layers.Dense(width, activation="tanh")
    head = keras.layers.Dense(vocab)
    ids = tf.constant(rng.integers(0, vocab, size=(3, 5)))

    @kg.auto_register
    def loss_fn(ids, targets):
        logits = head(hidden(embed(ids)))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits))

    return loss_fn, ids, tf.roll(ids, -1, axis=1)


def test_estimator_head_over_budget_gets_a_diagonal_output_factor():
    rng = np.random.default_rng(2)
    loss_fn, ids, targets = _lm(rng)
    full = kg.FisherEstimator(loss_fn, estimation_mode="exact", max_factor_size=None)
    wide = kg.FisherEstimator(loss_fn, estimation_mode="exact", max_factor_size=10)
    for est in (full, wide):
        est.update(ids, targets)
    head_full, head_wide = full.blocks[-1], wide.blocks[-1]
    assert head_wide.output_factor.wide and not head_wide.input_factor.wide
    a = head_full.input_factor.value().numpy()
    g = head_full.output_factor.value().numpy()
    want = head_full.replicas.numpy() * np.kron(a, _diag(g))
    np.testing.assert_allclose(head_wide.full_matrix(), want, rtol=1e-10, atol=1e-14)
    for i in range(2):  # the other layers are as without the budget
        np.testing.assert_allclose(wide.blocks[i].full_matrix(), full.blocks[i].full_matrix(),
                                   rtol=1e-10)
    text = wide.summary()
    assert "output 12 diagonal (wide)" in text
    assert "max_factor_size: 10; factors kept diagonal for it: " + loss_fn.registration(
        ids, targets).layers[-1].name in text
    assert "factors kept diagonal for it: none" in full.summary()


def test_memory_report_counts_bytes():
    rng = np.random.default_rng(3)
    loss_fn, ids, targets = _lm(rng)
    est = kg.FisherEstimator(loss_fn, max_factor_size=10)
    est.build(ids, targets)
    report = est.memory()
    by_kind = {r["kind"] + str(i): r for i, r in enumerate(report["layers"])}
    embed, hidden, head = (by_kind["embedding0"], by_kind["dense1"], by_kind["dense2"])
    # embedding 12x4: diag A [12], G 4x4; each factor: its average, one debiasing weight;
    # the block's replica count; inverses: one per factor and the damping they were made for
    assert embed["parameters"] == 48 * 8
    assert embed["factors_bytes"] == (12 + 1 + 16 + 1 + 1) * 8
    assert embed["inverses_bytes"] == (12 + 16 + 1) * 8
    assert hidden["parameters"] == 20 * 8
    assert hidden["factors_bytes"] == (25 + 1 + 16 + 1 + 1) * 8
    assert hidden["inverses_bytes"] == (25 + 16 + 1) * 8
    # head 4x12 + 12: A 5x5, G over budget: [12]
    assert head["factors"] == [{"label": "input", "dim": 5, "groups": None, "layout": "full"},
                               {"label": "output", "dim": 12, "groups": None,
                                "layout": "diagonal (wide)"}]
    assert head["factors_bytes"] == (25 + 1 + 12 + 1 + 1) * 8
    assert head["inverses_bytes"] == (25 + 12 + 1) * 8
    for key in ("parameters", "factors_bytes", "inverses_bytes"):
        assert report["total"][key] == sum(r[key] for r in report["layers"])
    assert "total" in est.summary() and "inverses mem" in est.summary()


def test_memory_of_full_and_diagonal_blocks():
    full = fisher.NaiveFullBlock([(3, 2)], dtype=F64)
    diag = fisher.ScaleAndShiftDiagonalBlock([(4,), (4,)], dtype=F64)
    # full: factor 6x6 + weight; inverse cache: the damped inverse 6x6 + its damping
    assert report.block_memory(full) == ((36 + 1) * 8, (36 + 1) * 8)
    assert report.block_memory(diag) == ((8 + 1) * 8, 8 * 8)


def test_kfac_takes_the_budget_and_trains():
    rng = np.random.default_rng(5)
    loss_fn, ids, targets = _lm(rng)
    opt = kg.KFAC(loss_fn, damping=1e-2, momentum_type="regular", learning_rate=0.1,
                  max_factor_size=10, inverse_update_period=2)
    losses = [float(opt.step(ids, targets)) for _ in range(10)]
    assert losses[-1] < 0.7 * losses[0]
    assert opt.estimator.max_factor_size == 10 and opt.estimator.blocks[-1].output_factor.wide
    assert opt.memory() == opt.estimator.memory()
    assert "diagonal (wide)" in opt.summary()


@pytest.mark.parametrize("option", ["max_factor_size", "factor_block_size"])
@pytest.mark.parametrize("bad", [0, -3, 2.5, "big", True])
def test_bad_budget_is_one_line(option, bad):
    with pytest.raises(ValueError, match=rf"^kg.FisherEstimator: {option} must be an "
                                         r"integer >= 1, or None, got") as e:
        kg.FisherEstimator(lambda x: x, **{option: bad})
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=f"^kg.KFAC: {option}"):
        kg.KFAC(lambda x: x, **{option: bad})


def test_default_budget():
    est = kg.FisherEstimator(lambda x: x)
    assert est.max_factor_size == 4096 == kg.FisherEstimator.DEFAULT_MAX_FACTOR_SIZE


def test_series_block_over_budget_is_one_line():
    with pytest.raises(ValueError, match=r"^block_0_rnn: the series block needs full factors, "
                                         r"and one of width 6 exceeds max_factor_size \(4\)$"):
        fisher.FullyConnectedSeriesBlock([(5, 3), (3,)], max_factor_size=4, name="block_0_rnn")
    block = fisher.FullyConnectedSeriesBlock([(5, 3), (3,)], max_factor_size=6)
    assert not block.input_factor.diagonal
