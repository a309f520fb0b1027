"""``kg.KFAC``'s schedule from its options and the counted costs.

At ``build`` (the registration and blocks exist), from the multiply-adds
``costs.py`` counts:

- with ``overhead_budget = b``: the covariance and inverse periods that
  ``costs.choose_periods`` picks so that the counted amortised step is at
  most ``b`` SGD steps (the smallest inverse period, then the smallest
  covariance period); a period given explicitly is kept, and the budget
  picks the other around it (where none fits, the cheapest pair, and a
  warning is logged). Where
  no periods are within the budget (the preconditioning of wide factors
  alone exceeds it: ResNet50's ``1025 x 2048`` and ``2049 x 512`` blocks)
  and no ``factor_block_size`` was given, the largest of
  ``FACTOR_BLOCK_SIZES`` whose periods are within it (if any: else the
  factors stay as they are) becomes the estimator's ``factor_block_size``:
  its full factors wider than that keep their diagonal blocks
  (``factor_blocks.py``), which costs ``d k n`` per product and ``d k^2``
  per refresh against ``d^2 n`` and ``d^3``. With the quadratic model's exact
  forms and no ``qmodel_batch_fraction`` given, each block size (none first)
  tries the fractions of ``QMODEL_FRACTIONS`` in turn: the forms on ``f`` of
  the batch count ``f`` of their cost (two Fisher-vector products, about
  2.7 SGD steps on the whole batch). The first that fits is taken;
  ``take_choice`` hands the block size and fraction to the optimizer;
- spread covariances under a budget: a slice every ``slice_stride`` steps
  (``costs.choose_stride``: the largest that keeps a slice step within 1.5x
  the others; 1 without a budget);
- with ``stagger_inverses``: each block's slot in the inverse period
  (``costs.balanced_slots`` over the blocks' counted factorisations), so
  the steps of a period share the refresh work evenly (``schedule.py``).
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf
from absl import logging

from kfac_graph.optimizer import costs as costs_lib
from kfac_graph.optimizer.schedule import StepSchedule

# the factor block sizes an overhead budget tries, in the order it prefers them
FACTOR_BLOCK_SIZES = (2048, 1024, 512, 256, 128)
# the shares of the batch for the quadratic model's exact forms, in that order
QMODEL_FRACTIONS = (1.0, 0.5, 0.25, 0.125)


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


def cost_options(opt, qmodel_fraction=None) -> costs_lib.StepOptions:
    """What ``opt``'s step does besides the periods, as ``costs.py`` counts it
    (the exact forms on ``qmodel_fraction`` of the batch where given; the
    batch ``opt`` was built for, ``opt.cost_batch``, cut into slices if spread)."""
    return costs_lib.StepOptions(
        batch=opt.cost_batch,
        sources=statistics_sources(opt, opt.registration),
        qmodel=opt.qmodel_curvature if opt.momentum_type == "qmodel" else None,
        qmodel_fraction=qmodel_fraction or opt.qmodel_batch_fraction,
        spread=opt.spread_covariances, slice_stride=opt.schedule.slice_stride,
        damping_interval=opt.damping_adaptation_interval if opt.adapt_damping else None)


def batch_of(args) -> int:
    """The leading axis of the first argument with a shape (a tensor, spec or array;
    1 if unknown)."""
    shaped = [a for a in tf.nest.flatten(args) if getattr(a, "shape", None) is not None]
    shape = shaped[0].shape if shaped else None
    shape = tf.TensorShape(None if shape is None else shape)  # numpy shapes are tuples
    if not shape.rank or shape[0] is None:
        return 1
    return int(shape[0])


def plan_schedule(opt, registration):
    """``(costs, choice, schedule)`` for ``opt`` (a ``kg.KFAC`` being built
    for batches of ``opt.cost_batch`` examples):
    the per-layer counts, the budget's ``PeriodChoice`` (None without a
    budget; its ``factor_block_size``, if any, is the estimator's to take:
    the counts are those of blocks made with it) and the ``StepSchedule``
    the step runs."""
    count = lambda size=None: costs_lib.layer_costs(  # noqa: E731
        registration, opt.estimator.blocks, opt.cost_batch,
        statistics_sources(opt, registration), size)
    costs = count()
    cov, inverse = opt.given_periods
    choice = None
    if opt.overhead_budget is not None:
        choose = lambda c, fraction=None: costs_lib.choose_periods(  # noqa: E731
            c, opt.overhead_budget, cost_options(opt, fraction), given=(cov, inverse))
        sizes = (None,) + (FACTOR_BLOCK_SIZES if opt.estimator.factor_block_size is None
                           else ())
        chooses_fraction = (opt.momentum_type == "qmodel" and opt.qmodel_curvature == "exact"
                            and opt.given_qmodel_fraction is None)
        fractions = QMODEL_FRACTIONS if chooses_fraction else (None,)
        costs, choice = _budget_choice(costs, count, sizes, fractions, choose)
        cov = cov or choice.cov_update_period
        inverse = inverse or choice.inverse_update_period
        if not choice.within:
            cuts = "".join([
                f", factors in blocks of {choice.factor_block_size}"
                if choice.factor_block_size else "",
                f", forms on {choice.qmodel_batch_fraction:g} of the batch"
                if choice.qmodel_batch_fraction else ""])
            logging.warning("kg.KFAC overhead_budget=%g: no periods tried are within it; "
                            "taking the cheapest: periods %d/%d%s (counted step %.2f SGD steps)",
                            opt.overhead_budget, cov, inverse, cuts, choice.ratio)
    cov = int(cov or opt.cov_update_period)
    inverse = int(inverse or opt.inverse_update_period)
    slots = None
    if opt.stagger_inverses:
        slots = costs_lib.balanced_slots([c.inverse for c in costs], inverse)
    stride = choice.slice_stride if choice is not None else 1
    return costs, choice, StepSchedule(opt.num_burnin_steps, cov, inverse, slots,
                                       opt.spread_covariances, stride)


def _budget_choice(costs, count, sizes, fractions, choose):
    """``(costs, choice)``: the counts and ``PeriodChoice`` of the first block
    size of ``sizes`` (None: the blocks as made; ``count(size)`` recounts),
    then forms' fraction of ``fractions``, whose periods are within the
    budget (``choose(counted, fraction)``); where none is, of the cheapest of
    them all (every cut the budget may make counted, not the uncut step's)."""
    cheapest = None
    for size in sizes:
        counted = costs if size is None else count(size)  # counted once per size
        for fraction in fractions:
            choice = dataclasses.replace(
                choose(counted, fraction), factor_block_size=size,
                qmodel_batch_fraction=fraction if fraction not in (None, 1.0) else None)
            if choice.within:
                return counted, choice
            if cheapest is None or choice.ratio < cheapest[1].ratio:
                cheapest = (counted, choice)
    return cheapest


def take_choice(opt):
    """Hands ``opt.period_choice``'s factor block size (to the estimator) and
    forms' fraction (to ``opt``) over, where the budget picked them."""
    choice = opt.period_choice
    if choice is None:
        return
    if choice.factor_block_size:
        opt.estimator.use_factor_block_size(choice.factor_block_size)
    if choice.qmodel_batch_fraction:
        opt.qmodel_batch_fraction = choice.qmodel_batch_fraction
