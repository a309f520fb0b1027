"""Covariance statistics spread over the steps of the covariance period.

With ``cov_update_period = P > 1`` the plain schedule folds a whole batch's
statistics into the factors every ``P``-th step: that step alone pays for
the statistics pass (a forward and a sampled backward pass, the factors'
outer products) and the step time spikes there. With
``spread_covariances=True`` every step ``k`` folds in the statistics of a
slice of ``n = ceil(B / P)`` of its ``B`` examples: of the ``m = ceil(B / n)``
slices ``[s, s + n)`` with ``s = min(j n, B - n)``, the ``j = (k mod P) mod m``-th
(``m <= P``: where ``m < P`` a period revisits slices, e.g. ``P > B`` cycles
through single examples), with the decay ``d^(1/P)`` (``d =
cov_ema_decay``). Over a period:

- the factors see ``P n >= B`` examples, as many as one whole batch (more
  by the rounding);
- the average from before the period keeps the weight ``d`` it keeps under
  the plain schedule (``(d^(1/P))^P = d``);
- each step pays ``1/P`` of the statistics, plus the slice's own forward
  pass (``n / B`` of a forward pass: the plain schedule's covariance step
  shares the batch's forward pass with the gradients).

With a slice every ``s`` steps (``slice_stride``, chosen by an overhead
budget; ``s`` divides ``P``) the same holds over the ``P / s`` slice steps
of a period, with ``P / s`` in place of ``P``: fewer, larger slices.

Each slice's statistics are those of a batch of ``n`` examples, so the
factors estimate the same per-example average. The burn-in's steps take
slices too. The slice is a batch of its own shape: the loss is registered
again for it (once, when the step is traced).
"""
from __future__ import annotations

import math

import tensorflow as tf

from kfac_graph.optimizer.example_cuts import cut_examples


def slice_size(batch: int, period: int) -> int:
    """``n = ceil(B / P)`` (at least 1)."""
    return max(1, math.ceil(batch / period))


def slice_decay(decay, period: int):
    """``d^(1/P)``: ``P`` updates with it keep the weight one update with ``d`` keeps."""
    if callable(decay) and not isinstance(decay, tf.Variable):
        decay = decay()
    if isinstance(decay, (int, float)):
        return float(decay) ** (1.0 / period)
    decay = tf.cast(decay, tf.float64)
    return tf.pow(decay, tf.constant(1.0 / period, tf.float64))


def rotating_slice(args, k, period: int):
    """``args`` cut to step ``k``'s slice of their examples (module docstring;
    ``example_cuts.cut_examples``: every tensor whose leading axis is the batch)."""
    def step_slice(batch, first):
        if batch is None:
            size = tf.shape(first, out_type=tf.int64)[0]
            n = (size + period - 1) // period
        else:
            size, n = batch, slice_size(batch, period)
        slices = (size + n - 1) // n
        phase = tf.cast(k, tf.int64) % period % slices
        start = tf.minimum(phase * n, tf.cast(size, tf.int64) - n)
        indices = start + tf.range(n, dtype=tf.int64)
        return lambda a: tf.gather(a, indices)

    return cut_examples(args, "spread_covariances", step_slice)


def accumulate_slice(estimator, args, k, period: int):
    """Folds the statistics of step ``k``'s slice of ``args`` into
    ``estimator``'s factors with the decay ``d^(1/P)``; returns the slice's loss."""
    return estimator.accumulate(*rotating_slice(args, k, period),
                                decay=slice_decay(estimator.cov_ema_decay, period))


def fold_scheduled_slice(estimator, args, scheduled, schedule):
    """Step ``scheduled``'s slice (the ``q = k // s``-th of the period's
    ``schedule.slice_steps``) folded into ``estimator``'s factors on its
    covariance steps: every step with stride ``s = 1``, else in a branch."""
    def with_slice():
        accumulate_slice(estimator, args, scheduled.k // schedule.slice_stride,
                         schedule.slice_steps)
        return tf.constant(True)

    if schedule.slice_stride == 1:
        with_slice()
    else:
        tf.cond(scheduled.do_cov, with_slice, lambda: tf.constant(False))
