"""``kg.KFAC(overhead_budget=...)``: the multiply-adds counted per layer
(``optimizer/costs.py``) against hand counts, the periods the budget picks,
explicit periods winning, and the summary."""
import dataclasses
import logging

import keras
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph.optimizer import costs, plan


def _mlp(batch=32, widths=(20, 50, 10)):
    """Dense layers of ``widths`` (tanh between them) under a softmax loss."""
    keras.utils.set_random_seed(0)
    hidden = [keras.layers.Dense(w, activation="tanh") for w in widths[1:-1]]
    model = keras.Sequential([keras.Input((widths[0],)), *hidden,
                              keras.layers.Dense(widths[-1])])
    x = tf.random.normal([batch, widths[0]])
    y = tf.random.uniform([batch], 0, widths[-1], tf.int32)

    @kg.auto_register
    def loss(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    return loss, (x, y)


def _cnn(batch=4):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 3)),
                              keras.layers.Conv2D(6, 3, strides=2, padding="same"),
                              keras.layers.Flatten(), keras.layers.Dense(5)])
    x = tf.random.normal([batch, 8, 8, 3])
    y = tf.random.uniform([batch], 0, 5, tf.int32)

    @kg.auto_register
    def loss(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    return loss, (x, y)


def test_dense_counts_match_hand_counts():
    loss, args = _mlp()
    opt = kg.KFAC(loss, momentum_type="regular", adapt_damping=False)
    opt.build(*args)
    first, second = opt.costs
    b = 32
    assert first.forward == b * 20 * 50 and second.forward == b * 50 * 10
    # A: 21x21, G: 50x50 over B rows (one sample), plus the sample's backward pass
    assert first.statistics == b * (21 ** 2 + 50 ** 2) + 2 * b * 20 * 50
    assert first.precondition == 21 ** 2 * 50 + 21 * 50 ** 2
    assert first.inverse == pytest.approx((21 ** 3 + 50 ** 3) / costs.FACTORISATION_RATE)
    assert second.inverse == pytest.approx((51 ** 3 + 10 ** 3) / costs.FACTORISATION_RATE)


def test_conv_counts_per_location():
    loss, args = _cnn()
    opt = kg.KFAC(loss, momentum_type="regular", adapt_damping=False)
    opt.build(*args)
    conv = opt.costs[0]
    rows = 4 * 4 * 4  # batch x 4x4 output locations
    assert conv.forward == rows * 6 * (3 * 3 * 3)
    assert conv.statistics == rows * (28 ** 2 + 6 ** 2) + 2 * conv.forward
    assert conv.inverse == pytest.approx((28 ** 3 + 6 ** 3) / costs.FACTORISATION_RATE)


def test_budget_picks_the_smallest_periods_within_it():
    loss, args = _cnn(batch=32)
    opt = kg.KFAC(loss, momentum_type="regular", adapt_damping=False, overhead_budget=3.0)
    opt.build(*args)
    choice = opt.period_choice
    assert choice.within and choice.ratio <= 3.0
    assert (opt.cov_update_period, opt.inverse_update_period) == (
        choice.cov_update_period, choice.inverse_update_period)
    # a budget spreads the covariances by default: slices of the 32 examples count
    options = costs.StepOptions(qmodel=None, damping_interval=None, spread=True, batch=32)
    stride = lambda c, i: costs.choose_stride(opt.costs, c, i, options)  # noqa: E731
    assert opt.schedule.slice_stride == choice.slice_stride == stride(
        opt.cov_update_period, opt.inverse_update_period)
    assert plan.cost_options(opt) == dataclasses.replace(options, slice_stride=choice.slice_stride)
    ratio = lambda c, i: (costs.step_multiply_adds(  # noqa: E731
        opt.costs, c, i, dataclasses.replace(options, slice_stride=stride(c, i)))
        / costs.sgd_multiply_adds(opt.costs))
    assert ratio(opt.cov_update_period, opt.inverse_update_period) == pytest.approx(choice.ratio)
    # every pair tried before the chosen one (the inverse period first) is over the budget
    chosen = (opt.cov_update_period, opt.inverse_update_period)
    tried = [(c, i) for i in costs.INVERSE_PERIODS for c in costs.COV_PERIODS]
    assert chosen in tried
    for c, i in tried[:tried.index(chosen)]:
        assert ratio(c, i) > 3.0, (c, i)
    assert opt.schedule.inverse_update_period == opt.inverse_update_period
    assert "overhead_budget=3: periods chosen by the budget, within" in opt.cost_summary()


def test_explicit_periods_win_and_tight_budgets_say_so(caplog):
    loss, args = _cnn()
    opt = kg.KFAC(loss, overhead_budget=1.01, inverse_update_period=7)
    with caplog.at_level(logging.WARNING):
        opt.build(*args)
    warnings = [r.getMessage() for r in caplog.records if "overhead_budget=1.01" in r.getMessage()]
    assert len(warnings) == 1 and "no periods tried are within it" in warnings[0]
    assert f"periods {opt.cov_update_period}/7" in warnings[0]
    assert opt.inverse_update_period == 7 and not opt.period_choice.within
    # spread over 4 examples with a slice at least every 7 steps: one example
    # every 5 steps from period 20 on; the freshest of the cheapest
    assert (opt.cov_update_period, opt.schedule.slice_stride) == (20, 5)
    assert "NOT within" in opt.cost_summary()
    assert max(opt.schedule.inverse_slots) < 7


def test_budget_picks_the_other_period_around_a_given_one():
    loss, args = _cnn(batch=32)
    free = kg.KFAC(loss, momentum_type="regular", adapt_damping=False, overhead_budget=3.0)
    free.build(*args)
    given = kg.KFAC(loss, momentum_type="regular", adapt_damping=False, overhead_budget=3.0,
                    cov_update_period=10)
    given.build(*args)
    choice = given.period_choice
    assert given.cov_update_period == choice.cov_update_period == 10
    options = plan.cost_options(given)
    ratio = lambda i: (costs.step_multiply_adds(given.costs, 10, i, options)
                       / costs.sgd_multiply_adds(given.costs))
    assert ratio(given.inverse_update_period) == pytest.approx(choice.ratio)
    smaller = [i for i in costs.INVERSE_PERIODS if i < given.inverse_update_period]
    assert choice.within and all(ratio(i) > 3.0 for i in smaller)
    # the free choice found an inverse period at least as small around a longer cov period
    assert free.inverse_update_period <= given.inverse_update_period


def test_spread_slices_count_their_examples_not_one_period_share():
    # a slice is ceil(B / P) examples: a period longer than the batch still
    # takes one example a step
    spread = lambda batch: costs.StepOptions(spread=True, batch=batch)  # noqa: E731
    assert costs.covariance_share(10, spread(4)) == 0.25
    assert costs.covariance_share(4, spread(4)) == 0.25
    assert costs.covariance_share(2, spread(5)) == 0.6
    assert costs.covariance_share(10, spread(None)) == 0.1  # batch unknown
    assert costs.covariance_share(10, costs.StepOptions(batch=4)) == 0.1  # not spread
    assert costs.covariance_share(1, spread(4)) == 1.0
    loss, args = _cnn()
    opt = kg.KFAC(loss, momentum_type="regular", adapt_damping=False)
    opt.build(*args)
    f = sum(c.forward for c in opt.costs)
    stats = sum(c.statistics for c in opt.costs)
    fixed = 3 * f + sum(c.precondition for c in opt.costs) + sum(c.inverse for c in opt.costs)
    options = dataclasses.replace(plan.cost_options(opt), spread=True, qmodel=None,
                                  damping_interval=None)
    assert options.batch == 4
    for period in (5, 10, 100):  # one example of four a step: a quarter of a batch pass
        assert costs.step_multiply_adds(opt.costs, period, 1, options) == pytest.approx(
            fixed + (stats + f) / 4)


def test_spread_slices_take_the_largest_stride_whose_slice_steps_stay_within_half_a_step():
    loss, args = _cnn(batch=32)
    opt = kg.KFAC(loss, momentum_type="regular", adapt_damping=False)
    opt.build(*args)
    options = costs.StepOptions(qmodel=None, damping_interval=None, spread=True, batch=32)
    per_example = sum(c.statistics + c.forward for c in opt.costs) / 32

    def within(period, stride):  # a slice step's extra work against the amortised step
        at = dataclasses.replace(options, slice_stride=stride)
        extra = per_example * costs.slice_examples(period, at)
        return extra <= 0.5 * costs.step_multiply_adds(opt.costs, period, 10, at)

    strides = {}
    for period in (2, 10, 20, 50, 100):
        stride = strides[period] = costs.choose_stride(opt.costs, period, 10, options)
        assert period % stride == 0 and stride < period
        assert within(period, stride) or stride == 1
        assert stride <= 10  # at least a slice per inverse period
        assert not any(within(period, s) for s in costs.slice_strides(period)
                       if stride < s <= 10)
    assert strides[2] == 1 and strides[100] > 1, strides
    assert costs.choose_stride(opt.costs, 100, 1, options) == 1
    assert costs.slice_strides(20) == [10, 5, 4, 2, 1]
    assert costs.choose_stride(opt.costs, 20, 10, dataclasses.replace(options, spread=False)) == 1


def test_without_spreading_the_inverse_period_is_a_multiple_of_the_cov_period():
    loss, args = _cnn()
    opt = kg.KFAC(loss, momentum_type="regular", adapt_damping=False, overhead_budget=2.0,
                  spread_covariances=False)
    opt.build(*args)
    assert opt.inverse_update_period % opt.cov_update_period == 0


def test_budgeted_optimizer_trains():
    loss, args = _mlp()
    opt = kg.KFAC(loss, momentum_type="regular", adapt_damping=False, learning_rate=0.05,
                  overhead_budget=1.5)
    first = float(opt.step(*args))
    assert opt.cov_update_period > 1 or opt.inverse_update_period > 10
    for _ in range(15):
        opt.step(*args)
    assert float(loss(*args)) < 0.8 * first


def test_cost_summary_needs_a_build():
    loss, _ = _mlp()
    with pytest.raises(ValueError, match="not built"):
        kg.KFAC(loss).cost_summary()



def _wide_mlp():
    """One dense layer whose preconditioning (1.6 SGD steps with full 601 x
    601 and 600 x 600 factors) keeps every period pair over budget 2."""
    return _mlp(batch=256, widths=(600, 600))


def test_budget_puts_wide_factors_in_blocks_when_periods_are_not_enough():
    from kfac_graph.fisher.factor_blocks import BlockLayout
    from kfac_graph.optimizer import plan
    loss, args = _wide_mlp()
    whole = kg.KFAC(loss, momentum_type="regular", adapt_damping=False)
    whole.build(*args)
    full = kg.KFAC(loss, momentum_type="regular", adapt_damping=False, overhead_budget=2.0)
    full.build(*args)
    options = plan.cost_options(full)
    sgd = costs.sgd_multiply_adds(whole.costs)
    longest = costs.step_multiply_adds(whole.costs, costs.COV_PERIODS[-1],
                                       costs.INVERSE_PERIODS[-1], options) / sgd
    assert longest > 2.0  # periods alone cannot meet it
    assert whole.costs[0].precondition == 601 ** 2 * 600 + 601 * 600 ** 2
    assert full.costs[0].precondition == 601 * 301 * 600 + 601 * 600 * 300
    choice = full.period_choice
    # 2048 and 1024 change nothing (no factor is wider), 512 is the largest within
    assert choice.within and choice.factor_block_size == 512
    assert full.estimator.factor_block_size == 512
    block = full.estimator.blocks[0]
    assert (block.input_factor.blocks, block.output_factor.blocks) == (
        BlockLayout(601, 2, 301), BlockLayout(600, 2, 300))
    # the counts are the new blocks' own, and the state the optimizer tracks theirs
    recount = costs.layer_costs(full.registration, full.estimator.blocks, 256)
    assert recount == full.costs
    assert {v.ref() for v in full.estimator_state} == {v.ref() for v in
                                                      full.estimator.variables}
    assert any(v.ref() in {w.ref() for w in full.estimator_state}
               for v in block.input_factor.variables)
    assert "factors in diagonal blocks of at most 512 chosen by the budget, within" in (
        full.cost_summary())
    assert "factor_block_size: 512" in full.summary()
    first = float(full.step(*args))
    for _ in range(5):
        full.step(*args)
    assert float(loss(*args)) < first and int(full.skipped_steps) == 0
    # a block size given wins; a budget periods alone meet keeps the factors whole
    given = kg.KFAC(loss, momentum_type="regular", adapt_damping=False, overhead_budget=2.0,
                    factor_block_size=1024)
    given.build(*args)
    assert given.estimator.factor_block_size == 1024 and not given.period_choice.within
    assert given.period_choice.factor_block_size is None
    loose = kg.KFAC(loss, momentum_type="regular", adapt_damping=False, overhead_budget=4.0)
    loose.build(*args)
    assert loose.period_choice.within and loose.period_choice.factor_block_size is None
    assert loose.estimator.blocks[0].input_factor.blocks is None


def test_a_budget_nothing_meets_takes_the_cheapest_cuts_too(caplog):
    from kfac_graph.optimizer import plan
    loss, args = _wide_mlp()
    opt = kg.KFAC(loss, overhead_budget=1.01)
    with caplog.at_level(logging.WARNING):
        opt.build(*args)
    choice = opt.period_choice
    assert not choice.within
    # the smallest blocks and forms tried count least: those, not the uncut step
    assert choice.factor_block_size == plan.FACTOR_BLOCK_SIZES[-1]
    assert choice.qmodel_batch_fraction == plan.QMODEL_FRACTIONS[-1]
    assert opt.estimator.factor_block_size == plan.FACTOR_BLOCK_SIZES[-1]
    assert opt.qmodel_batch_fraction == plan.QMODEL_FRACTIONS[-1]
    sgd = costs.sgd_multiply_adds(opt.costs)
    counted = costs.step_multiply_adds(opt.costs, opt.cov_update_period,
                                       opt.inverse_update_period, plan.cost_options(opt)) / sgd
    assert counted == pytest.approx(choice.ratio)
    whole_forms = kg.KFAC(loss, overhead_budget=1.01, qmodel_batch_fraction=1.0)
    whole_forms.build(*args)  # a fraction given is kept: the blocks alone are cut
    assert whole_forms.period_choice.factor_block_size == plan.FACTOR_BLOCK_SIZES[-1]
    assert whole_forms.period_choice.ratio > choice.ratio
    warnings = [r.getMessage() for r in caplog.records if "overhead_budget=1.01" in r.getMessage()]
    assert f"blocks of {plan.FACTOR_BLOCK_SIZES[-1]}" in warnings[0]
    assert "forms on 0.125 of the batch" in warnings[0]


def test_budget_takes_the_quadratic_models_forms_on_part_of_the_batch():
    import dataclasses
    from kfac_graph.optimizer import plan
    loss, args = _mlp()
    whole = kg.KFAC(loss)
    whole.build(*args)
    sgd = costs.sgd_multiply_adds(whole.costs)

    def longest(fraction):  # the counted step at the longest periods tried
        options = dataclasses.replace(plan.cost_options(whole), qmodel_fraction=fraction)
        return costs.step_multiply_adds(whole.costs, costs.COV_PERIODS[-1],
                                        costs.INVERSE_PERIODS[-1], options) / sgd

    budget = 3.0
    assert longest(1.0) > longest(0.5) > budget > longest(0.25)  # the forms alone are over
    opt = kg.KFAC(loss, overhead_budget=budget)
    losses = [float(opt.step(*args)) for _ in range(12)]
    choice = opt.period_choice
    assert choice.within and choice.qmodel_batch_fraction == 0.25
    assert opt.qmodel_batch_fraction == 0.25 and choice.factor_block_size is None
    counted = costs.step_multiply_adds(opt.costs, opt.cov_update_period,
                                       opt.inverse_update_period, plan.cost_options(opt)) / sgd
    assert counted == pytest.approx(choice.ratio) and counted <= budget
    assert "exact forms on 0.25 of the batch chosen by the budget, within" in opt.cost_summary()
    assert losses[-1] < 0.8 * losses[0] and int(opt.skipped_steps) == 0, losses

    given = kg.KFAC(loss, overhead_budget=budget, qmodel_batch_fraction=1.0)
    given.build(*args)  # a fraction given wins: nothing fits, and it says so
    assert given.qmodel_batch_fraction == 1.0 and not given.period_choice.within
    assert given.period_choice.qmodel_batch_fraction is None
    regular = kg.KFAC(loss, momentum_type="regular", overhead_budget=budget)
    regular.build(*args)  # no forms to cut
    assert regular.period_choice.qmodel_batch_fraction is None
