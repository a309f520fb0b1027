"""A replayed custom gradient whose function reads across the examples
(`passes/gradient_coupling.py`).

A surrogate `tf.custom_gradient` (a forward identity or a straight-through
rounding) has its own gradient function replayed in the graph kfac_graph
re-runs. Where that function reads the whole `[B, H]` cotangent (a
batch-wide `tf.clip_by_norm(dy, c)`, `dy / tf.norm(dy)`, `dy -
reduce_mean(dy, 0)`), each example's gradient upstream depends on the
others'; before, nothing said so (`reg.coupling` empty, no warning, DP-SGD
clipped those shares). Now the op is in `reg.coupling`, the registration
warns and DP-SGD refuses in one line, and the per-example gradients indeed
differ from one-example tapes. Per-row functions (a clip per example, a
clip by value, a gradient reversal, a straight-through estimator) couple
nothing, and their per-example gradients equal the tapes'.
"""
import logging
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from passes.errors import KfacGraphError
from per_example_reference import one_example_loop

B, T, D, H, C = 5, 3, 4, 6, 3
CLIP = 1e-3  # below every example's cotangent norm: each clip binds

# name: (the gradient function, whether the forward rounds, whether a sequence [B, T, ..])
COUPLED = {
    "batch_clip": (lambda dy: tf.clip_by_norm(dy, CLIP), False, False),
    "batch_normalised": (lambda dy: dy / tf.norm(dy), False, False),
    "batch_centred": (lambda dy: dy - tf.reduce_mean(dy, axis=0), False, False),
    "straight_through_batch_clip": (lambda dy: tf.clip_by_norm(dy, CLIP), True, False),
    "sequence_clip_per_token_over_the_batch": (
        lambda dy: tf.clip_by_norm(dy, CLIP, axes=[0, 2]), False, True),
}
PER_ROW = {
    "row_clip": (lambda dy: tf.clip_by_norm(dy, CLIP, axes=[1]), False, False),
    "value_clip": (lambda dy: tf.clip_by_value(dy, -CLIP, CLIP), False, False),
    "reversal": (lambda dy: -dy, False, False),
    "straight_through": (lambda dy: dy, True, False),
    "sequence_clip_per_example": (lambda dy: tf.clip_by_norm(dy, CLIP, axes=[1, 2]), False, True),
}


class Surrogate(keras.layers.Layer):
    """A forward identity (or rounding) whose gradient is ``grad(dy)``."""

    def __init__(self, grad, rounds, **kwargs):
        super().__init__(**kwargs)
        self.grad, self.rounds = grad, rounds

    def call(self, x):
        @tf.custom_gradient
        def surrogate(x):
            return (tf.round(x) if self.rounds else tf.identity(x)), self.grad
        return surrogate(x)


def _case(grad, rounds, sequence):
    """A float64 Dense -> Surrogate -> Dense under an MSE loss, and its arguments."""
    keras.utils.set_random_seed(0)
    shape = (T, D) if sequence else (D,)
    model = keras.Sequential([keras.Input(shape, dtype="float64"),
                              keras.layers.Dense(H, dtype="float64"),
                              Surrogate(grad, rounds, dtype="float64", name="surrogate"),
                              keras.layers.Dense(C, dtype="float64")])
    x = 3.0 * tf.random.stateless_normal([B, *shape], [1, 2], dtype=tf.float64)
    y = tf.random.stateless_normal([B, *shape[:-1], C], [3, 4], dtype=tf.float64)

    @kg.auto_register
    def loss(x, y):
        return tf.reduce_mean(tf.square(model(x) - y))
    return loss, (x, y)


def _gap(loss, args):
    """``(registration, max |per-example - one-example tape|)`` over the first
    Dense's kernel (upstream of the surrogate), and the tapes' own scale there."""
    reg = loss.registration(*args)
    got = kg.per_example_gradients(loss, *args)
    want = one_example_loop(loss, args, reg.variables)
    for g, w in zip(got[2:], want[2:]):  # the last Dense is downstream: exact either way
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    return reg, float(np.max(np.abs(got[0] - want[0]))), float(np.max(np.abs(want[0])))


@pytest.mark.parametrize("name", sorted(COUPLED))
def test_a_gradient_function_across_the_batch_couples_the_examples(name, caplog):
    loss, args = _case(*COUPLED[name])
    with caplog.at_level(logging.WARNING):
        reg, gap, scale = _gap(loss, args)
    (op,) = reg.coupling
    assert op.endswith("/IdentityN") and "surrogate" in op, op
    assert any(f"couples the examples at op {op!r}" in r.getMessage() for r in caplog.records)
    assert f"examples meet at: {op}" in reg.summary()
    # not vacuous: each example's share is not its batch-of-one gradient
    assert gap > 0.1 * max(scale, CLIP), (gap, scale)


@pytest.mark.parametrize("name", sorted(PER_ROW))
def test_a_per_row_gradient_function_couples_nothing_and_is_exact(name):
    loss, args = _case(*PER_ROW[name])
    reg, gap, scale = _gap(loss, args)
    assert reg.coupling == (), reg.coupling
    assert scale > 0 and gap <= 1e-10 * max(scale, 1.0), (gap, scale)


def test_dp_sgd_refuses_the_coupled_one_and_runs_the_per_row_one():
    loss, args = _case(*COUPLED["batch_clip"])
    op = re.escape(repr(loss.registration(*args).coupling[0]))
    for run in (lambda: kg.DPSGD(loss, learning_rate=0.1, l2_norm_clip=1.0,
                                 noise_multiplier=1.0).step(*args),
                lambda: kg.dp_gradients(loss, *args, l2_norm_clip=1.0, noise_multiplier=1.0)):
        with pytest.raises(KfacGraphError, match=f"couples the examples at op {op}.*custom "
                                                 "gradient"):
            run()
    loss, args = _case(*PER_ROW["row_clip"])
    assert np.isfinite(float(kg.DPSGD(loss, learning_rate=0.1, l2_norm_clip=1.0,
                                      noise_multiplier=1.0).step(*args)))


def test_a_batch_known_at_run_time_only():
    """Traced with an unknown batch (``input_signature``): rows from probes,
    the batch pinned in the scratch graph; the same verdicts."""
    w1, w2 = (tf.Variable(np.random.default_rng(k).normal(size=s)) for k, s in
              ((0, (D, H)), (1, (H, C))))
    spec = [tf.TensorSpec([None, D], tf.float64), tf.TensorSpec([None, C], tf.float64)]
    args = (tf.random.stateless_normal([B, D], [1, 2], dtype=tf.float64),
            tf.random.stateless_normal([B, C], [3, 4], dtype=tf.float64))
    for name, want in (("batch_clip", 1), ("row_clip", 0)):
        surrogate = Surrogate((COUPLED if want else PER_ROW)[name][0], False, dtype="float64")
        loss = tf.function(lambda x, y, s=surrogate: tf.reduce_mean(tf.square(
            s(x @ w1) @ w2 - y)), input_signature=spec)
        reg = kg.auto_register(loss).registration(*args)
        assert len(reg.coupling) == want, (name, reg.coupling)
