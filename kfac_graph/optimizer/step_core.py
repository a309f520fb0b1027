"""The K-FAC step, shared by the single-device and the replicated step.

``StepCore.step(*args)`` runs one step of ``kg.KFAC`` (``opt``), traced
into the caller's ``tf.function``; on the schedule of step ``t``
(``schedule.py``):

1. ``loss_and_gradients``: the loss and its gradients ``g`` on the batch,
   one forward and backward pass; on covariance steps the batch's
   statistics are folded into the estimator's factors, by the same pass or,
   where the quadratic model's forms keep that pass at the top level, by a
   pass of its own in a branch (``step_pass.py``). ``g`` gains
   ``l2_reg * theta``;
2. on inverse steps, and whenever the cached inverses were made for another
   damping (the blocks cache damped inverses; the Levenberg-Marquardt rule
   changes ``lambda``), ``refresh_inverses`` recomputes them, after (1);
   with a staggered schedule (``schedule.py``), each block in its own slot
   of the inverse period instead;
3. outside the burn-in, the update rule (``update_rules.py``) forms
   ``delta`` from ``g`` and the preconditioner
   ``(c F~ + (lambda + l2_reg) I)^{-1}`` (``opt.precondition``) and
   applies it;
4. with ``adapt_damping``, every ``damping_adaptation_interval`` steps:
   the loss at the new parameters on the batch (``batch_loss``) gives
   ``rho = (h(theta + delta) - h(theta)) / M(delta)`` and ``lambda`` adapts
   (``damping.py``). ``M(delta)``: the quadratic model's curvature less
   ``lambda I`` for ``"qmodel"``, else ``g.delta + 1/2 delta.(c F~_0)delta``
   (not tensorflow/kfac's ``F~_lambda - lambda I``: Kronecker cross terms).

``F~`` is damped in the blocks' convention (``pi``-split Tikhonov damping of
each Kronecker factor) by a value the core passes on every call: the
blocks see ``(lambda + l2_reg) / c`` (``opt.blocks_damping()``), and
``l2_reg / c`` for the damping rule's undamped model.

A non-finite loss, gradient, statistic, inverse or update skips the step:
every variable is put back (``rollback_state`` from a snapshot before (1),
the rest unwritten), counted in ``skipped_steps``; else in ``iterations``.

Seams (what an implementation provides; see ``SingleDeviceCore`` and
``distributed.ReplicatedCore``):

- ``prepare(args)``: ``(batch, registration)``: the batch as the other seams
  take it, and the registration whose variables the step updates;
- ``rollback_state()``: the estimator variables the core snapshots and puts
  back itself on a skip;
- ``loss_and_gradients(args, registration, scheduled)``: a ``Gradients``;
- ``refresh_inverses(damping, mask)``: every block's cached inverses (or
  those ``mask`` selects), for the blocks' damping ``damping``;
- ``batch_loss(args)``: the loss at the current parameters;
- ``fisher_forms(args, vectors, forward)``: ``(forms, part)``: ``[[u_a . F
  u_b]]`` with ``F`` the exact Fisher of the batch, and None; or, with
  ``qmodel_batch_fraction < 1``, of its first examples, and their
  ``exact_fisher.Part`` (their estimate of the model's other terms);
- ``finish(applied, gradients)``: what is left once the step is decided.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import tensorflow as tf

from kfac_graph.optimizer import damping as damping_lib
from kfac_graph.optimizer import update_rules
from kfac_graph.optimizer import vectors as vec
from kfac_graph.layers.scalars import as_dtype


class Gradients(NamedTuple):
    """What ``loss_and_gradients`` returns.

    ``loss``, ``grads``: on the whole batch (``grads`` dense, aligned with the
    registration's variables, without ``l2_reg``); ``statistics_ok``: whether
    the statistics this pass wrote are finite; ``curvature_scale``: ``c``;
    ``forward``: the pass's ``LayerTaps`` when it sits at the top level of
    the step's graph (the quadratic model's Fisher forms may reuse it), else
    None; ``extra``: anything the implementation's ``finish`` needs."""

    loss: tf.Tensor
    grads: list
    statistics_ok: tf.Tensor
    curvature_scale: tf.Tensor
    forward: Any = None
    extra: Any = None


class StepCore:
    """The step of the module docstring for ``opt`` (a ``kg.KFAC``); subclasses
    provide the seams. A plain object: the state stays ``opt``'s."""

    def __init__(self, opt):
        self.opt = opt

    # -- seams ------------------------------------------------------------------------
    def prepare(self, args):
        """``(batch, registration)``: the batch as the other seams take it, and
        the registration of ``opt.fn`` whose variables the step updates."""
        return tuple(args), self.opt.registration

    def rollback_state(self) -> list:
        """The estimator variables the core snapshots before the pass and puts
        back on a skip (what ``finish`` does not restore itself)."""
        raise NotImplementedError

    def loss_and_gradients(self, args, registration, scheduled) -> Gradients:
        """The loss and gradients on the batch (and, on ``scheduled.do_cov``
        steps, the statistics update in the same pass)."""
        raise NotImplementedError

    def refresh_inverses(self, damping, mask=None):
        """Recomputes every block's cached inverses for the blocks' damping
        ``damping`` (a scalar tensor); ``mask``: only the blocks whose entry
        (a scalar bool tensor per block) is True."""
        raise NotImplementedError

    def batch_loss(self, args):
        """The loss on the whole batch at the current parameters."""
        raise NotImplementedError

    def fisher_forms(self, args, vectors, forward=None):
        """``(forms, part)`` over ``vectors`` (the module docstring's seam);
        ``forward``: the step's ``Gradients.forward``, if any."""
        raise NotImplementedError

    def finish(self, applied, gradients: Gradients):
        """Called last with whether the step was applied (nothing by default)."""

    # -- the step ---------------------------------------------------------------------
    def step(self, *args):
        """One step on the batch ``args``: ``(loss, applied, t)``."""
        opt = self.opt
        args, registration = self.prepare(args)
        variables = list(registration.variables)
        scheduled = opt.schedule.at(opt.iterations.read_value())
        state = list(self.rollback_state())
        # reads taken before the updates keep the old values (assignments copy on write)
        snapshot = [v.value() for v in state]
        out = self.loss_and_gradients(args, registration, scheduled)
        opt.curvature_scale.assign(out.curvature_scale)
        grads = out.grads
        if opt.l2_reg:
            grads = [g + as_dtype(opt.l2_reg, g.dtype) * v for g, v in zip(grads, variables)]
        statistics_ok = (tf.reduce_all(tf.math.is_finite(out.loss)) & vec.all_finite(grads)
                         & out.statistics_ok)
        applied = self.decide(args, variables, out.loss, grads, statistics_ok, scheduled, state,
                              snapshot, out.forward)
        self.finish(applied, out)
        return out.loss, applied, scheduled.t

    def decide(self, args, variables, loss, grads, statistics_ok, scheduled, state, snapshot,
               forward=None):
        """After the gradients: refreshes the inverses when due or stale, then
        (outside the burn-in) updates; commits the counter if every value was
        finite, else puts ``state`` back to ``snapshot`` and counts the skip.
        True if the step was applied. ``forward`` is used only where the update
        sits at the top level too (no burn-in branch around it)."""
        opt = self.opt
        lam = opt.damping.read_value()
        damping = opt.blocks_damping(lam)
        if opt.schedule.staggered:  # each block in its slot (schedule.py)
            mask = opt.schedule.refresh_mask(scheduled)
            due = tf.reduce_any(tf.stack(mask))
        else:
            mask = None
            stale = ~scheduled.in_burnin & opt.estimator.inverses_stale(damping=damping)
            due = scheduled.do_inv | stale

        def refresh():
            # the refreshed caches are read back after their writes (the
            # branch's automatic control dependencies order them)
            self.refresh_inverses(damping, mask)
            return vec.all_finite([v.value() for v in opt.estimator.inverse_variables()])

        inverses_ok = tf.cond(due & statistics_ok, refresh, lambda: tf.constant(True))
        statistics_ok = statistics_ok & inverses_ok

        def update(forward=None):
            return self.update(args, variables, loss, grads, statistics_ok, scheduled.k, lam,
                               damping, forward)

        if opt.schedule.num_burnin_steps:
            applied = tf.cond(scheduled.in_burnin, lambda: statistics_ok, update)
        else:  # never in the burn-in: the update, and the forward pass, at the top level
            applied = update(forward)

        def commit():
            opt.iterations.assign_add(1)
            return tf.constant(True)

        def roll_back():
            for v, old in zip(state, snapshot):
                v.assign(old)
            opt.skipped_steps.assign_add(1)
            return tf.constant(True)

        tf.cond(applied, commit, roll_back)
        return applied

    def update(self, args, variables, loss, grads, statistics_ok, k, lam, damping,
               forward=None):
        """Forms and (if everything is finite) applies the update; True if
        applied. ``lam``: ``lambda``; ``damping``: the blocks' damping."""
        opt = self.opt
        direction = self.direction(args, grads, lam, damping, forward,
                                   objective=(self.objective(loss, variables)
                                              if opt.momentum_type == "qmodel" else None))
        delta, velocity = direction.delta, direction.velocity
        ok = statistics_ok & vec.all_finite(delta) & vec.all_finite(velocity)

        def apply():
            theta_dot_delta = vec.dot(variables, delta) if opt.l2_reg else None
            for v, d in zip(variables, delta):
                v.assign_add(tf.cast(d, v.dtype))
            opt.registration.apply_constraints()
            for slot, new in zip(opt.velocities, velocity):
                slot.assign(new)
            if direction.capped is not None:
                opt.cap_watch.count(direction.capped, loss)
            if opt.momentum_type == "qmodel" or opt.learning_rate_schedule is not None:
                opt.learning_rate.assign(tf.cast(direction.learning_rate, opt.dtype))
                opt.momentum.assign(tf.cast(direction.momentum, opt.dtype))
            if opt.adapt_damping:
                adapt_now = tf.equal((k + 1) % opt.damping_adaptation_interval, 0)
                tf.cond(adapt_now,
                        lambda: self.adapt_damping(args, loss, grads, delta, theta_dot_delta,
                                                   direction.model_change, lam),
                        lambda: tf.constant(True))
            return tf.constant(True)

        return tf.cond(ok, apply, lambda: tf.constant(False))

    def objective(self, loss, variables):
        """``h = L + l2_reg/2 |theta|^2`` before the update; None (no cap) unless the loss
        is ``>= 0`` (``LossSpec.nonnegative``: a likelihood's, or terms proven so)."""
        if not self.opt.registration.loss.nonnegative:
            return None
        h = tf.cast(loss, self.opt.dtype)
        if self.opt.l2_reg:
            h += 0.5 * tf.constant(self.opt.l2_reg, h.dtype) * tf.cast(
                vec.dot(variables, variables), h.dtype)
        return h

    def direction(self, args, grads, lam, damping, forward=None,
                  objective=None) -> update_rules.Direction:
        """The update by ``opt.momentum_type``'s rule; ``objective``: ``h``, for
        the quadratic model's cap (``qmodel.cap``)."""
        opt = self.opt
        dtype = opt.dtype
        lr = tf.cast(opt.learning_rate if opt.learning_rate_schedule is None
                     else opt.learning_rate_schedule(opt.iterations.read_value()), dtype)
        mu = tf.cast(opt.momentum, dtype)
        old = [v.read_value() for v in opt.velocities]
        precondition = lambda vectors: opt.precondition(vectors, damping)
        if opt.momentum_type == "regular":
            return update_rules.regular(grads, precondition, old, lr, mu, opt.norm_constraint)
        if opt.momentum_type == "adam":
            return update_rules.adam(grads, precondition, old, lr, mu, opt.norm_constraint)

        def quadratics(vectors):
            """The forms of ``c F + (lambda + l2_reg) I`` (module docstring), with
            the linear terms and objective of the examples they were taken on
            where those are a part of the batch (``update_rules.Forms``)."""
            if opt.qmodel_curvature == "kfac":
                return update_rules.kfac_quadratics(
                    vectors, lambda u: opt.curvature_multiply(u, damping), dtype)
            fisher, part = self.fisher_forms(args, vectors, forward)
            total = lam + tf.constant(opt.l2_reg, dtype)
            matrix = update_rules.exact_quadratics(vectors, fisher, opt.curvature_scale, total,
                                                   dtype)
            if part is None:
                return update_rules.Forms(matrix)
            theta = list(opt.registration.variables)
            linear = [tf.cast(c, dtype) for c in part.linear]
            if opt.l2_reg:  # the penalty's gradient l2_reg theta
                l2 = tf.constant(opt.l2_reg, dtype)
                linear = [c + l2 * tf.cast(vec.dot(theta, u), dtype)
                          for c, u in zip(linear, vectors)]
            return update_rules.Forms(matrix, linear, self.objective(part.loss, theta))

        annealing = None if opt.learning_rate_schedule is None else lr
        return update_rules.quadratic_model(grads, precondition, old, quadratics, lam, dtype,
                                            objective, annealing)

    def adapt_damping(self, args, loss, grads, delta, theta_dot_delta, model_change, lam):
        """The Levenberg-Marquardt rule (module docstring, step 4)."""
        opt = self.opt
        dtype = opt.dtype
        new_loss = tf.cast(self.batch_loss(args), dtype)
        loss_change = new_loss - tf.cast(loss, dtype)
        dd = tf.cast(vec.dot(delta, delta), dtype)
        if opt.l2_reg:
            l2 = tf.constant(opt.l2_reg, dtype)
            loss_change += l2 * tf.cast(theta_dot_delta, dtype) + 0.5 * l2 * dd
        if model_change is None:
            undamped = opt.blocks_damping(tf.zeros([], dtype))  # l2_reg / c
            curvature = tf.cast(vec.dot(delta, opt.curvature_multiply(delta, undamped)), dtype)
            model_change = tf.cast(vec.dot(grads, delta), dtype) + 0.5 * curvature
        new_damping, rho = damping_lib.adapt(lam, loss_change, model_change, opt.omega,
                                             opt.min_damping)
        opt.damping.assign(new_damping)
        opt.rho.assign(rho)
        opt.qmodel_change.assign(model_change)
        return tf.constant(True)
