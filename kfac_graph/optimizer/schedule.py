"""When a K-FAC step updates the covariances and refreshes the inverses.

On the step counter ``t`` (only applied steps count) and ``k = t - B``
with ``B = num_burnin_steps``:

- burn-in (``t < B``): the covariances are updated, nothing else;
- covariance steps: every burn-in step, then ``k % cov_update_period == 0``;
- inverse steps: ``k % inverse_update_period == 0``, never in the burn-in.

Staggered inverses (``inverse_slots``, one slot in ``range(P)`` per block,
``P = inverse_update_period``): block ``i`` refreshes when ``k % P ==
slot_i``, and every block at ``k == 0`` (the first step after the burn-in,
which has no inverses yet), so each step of a period pays only its own
slot's factorisations. A block's inverses are then at most ``P - 1`` steps
older than without staggering, and a damping change reaches a block at its
slot (without staggering every block refreshes at once when the damping
changes); with ``P = 1`` the two schedules are the same.

Spread covariances (``spread_covariances`` with ``cov_update_period > 1``):
every burn-in step and every ``slice_stride``-th step after it (``k % s ==
0``; ``s`` divides the period, 1 by default) is a covariance step, each on a
slice of its batch (``covariance_slices.py``: the ``q = k // s``-th of the
period's ``P / s`` slice steps).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import tensorflow as tf


class ScheduledStep(NamedTuple):
    """What step ``t`` does (scalar tensors): ``in_burnin``, ``k = t - B``,
    ``do_cov`` (update the covariances), ``do_inv`` (refresh the inverses)."""

    t: tf.Tensor
    in_burnin: tf.Tensor
    k: tf.Tensor
    do_cov: tf.Tensor
    do_inv: tf.Tensor


@dataclasses.dataclass(frozen=True)
class StepSchedule:
    """The periods of the module docstring (validated by ``kg.KFAC``)."""

    num_burnin_steps: int = 0
    cov_update_period: int = 1
    inverse_update_period: int = 10
    inverse_slots: tuple | None = None
    spread_covariances: bool = False
    slice_stride: int = 1

    @property
    def staggered(self) -> bool:
        """Whether each block refreshes in its own slot (module docstring)."""
        return self.inverse_slots is not None

    @property
    def every_step_updates_covariances(self) -> bool:
        """Whether every step folds in its whole batch's statistics (no branch
        is needed)."""
        return self.cov_update_period == 1

    @property
    def spread(self) -> bool:
        """Whether covariance steps fold in a slice's statistics (module docstring)."""
        return self.spread_covariances and self.cov_update_period > 1

    @property
    def slice_steps(self) -> int:
        """``P / s``: the slice steps of a covariance period (spread)."""
        return self.cov_update_period // self.slice_stride

    def at(self, t) -> ScheduledStep:
        """The schedule of step ``t`` (an int64 scalar tensor)."""
        in_burnin = t < self.num_burnin_steps
        k = t - self.num_burnin_steps
        every = self.slice_stride if self.spread else self.cov_update_period
        do_cov = tf.constant(True) if every == 1 else in_burnin | tf.equal(k % every, 0)
        do_inv = ~in_burnin & tf.equal(k % self.inverse_update_period, 0)
        return ScheduledStep(t, in_burnin, k, do_cov, do_inv)

    def refresh_mask(self, scheduled: ScheduledStep) -> list:
        """Staggered: per block, whether step ``scheduled`` refreshes its
        inverses (a scalar bool tensor each)."""
        if not self.staggered:
            raise ValueError("refresh_mask needs inverse_slots (a staggered schedule)")
        first = tf.equal(scheduled.k, 0)
        phase = scheduled.k % self.inverse_update_period
        due = {slot: ~scheduled.in_burnin & (first | tf.equal(phase, slot))
               for slot in sorted(set(self.inverse_slots))}
        return [due[slot] for slot in self.inverse_slots]


def slot_steps(slots, period: int, steps: int) -> list:
    """``[[block indices refreshed at k]] for k in range(steps)``: the
    staggered schedule written out (no burn-in)."""
    return [[i for i, slot in enumerate(slots) if k == 0 or k % period == slot]
            for k in range(steps)]
