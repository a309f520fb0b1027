"""Staggered inverse refreshes: which blocks refresh at which step, the slots'
balance, the same steps as the unstaggered schedule when the period is 1,
and training with the defaults (one device, and the whole step under XLA)."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph.optimizer import costs
from kfac_graph.optimizer.schedule import StepSchedule, slot_steps


def test_balanced_slots_heaviest_first_into_the_lightest_slot():
    assert costs.balanced_slots([10.0, 1.0, 1.0, 8.0], 2) == (0, 1, 1, 1)
    assert costs.balanced_slots([5.0, 5.0, 5.0], 3) == (0, 1, 2)
    assert costs.balanced_slots([1.0, 2.0], 5) == (1, 0)  # spare slots stay empty
    rng = np.random.default_rng(0)
    weights = list(rng.uniform(0, 100, size=23))
    slots = costs.balanced_slots(weights, 4)
    totals = [sum(w for w, s in zip(weights, slots) if s == k) for k in range(4)]
    assert max(totals) - min(totals) <= max(weights)


def test_refresh_mask_follows_the_slots_and_refreshes_all_first():
    schedule = StepSchedule(num_burnin_steps=2, inverse_update_period=3,
                            inverse_slots=(1, 0, 2, 0))
    expected = [[]] * 2 + slot_steps(schedule.inverse_slots, 3, 8)
    assert expected[2:6] == [[0, 1, 2, 3], [0], [2], [1, 3]]
    for t, want in enumerate(expected):
        mask = schedule.refresh_mask(schedule.at(tf.constant(t, tf.int64)))
        assert [i for i, m in enumerate(mask) if bool(m)] == want, t
    with pytest.raises(ValueError, match="inverse_slots"):
        StepSchedule().refresh_mask(StepSchedule().at(tf.constant(0, tf.int64)))


def _problem(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(10, activation="tanh"),
                              keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(3)])
    rng = np.random.default_rng(seed)
    batches = [(tf.constant(rng.normal(size=(32, 6)), tf.float32),
                tf.constant(rng.integers(0, 3, 32), tf.int32)) for _ in range(8)]

    @kg.auto_register
    def loss(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    return loss, batches


def _refreshed_blocks(opt, batches):
    """Per step, the indices of the blocks whose cached inverses changed."""
    out = []
    for x, y in batches:
        if not opt.built:
            opt.build(x, y)
        before = [[v.numpy() for v in (b.input_inverse, b.output_inverse)]
                  for b in opt.estimator.blocks]
        opt.step(x, y)
        after = [[v.numpy() for v in (b.input_inverse, b.output_inverse)]
                 for b in opt.estimator.blocks]
        out.append([i for i, (old, new) in enumerate(zip(before, after))
                    if any(not np.array_equal(o, n) for o, n in zip(old, new))])
    return out


@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_each_block_refreshes_in_its_slot(jit):
    loss, batches = _problem()
    opt = kg.KFAC(loss, momentum_type="regular", adapt_damping=True,
                  damping_adaptation_interval=2, inverse_update_period=3, jit_compile=jit)
    seen = _refreshed_blocks(opt, batches)
    slots = opt.schedule.inverse_slots
    assert sorted(set(slots)) == [0, 1, 2]  # four blocks over three slots
    # the damping changes every other step, yet only the slot's blocks refresh
    assert seen == slot_steps(slots, 3, len(batches))
    assert int(opt.skipped_steps.numpy()) == 0


def test_unstaggered_refreshes_every_block_at_once():
    loss, batches = _problem()
    opt = kg.KFAC(loss, momentum_type="regular", adapt_damping=False, inverse_update_period=3,
                  stagger_inverses=False)
    seen = _refreshed_blocks(opt, batches[:4])
    assert opt.schedule.inverse_slots is None
    assert seen == [[0, 1, 2, 3], [], [], [0, 1, 2, 3]]


def test_period_one_gives_the_unstaggered_steps():
    losses = {}
    for stagger in (True, False):
        loss, batches = _problem()
        opt = kg.KFAC(loss, momentum_type="regular", damping_adaptation_interval=2,
                      inverse_update_period=1, stagger_inverses=stagger)
        losses[stagger] = [float(opt.step(x, y)) for x, y in batches[:5]]
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-6)


def test_defaults_stagger_and_train():
    loss, batches = _problem()
    opt = kg.KFAC(loss)
    assert opt.stagger_inverses and opt.inverse_update_period == 10
    x, y = batches[0]
    first = float(opt.step(x, y))
    for _ in range(12):
        opt.step(x, y)
    assert len(set(opt.schedule.inverse_slots)) == 4
    assert float(loss(x, y)) < 0.8 * first
    assert int(opt.skipped_steps.numpy()) == 0
