"""Handing the quadratic model's step over to regular momentum where the
model cannot steer it.

The quadratic model picks each step's size and momentum from the batch in
hand. Where a batch's gradient is mostly its own noise, its model promises
to remove the whole loss on almost every step, each step fits its own batch
and the loss does not fall: ``keras.applications.ResNet50`` on the digits
at batch 32, where two batches' preconditioned gradients agree to about
0.003 (``benchmarks/gradient_agreement.py``). Regular momentum averages
about ``1 / (1 - mu)`` batches' preconditioned gradients and trains it.
``cap_watch.py`` recognises the regime (15 of a window of 20 steps
capped) and warns.

With ``qmodel_fallback=True`` (the default) ``kg.KFAC.step`` then hands
over, once: from its next call the update is ``"regular"``'s (``v <- mu v +
P g``, ``delta = -lr v``, ``P g`` clipped by ``norm_constraint``) with the
``learning_rate``, ``momentum`` and ``norm_constraint`` given to
``kg.KFAC`` (by default 0.1, 0.9 and 1e-3), the velocities from zero, and
the damping held where the quadratic model left it. Held, because in this
regime the Levenberg-Marquardt rule, which rates the K-FAC model on the
batch in hand, only raises it: regular momentum from damping 0.1 on
ResNet50 reached 1.09 after 100 steps with it held, 1.72 with it adapted
(to 1.0). Everything else (factors, inverses, periods, counters) carries
on. A warning line says so.

It hands over where ``step`` is called eagerly on one device with a
number for ``learning_rate``: the watch is polled every 20 calls there (one
variable read); ``kg.KFACModel.fit`` polls it after each batch, as its own
step function traces ``step``. Inside a caller's own ``tf.function``, under
``tf.distribute``, or with a learning-rate schedule (with ``"qmodel"`` an
annealing of the model's own step, not a learning rate), the warning is
all. The hand-over is Python state: a restored
checkpoint carries ``cap_watch.warned``, so a new optimizer hands over at
its first poll.
"""
from __future__ import annotations

from absl import logging
import tensorflow as tf
from kfac_graph.layers.scalars import as_dtype

REMEDY = (" (kg.KFAC.step hands over to it itself where it is called eagerly; "
          "qmodel_fallback=False keeps the quadratic model)")


def applies(opt) -> bool:
    """Whether ``opt`` may hand over (module docstring), eager calls aside."""
    return (opt.momentum_type == "qmodel" and opt.qmodel_fallback and opt.strategy is None
            and opt.learning_rate_schedule is None)


def after_step(opt):
    """Called after each step (by ``kg.KFAC.step``, and by ``kg.KFACModel``,
    whose step is traced): hands over when due."""
    if applies(opt) and tf.executing_eagerly() and opt.cap_watch.poll():
        hand_over(opt)


def hand_over(opt):
    """Makes ``opt``'s step regular momentum's from its next call (module
    docstring)."""
    opt.momentum_type = "regular"
    opt.adapt_damping = False
    for velocity in opt.velocities:
        velocity.assign(tf.zeros_like(velocity))
    opt.learning_rate.assign(as_dtype(opt.initial["learning_rate"], opt.learning_rate.dtype))
    opt.momentum.assign(as_dtype(opt.initial["momentum"], opt.momentum.dtype))
    opt.compile_step()
    why = ("the loss did not fall below its first steps'" if bool(opt.cap_watch.stalled)
           else "the quadratic model's cap shortened most steps")
    logging.warning("kg.KFAC: %s; from step %d "
                    "on the step is momentum_type='regular' (learning_rate %g, momentum %g, "
                    "norm_constraint %s, damping held at %.3g)", why, int(opt.iterations),
                    opt.initial["learning_rate"], opt.initial["momentum"], opt.norm_constraint,
                    float(opt.damping))
