"""``kg.KFAC``'s step on one device: the seams of ``step_core.StepCore``.

The forward and backward pass runs once per step; on covariance steps it is
the estimator's own pass (``FisherEstimator.accumulate_taps``), which also
folds the batch's statistics into the factors. When every step updates the
covariances that pass sits at the top level of the step's graph, where the
quadratic model's exact Fisher forms differentiate it again (no second
forward pass, ``exact_fisher.py``). With a longer covariance period the
quadratic model's step still runs its loss and gradients on the registered
graph at the top level, for the forms to differentiate, and a branch adds the
statistics on covariance steps (``step_pass.forward_backward``); other steps
let a branch pick the pass with or without statistics.
"""
from __future__ import annotations

import tensorflow as tf

from kfac_graph.optimizer import exact_fisher, loss_state
from kfac_graph.optimizer import vectors as vec
from kfac_graph.optimizer.distributed import is_replica_local
from kfac_graph.optimizer.example_cuts import batch_tensor
from kfac_graph.optimizer.step_core import Gradients, StepCore
from kfac_graph.optimizer.step_pass import (curvature_scale, forms_reuse_forward,
                                            forward_backward)


class SingleDeviceCore(StepCore):
    """The plain step (outside ``tf.distribute``)."""

    def prepare(self, args):
        args = tuple(args)
        return args, self.opt.estimator.build(*args)

    def rollback_state(self) -> list:
        """Every estimator variable (factors, counters, cached inverses)."""
        return list(self.opt.estimator_state)

    def loss_and_gradients(self, args, registration, scheduled) -> Gradients:
        opt = self.opt
        # what the loss writes (moving statistics, seeds), as the pass starts:
        # the damping rule's run of the loss starts there too (loss_state.py)
        self._written = loss_state.written(registration)
        self._before = loss_state.snapshot(self._written)
        variables = list(registration.variables)
        first = batch_tensor(args, "kg.KFAC")
        found = forward_backward(opt, args, variables, scheduled,
                                 share_forward=forms_reuse_forward(opt),
                                 size_scaled=registration.loss.size_scaled)
        scale = curvature_scale(registration, tf.shape(first)[0], opt.dtype, found.size_scale)
        statistics_ok = tf.cond(scheduled.do_cov, self.statistics_finite,
                                lambda: tf.constant(True))
        return Gradients(found.loss, found.grads, statistics_ok, scale, found.forward)

    def statistics_finite(self):
        """Whether the moving averages a covariance update writes are finite.
        The cached decompositions change only at inverse refreshes, which the
        core checks, so a step without a covariance update needs no check of
        the estimator's state (a committed step left it finite)."""
        written = [v for v in self.opt.estimator_state if is_replica_local(v)]
        return vec.all_finite([v.value() for v in written])

    def refresh_inverses(self, damping, mask=None):
        self.opt.estimator.refresh_inverses(damping=damping, mask=mask)

    def batch_loss(self, args):
        """The loss from the state the step's pass started from, the state the
        pass left put back (``loss_state.second_run``)."""
        return loss_state.second_run(lambda: self.opt.fn.tf_function(*args), self._written,
                                     self._before)

    def fisher_forms(self, args, vectors, forward=None):
        """``(forms, part)``: ``[[u_a . F u_b]]`` with the exact Fisher ``F`` of
        the batch, differentiating ``forward`` when given, and None; of its
        first examples with ``qmodel_batch_fraction < 1``, and their ``Part``
        (``exact_fisher.batch_forms``)."""
        opt = self.opt
        return exact_fisher.batch_forms(opt.fn, opt.estimator.build(*args), args, vectors,
                                        opt.qmodel_batch_fraction, forward)
