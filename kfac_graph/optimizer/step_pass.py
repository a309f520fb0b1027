"""The K-FAC step's forward and backward pass (``step_core.py``'s step 1).

``forward_backward(opt, args, variables, scheduled)`` gives a ``Pass``: the
loss and its gradients on one device's (or replica's) batch, the statistics
folded into the estimator on covariance steps, and

- ``forward``: a pass of the registered graph at the top level of the
  step's graph (``LayerTaps``), which the quadratic model's Fisher forms may
  differentiate again, else None; where they will (``share_forward``), the
  gradients are taken through the model output and leave their pullback
  on it for the forms (``exact_fisher.loss_gradients``: one backward pass
  for both);
- ``size_scale``: for a loss that divides by sizes known at run time alone
  (``LossSpec.size_scaled``: a plain mean over positions traced with their
  count ``T`` unknown), ``s = 1/T`` as the registered graph's pass reads it
  (``LayerTaps.size_scale``), else None. The loss's curvature is then
  ``c F`` with ``c = scale * s`` (``curvature_scale``) and the Fisher's
  tokens unweighted, as at known sizes, where ``1/T`` is a constant of
  ``scale``: so the factors' moving averages read alike at any size, and a
  step traced at unknown sizes computes what one traced at the batch's own
  does. Such a loss takes its gradients from the registered graph's pass on
  every step (not the function's own), which reads ``s`` too.

``curvature_scale(registration, batch_size, dtype, size_scale)``: ``c``, the
loss's ``scale`` times the batch size for a sum, times ``size_scale``.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import tensorflow as tf

from kfac_graph.optimizer import covariance_slices, exact_fisher
from kfac_graph.taps import LayerTaps


class Pass(NamedTuple):
    """``forward_backward``'s result (module docstring)."""
    loss: tf.Tensor
    grads: list
    forward: Any = None
    size_scale: Any = None


def curvature_scale(registration, batch_size, dtype, size_scale=None):
    """``c``: the loss's curvature is ``c F`` (``F`` per example, averaged):
    the loss's ``scale``, times the batch size for a sum, times the run-time
    ``size_scale`` where the loss has one (module docstring)."""
    c = tf.constant(float(registration.loss.scale), dtype)
    if registration.loss.reduction == "sum":
        c = c * tf.cast(batch_size, dtype)
    if size_scale is not None:
        c = c * tf.cast(size_scale, dtype)
    return c


def dense(grads, variables):
    """Gradients as dense tensors (zeros where a variable is unused)."""
    out = []
    for g, v in zip(grads, variables):
        if g is None:
            g = tf.zeros(v.shape, v.dtype)
        out.append(tf.convert_to_tensor(g))
    return out


def forms_reuse_forward(opt) -> bool:
    """Whether the quadratic model's exact Fisher forms differentiate the
    step's own forward pass: they are taken on the whole batch, and the update
    sits at the top level of the step (no burn-in branch around it)."""
    return (opt.momentum_type == "qmodel" and opt.qmodel_curvature == "exact"
            and opt.qmodel_batch_fraction >= 1 and not opt.num_burnin_steps)


def forward_backward(opt, args, variables, scheduled, share_forward=False,
                     size_scaled=False) -> Pass:
    """The ``Pass`` of ``opt.fn`` on ``args`` at step ``scheduled``; on
    covariance steps the batch's statistics are also folded into
    ``opt.estimator``'s factors. ``size_scaled``: the registration's
    ``loss.size_scaled`` (every branch then takes the registered graph's
    pass, which reads ``size_scale``). The pass:

    - every step a covariance step: the estimator's pass, shared by the loss,
      the gradients and the statistics;
    - spread covariances: the loss and gradients by the registered graph's pass
      (with ``share_forward``) or the function's own, and the estimator's pass
      on the step's slice of the batch (``covariance_slices.py``; in a branch
      on covariance steps where the slices are ``slice_stride > 1`` steps apart);
    - otherwise, with ``share_forward``: the registered graph's pass gives the
      loss and gradients at the top level, and on covariance steps a branch
      runs the estimator's own pass for the statistics (gradients cannot
      cross into a branch). A step without statistics runs one forward pass
      instead of two (the forms' own); a covariance step as many as before;
    - otherwise a branch picks the estimator's pass or the function's own."""
    do_cov = scheduled.do_cov
    if opt.schedule.every_step_updates_covariances:
        taps = opt.estimator.accumulate_taps(*args)
        return Pass(taps.loss, dense(_gradients(taps, variables, share_forward), variables),
                    taps, taps.size_scale)

    if opt.schedule.spread:
        covariance_slices.fold_scheduled_slice(opt.estimator, args, scheduled, opt.schedule)
        if share_forward or size_scaled:
            return registered_pass(opt, args, variables, keep_forward=share_forward)
        return Pass(*plain_gradients(opt, args, variables))

    if share_forward:
        def with_statistics():
            opt.estimator.accumulate(*args)
            return tf.constant(True)

        tf.cond(do_cov, with_statistics, lambda: tf.constant(False))
        return registered_pass(opt, args, variables, keep_forward=True)

    def with_statistics():
        taps = opt.estimator.accumulate_taps(*args)
        scale = [taps.size_scale] if size_scaled else []
        return [taps.loss] + scale + dense(tf.gradients(taps.loss, variables), variables)

    def without_statistics():
        if size_scaled:
            found = registered_pass(opt, args, variables)
            return [found.loss, found.size_scale] + found.grads
        loss, grads = plain_gradients(opt, args, variables)
        return [loss] + grads

    out = tf.cond(do_cov, with_statistics, without_statistics)
    if size_scaled:
        return Pass(out[0], out[2:], None, out[1])
    return Pass(out[0], out[1:])


def registered_pass(opt, args, variables, keep_forward=False) -> Pass:
    """The ``Pass`` of the registered graph (no statistics), at the top level
    of the caller's graph (``forward`` None unless ``keep_forward``, for the
    quadratic model's forms to differentiate: the gradients then leave their
    pullback on it, ``exact_fisher.loss_gradients``)."""
    taps = LayerTaps.build(opt.estimator.build(*args), args)
    grads = dense(_gradients(taps, variables, keep_forward), variables)
    return Pass(taps.loss, grads, taps if keep_forward else None, taps.size_scale)


def _gradients(taps, variables, for_forms):
    """The loss's gradients on ``taps``; ``for_forms``: through the model
    output, leaving the pullback for the quadratic model's forms
    (``exact_fisher.loss_gradients``)."""
    if for_forms:
        return exact_fisher.loss_gradients(taps, variables)
    return tf.gradients(taps.loss, variables)


def plain_gradients(opt, args, variables):
    """``(loss, dense gradients)`` of the function's own pass (no statistics), traced
    inline (``RegisteredFunction.inline``); under a strategy the registered graph's, as
    a Keras loss there divides itself by the replicas (``frontends.one_device``)."""
    if tf.distribute.has_strategy():
        return tuple(registered_pass(opt, args, variables)[:2])
    with tf.GradientTape() as tape:
        loss = opt.fn.inline(*args)
    grads = tape.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return loss, dense(grads, variables)
