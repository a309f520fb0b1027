"""``kg.KFAC``'s schedule from its options and the counted costs.

At ``build`` (the registration and blocks exist), from the multiply-adds
``costs.py`` counts:

- with ``overhead_budget = b``: the covariance and inverse periods that
  ``costs.choose_periods`` picks so that the counted amortised step is at
  most ``b`` SGD steps (the smallest covariance period, then the smallest
  inverse period); a period given explicitly wins over the budget's;
- with ``stagger_inverses``: each block's slot in the inverse period
  (``costs.balanced_slots`` over the blocks' counted factorisations), so
  the steps of a period share the refresh work evenly (``schedule.py``).
"""
from __future__ import annotations

import tensorflow as tf

from kfac_graph.optimizer import costs as costs_lib
from kfac_graph.optimizer.schedule import StepSchedule


def statistics_sources(opt, registration) -> int:
    """Backward passes per covariance update: the samples (``"sampled"``),
    the model output's last axis (``"exact"``: one per Fisher column), 1."""
    est = opt.estimator
    if est.estimation_mode == "sampled":
        return est.num_samples
    if est.estimation_mode == "exact" and registration.loss.output:
        shape = costs_lib.static_shape(registration, registration.loss.output)
        return int(shape[-1]) if shape and shape[-1] is not None else 1
    return 1


def cost_options(opt) -> costs_lib.StepOptions:
    """What ``opt``'s step does besides the periods, as ``costs.py`` counts it."""
    return costs_lib.StepOptions(
        sources=statistics_sources(opt, opt.registration),
        qmodel=opt.qmodel_curvature if opt.momentum_type == "qmodel" else None,
        qmodel_fraction=opt.qmodel_batch_fraction, spread=opt.spread_covariances,
        damping_interval=opt.damping_adaptation_interval if opt.adapt_damping else None)


def batch_of(args) -> int:
    """The leading axis of the first argument (a tensor, spec or array; 1 if unknown)."""
    first = tf.nest.flatten(args)[0]
    shape = getattr(first, "shape", None)
    shape = tf.TensorShape(None if shape is None else shape)  # numpy shapes are tuples
    if not shape.rank or shape[0] is None:
        return 1
    return int(shape[0])


def plan_schedule(opt, registration, args):
    """``(costs, choice, schedule)`` for ``opt`` (a ``kg.KFAC`` being built):
    the per-layer counts, the budget's ``PeriodChoice`` (None without a
    budget) and the ``StepSchedule`` the step runs."""
    costs = costs_lib.layer_costs(registration, opt.estimator.blocks, batch_of(args),
                                  statistics_sources(opt, registration))
    cov, inverse = opt.given_periods
    choice = None
    if opt.overhead_budget is not None:
        choice = costs_lib.choose_periods(costs, opt.overhead_budget, cost_options(opt))
        cov = cov or choice.cov_update_period
        inverse = inverse or choice.inverse_update_period
    cov = int(cov or opt.cov_update_period)
    inverse = int(inverse or opt.inverse_update_period)
    slots = None
    if opt.stagger_inverses:
        slots = costs_lib.balanced_slots([c.inverse for c in costs], inverse)
    return costs, choice, StepSchedule(opt.num_burnin_steps, cov, inverse, slots,
                                       opt.spread_covariances)
