"""kg.KFAC with a learning-rate schedule: each step reads the schedule at its
own step number (from 0), the same as assigning that rate by hand before the
step, eagerly and under XLA; a Keras schedule works; the quadratic model,
which picks its own step size, refuses one with a one-line error."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg

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


@pytest.mark.parametrize("momentum_type", ["regular", "adam"])
@pytest.mark.parametrize("jit_compile", [False, True], ids=["eager", "xla"])
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


def test_quadratic_model_refuses_a_schedule():
    _, loss_fn, _ = _problem()
    with pytest.raises(ValueError, match="learning_rate schedule needs momentum_type") as e:
        kg.KFAC(loss_fn, learning_rate=_halving)
    assert "\n" not in str(e.value)
