"""When a K-FAC step updates the covariances and refreshes the inverses.

On the step counter ``t`` (only applied steps count) and ``k = t - B``
with ``B = num_burnin_steps``:

- burn-in (``t < B``): the covariances are updated, nothing else;
- covariance steps: every burn-in step, then ``k % cov_update_period == 0``;
- inverse steps: ``k % inverse_update_period == 0``, never in the burn-in.
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

    @property
    def every_step_updates_covariances(self) -> bool:
        """Whether ``do_cov`` is True at every step (no branch is needed)."""
        return self.cov_update_period == 1

    def at(self, t) -> ScheduledStep:
        """The schedule of step ``t`` (an int64 scalar tensor)."""
        in_burnin = t < self.num_burnin_steps
        k = t - self.num_burnin_steps
        do_cov = in_burnin | tf.equal(k % self.cov_update_period, 0)
        do_inv = ~in_burnin & tf.equal(k % self.inverse_update_period, 0)
        return ScheduledStep(t, in_burnin, k, do_cov, do_inv)
