"""``kg.KFAC(spread_covariances=True)``: every step folds in the statistics of
a rotating slice of ``ceil(B / P)`` examples with decay ``d^(1/P)``
(``optimizer/covariance_slices.py``), against an estimator fed those slices
by hand; the slices, the decay, the counted cost, XLA."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph.optimizer import costs, covariance_slices
from passes.errors import KfacGraphError

F64 = tf.float64
BATCH, PERIOD, DECAY = 10, 3, 0.9


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    w1 = tf.Variable(rng.normal(size=(5, 8)) * 0.5)
    b1 = tf.Variable(np.zeros(8))
    w2 = tf.Variable(rng.normal(size=(8, 3)) * 0.5)

    @kg.auto_register
    def loss(x, y):
        h = tf.tanh(x @ w1 + b1)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h @ w2))

    batches = [(tf.constant(rng.normal(size=(BATCH, 5))),
                tf.constant(rng.integers(0, 3, BATCH), tf.int32)) for _ in range(7)]
    return [w1, b1, w2], loss, batches


def test_slices_rotate_over_the_batch_and_the_last_is_clamped():
    x = tf.reshape(tf.range(BATCH * 2), [BATCH, 2])
    y = tf.range(BATCH)
    starts = []
    for k in range(2 * PERIOD):
        sx, sy, scale = covariance_slices.rotating_slice((x, y, 2.0), tf.constant(k), PERIOD)
        assert sx.shape == (4, 2) and sy.shape == (4,) and scale == 2.0
        np.testing.assert_array_equal(sx.numpy()[:, 0] // 2, sy.numpy())
        starts.append(int(sy[0]))
    assert starts == [0, 4, 6] * 2  # n = ceil(10 / 3) = 4; the third slice ends at B
    assert covariance_slices.slice_size(BATCH, PERIOD) == 4
    assert covariance_slices.slice_size(2, 5) == 1


def test_a_period_longer_than_the_batch_cycles_through_its_examples():
    y = tf.range(4)
    got = [int(covariance_slices.rotating_slice((y,), tf.constant(k), 10)[0][0])
           for k in range(12)]
    assert got == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 0, 1]  # k mod 10, then mod 4 slices


def test_slices_of_a_batch_of_unknown_size():
    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32)])
    def cut(y):
        return covariance_slices.rotating_slice((y,), tf.constant(2, tf.int64), PERIOD)[0]

    np.testing.assert_array_equal(cut(tf.range(BATCH)), [6, 7, 8, 9])
    np.testing.assert_array_equal(cut(tf.range(7)), [4, 5, 6])  # n = 3, clamped


def test_the_slice_decay_keeps_a_periods_weight():
    assert covariance_slices.slice_decay(DECAY, PERIOD) ** PERIOD == pytest.approx(DECAY)
    decay = covariance_slices.slice_decay(tf.Variable(DECAY, dtype=F64), PERIOD)
    assert float(decay) ** PERIOD == pytest.approx(DECAY)


def test_no_batch_axis_is_a_one_line_error():
    with pytest.raises(KfacGraphError, match="spread_covariances.*no batch axis"):
        covariance_slices.rotating_slice((tf.constant(1.0),), tf.constant(0), PERIOD)


@pytest.mark.parametrize("momentum_type", ["regular", "qmodel"])
def test_each_step_folds_in_its_slice_as_an_estimator_fed_by_hand(momentum_type):
    """After every step the factors equal those of an estimator that was fed,
    at the same parameters, the step's slice with decay ``d^(1/P)``; the
    parameters move, and differ from the plain schedule's."""
    variables, loss, batches = _problem()
    opt = kg.KFAC(loss, momentum_type=momentum_type, estimation_mode="exact",
                  cov_update_period=PERIOD, inverse_update_period=2, spread_covariances=True,
                  cov_ema_decay=DECAY, damping=1e-2)
    reference = kg.FisherEstimator(loss, estimation_mode="exact",
                                   cov_ema_decay=DECAY ** (1 / PERIOD))
    losses = []
    for k, (x, y) in enumerate(batches):
        start = [0, 4, 6][k % PERIOD]
        reference.update(x[start:start + 4], y[start:start + 4])
        losses.append(float(opt.step(x, y)))
        for got, want in zip(opt.estimator.blocks, reference.blocks):
            np.testing.assert_allclose(got.full_matrix(), want.full_matrix(), rtol=1e-10,
                                       atol=1e-14)
    assert int(opt.skipped_steps) == 0 and losses[-1] < losses[0]

    plain_variables, plain_loss, _ = _problem()
    plain = kg.KFAC(plain_loss, momentum_type=momentum_type, estimation_mode="exact",
                    cov_update_period=PERIOD, inverse_update_period=2, cov_ema_decay=DECAY,
                    damping=1e-2)
    for x, y in batches:
        plain.step(x, y)
    moved = max(float(tf.reduce_max(tf.abs(a - b))) for a, b in zip(variables, plain_variables))
    assert moved > 1e-6


@pytest.mark.parametrize("jit_compile", [  # XLA: test_xla_step_equals_the_plain_tensorflow_step
    False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_slice_every_other_step_is_a_period_of_half_as_many_slices(jit_compile):
    """Period 6 with a slice every 2 steps (the stride an overhead budget
    picks, set here by hand): the even steps fold in slices of ``ceil(10 /
    3) = 4`` examples, the ``k // 2``-th of 3, with decay ``d^(1/3)``; the odd
    steps leave the factors alone."""
    _, loss, batches = _problem(seed=1)
    opt = kg.KFAC(loss, momentum_type="regular", estimation_mode="exact", cov_update_period=6,
                  inverse_update_period=2, spread_covariances=True, cov_ema_decay=DECAY,
                  damping=1e-2, jit_compile=jit_compile)
    opt.build(*batches[0])
    opt.schedule = dataclasses.replace(opt.schedule, slice_stride=2)  # traced at the first step
    assert opt.schedule.slice_steps == 3
    reference = kg.FisherEstimator(loss, estimation_mode="exact", cov_ema_decay=DECAY ** (1 / 3))
    for k, (x, y) in enumerate(batches):
        if k % 2 == 0:
            start = [0, 4, 6][k // 2 % 3]
            reference.update(x[start:start + 4], y[start:start + 4])
        opt.step(x, y)
        for got, want in zip(opt.estimator.blocks, reference.blocks):
            np.testing.assert_allclose(got.full_matrix(), want.full_matrix(), rtol=1e-10,
                                       atol=1e-14)
    assert int(opt.skipped_steps) == 0 and int(opt.iterations) == len(batches)


@pytest.mark.slow  # the spread's steps: the estimator fed by hand (fast)
def test_xla_step_equals_the_plain_tensorflow_step():
    runs = []
    for jit in (False, True):
        variables, loss, batches = _problem(seed=3)
        opt = kg.KFAC(loss, momentum_type="regular", cov_update_period=PERIOD,
                      spread_covariances=True, jit_compile=jit, estimation_mode="exact")
        losses = [float(opt.step(x, y)) for x, y in batches]
        runs.append((losses, [v.numpy() for v in variables]))
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-8)
    for a, b in zip(runs[0][1], runs[1][1]):
        np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-10)


def test_the_counted_step_adds_the_slices_forward_pass():
    _, loss, batches = _problem()
    opt = kg.KFAC(loss, cov_update_period=PERIOD, spread_covariances=True)
    opt.build(*batches[0])
    spread = costs.StepOptions(spread=True)
    forward = sum(c.forward for c in opt.costs)
    extra = (costs.step_multiply_adds(opt.costs, PERIOD, 10, spread)
             - costs.step_multiply_adds(opt.costs, PERIOD, 10))
    assert extra == pytest.approx(forward / PERIOD)
    assert costs.step_multiply_adds(opt.costs, 1, 10, spread) == costs.step_multiply_adds(
        opt.costs, 1, 10)
    assert opt.schedule.spread
    assert not kg.KFAC(loss, cov_update_period=1, spread_covariances=True).schedule.spread


def test_an_overhead_budget_spreads_the_covariances_unless_told_not_to():
    _, loss, _ = _problem()
    assert kg.KFAC(loss, overhead_budget=3.0).spread_covariances
    assert not kg.KFAC(loss, overhead_budget=3.0, spread_covariances=False).spread_covariances
    assert not kg.KFAC(loss).spread_covariances
    with pytest.raises(ValueError, match="spread_covariances must be one of None, True, False"):
        kg.KFAC(loss, spread_covariances=1)
