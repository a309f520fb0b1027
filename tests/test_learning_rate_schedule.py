"""kg.KFAC with a learning-rate schedule: each step reads the schedule at its
own step number (from 0), the same as assigning that rate by hand before the
step, eagerly and under XLA; a Keras schedule works. With the quadratic model,
which picks its own step, the schedule's value scales that step: a constant 1
changes nothing, any value ``r`` gives ``r`` times the model's update with the
model change taken at the scaled step (against numpy on an explicit model)."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph.optimizer import update_rules

F64 = tf.float64
STEPS = 4


def _problem():
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(3, 4)), dtype=F64, name="w")
    b = tf.Variable(rng.normal(size=(4,)) * 0.1, dtype=F64, name="b")

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, x @ w + b))

    batches = [(tf.constant(rng.normal(size=(8, 3))), tf.constant(rng.integers(0, 4, 8)))
               for _ in range(STEPS)]
    return (w, b), loss_fn, batches


def _halving(step):
    return 0.4 * tf.pow(tf.constant(0.5, F64), tf.cast(step, F64))


@pytest.mark.parametrize("jit_compile,momentum_type", [
    (False, "regular"), (False, "adam"), (True, "regular"),
    pytest.param(True, "adam", marks=pytest.mark.slow)],  # (adam under XLA: -m slow)
    ids=["eager-regular", "eager-adam", "xla-regular", "xla-adam"])
def test_schedule_equals_the_rate_assigned_before_each_step(momentum_type, jit_compile):
    common = dict(momentum_type=momentum_type, adapt_damping=False, jit_compile=jit_compile,
                  estimation_mode="exact")
    (w, b), loss_fn, batches = _problem()
    scheduled = kg.KFAC(loss_fn, learning_rate=_halving, **common)
    for x, y in batches:
        scheduled.step(x, y)
    want_lr = float(_halving(STEPS - 1))
    assert float(scheduled.learning_rate) == pytest.approx(want_lr, rel=1e-12)
    got = [w.numpy(), b.numpy()]

    (w, b), loss_fn, batches = _problem()
    by_hand = kg.KFAC(loss_fn, learning_rate=float(_halving(0)), **common)
    for k, (x, y) in enumerate(batches):
        if k:
            by_hand.learning_rate.assign(_halving(k))
        by_hand.step(x, y)
    for g, v in zip(got, (w, b)):
        np.testing.assert_allclose(g, v.numpy(), rtol=1e-12)
    assert not np.allclose(got[0], _problem()[0][0].numpy())  # the steps moved the weights


def test_keras_cosine_decay_trains():
    (w, b), loss_fn, batches = _problem()
    schedule = keras.optimizers.schedules.CosineDecay(0.3, decay_steps=STEPS)
    opt = kg.KFAC(loss_fn, learning_rate=schedule, momentum_type="regular", damping=0.1)
    losses = [float(opt.step(*batches[0])) for _ in range(STEPS)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses
    assert float(opt.learning_rate) == pytest.approx(float(schedule(STEPS - 1)), rel=1e-6)


def test_quadratic_model_schedule_of_one_changes_nothing():
    runs = []
    for learning_rate in (0.1, lambda step: tf.ones([], F64)):
        (w, b), loss_fn, batches = _problem()
        opt = kg.KFAC(loss_fn, learning_rate=learning_rate, estimation_mode="exact",
                      damping_adaptation_interval=1)
        for x, y in batches:
            opt.step(x, y)
        runs.append([w.numpy(), b.numpy(), float(opt.damping), float(opt.learning_rate)])
    for got, want in zip(*runs):
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_quadratic_model_schedule_scales_the_first_update():
    (w0, b0), loss_fn, batches = _problem()
    start = [w0.numpy(), b0.numpy()]
    moves = []
    for learning_rate in (0.1, _halving):
        (w, b), loss_fn, batches = _problem()
        opt = kg.KFAC(loss_fn, learning_rate=learning_rate, estimation_mode="exact")
        opt.step(*batches[0])
        moves.append((w.numpy() - start[0], b.numpy() - start[1], float(opt.learning_rate)))
    (dw, db, lr), (dw_s, db_s, lr_s) = moves
    np.testing.assert_allclose(dw_s, 0.4 * dw, rtol=1e-10)
    np.testing.assert_allclose(db_s, 0.4 * db, rtol=1e-10)
    assert lr_s == pytest.approx(0.4 * lr, rel=1e-10) and lr > 0  # records -alpha


def _numpy_model(g, p, d0, curvature):
    """The 2-D quadratic model solved by hand: the minimiser and its ``mu``."""
    basis = np.stack([p, d0], axis=1)
    alpha, mu = np.linalg.solve(basis.T @ curvature @ basis, -basis.T @ g)
    return alpha * p + mu * d0, mu


@pytest.mark.parametrize("annealing", [1.0, 0.3])
def test_quadratic_model_rule_anneals_the_minimiser(annealing):
    rng = np.random.default_rng(1)
    n, lam = 5, 0.2
    root = rng.normal(size=(n, n))
    curvature = root @ root.T + lam * np.eye(n)  # damped C
    g = rng.normal(size=n)
    precondition_matrix = np.linalg.inv(curvature + 0.5 * np.eye(n))
    p = precondition_matrix @ g
    # a previous step overshooting the Newton step: its 2-D minimiser has mu near 1/3
    d0 = -3.0 * np.linalg.solve(curvature, g) + 0.1 * rng.normal(size=n)

    def quadratics(vectors):
        us = [u[0].numpy() for u in vectors]
        return update_rules.Forms([[tf.constant(a @ curvature @ b, F64) for b in us]
                                   for a in us])

    def precondition(vectors):
        return [tf.linalg.matvec(tf.constant(precondition_matrix), vectors[0])]

    out = update_rules.quadratic_model(
        [tf.constant(g)], precondition, [tf.constant(d0)], quadratics, tf.constant(lam, F64), F64,
        annealing=None if annealing == 1.0 else tf.constant(annealing, F64))
    best, mu = _numpy_model(g, p, d0, curvature)
    assert 0 < mu < 1  # the 2-D solve, not its 1-D fallback
    delta = annealing * best
    np.testing.assert_allclose(out.delta[0].numpy(), delta, rtol=1e-10)
    undamped = g @ delta + 0.5 * delta @ (curvature - lam * np.eye(n)) @ delta
    assert float(out.model_change) == pytest.approx(undamped, rel=1e-10)


def test_quadratic_model_annealed_to_zero_stops():
    (w, b), loss_fn, batches = _problem()
    schedule = keras.optimizers.schedules.CosineDecay(1.0, decay_steps=2)
    opt = kg.KFAC(loss_fn, learning_rate=schedule, estimation_mode="exact",
                  damping_adaptation_interval=1)  # a zero step's rho is 0/0
    opt.step(*batches[0])
    moved = w.numpy().copy()
    assert not np.allclose(moved, _problem()[0][0].numpy())  # the first step trains
    opt.step(*batches[1])
    after = [w.numpy().copy(), b.numpy().copy()]
    damping = float(opt.damping)
    for x, y in batches[2:]:  # the schedule is 0 from step 2 on
        opt.step(x, y)
    np.testing.assert_array_equal(w.numpy(), after[0])
    np.testing.assert_array_equal(b.numpy(), after[1])
    assert int(opt.skipped_steps) == 0 and float(opt.learning_rate) == 0.0
    assert float(opt.damping) == damping  # no verdict on a step not taken
