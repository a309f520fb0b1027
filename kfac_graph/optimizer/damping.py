"""Levenberg-Marquardt damping adaptation (Martens & Grosse 2015, §6.5).

Every ``interval`` steps, with ``delta`` the update just applied and
``M(delta) = g.delta + 1/2 delta.C delta`` the quadratic model's predicted
change (``C`` the curvature without the adapted damping ``lambda``; the
``l2_reg`` term stays in, as in tensorflow/kfac),

    rho = (h(theta + delta) - h(theta)) / M(delta),

    lambda <- omega * lambda    if rho > 3/4   (the model is trustworthy)
    lambda <- lambda / omega    if rho < 1/4   (it is not)

with ``omega = decay ** interval`` (M&G: ``(19/20) ** T1``) and
``lambda >= min_damping``. As in tensorflow/kfac, a loss that fell where
the model predicted a rise (``M > 0``) also counts as trustworthy, and a
non-finite new loss as untrustworthy; a step of zero (a learning-rate
schedule at 0: ``rho = 0/0``) leaves ``lambda`` as it is.

The floor matters: on a problem the model fits ever better (the digits CNN
memorising its data) ``rho > 3/4`` at every adaptation, so ``lambda`` falls
by ``omega`` each time without end (0.1 -> 3e-8 in ~300 steps) until the
damped factors are singular in float32 and the run blows up (steps
300-430). ``default_min_damping`` (``RELATIVE_MIN_DAMPING`` times the
initial damping) keeps it within four orders of magnitude of the start.
"""
from __future__ import annotations

import tensorflow as tf
from kfac_graph.layers.scalars import as_dtype

RELATIVE_MIN_DAMPING = 1e-4


def default_min_damping(initial_damping: float) -> float:
    """The floor of the adapted damping when none is given:
    ``RELATIVE_MIN_DAMPING * initial_damping``."""
    return RELATIVE_MIN_DAMPING * float(initial_damping)


def reduction_ratio(loss_change, model_change):
    """``rho``; ``-inf`` when the new loss is not finite."""
    rho = loss_change / model_change
    return tf.where(tf.math.is_finite(loss_change), rho, tf.constant(-float("inf"), rho.dtype))


def adapt(damping, loss_change, model_change, omega, min_damping):
    """The new damping and ``rho`` by the rule of the module docstring."""
    dtype = damping.dtype
    loss_change = tf.cast(loss_change, dtype)
    model_change = tf.cast(model_change, dtype)
    rho = reduction_ratio(loss_change, model_change)
    decrease = (rho > 0.75) | ((loss_change < 0) & (model_change > 0))
    increase = (rho < 0.25) & ~decrease
    omega = as_dtype(omega, dtype)
    new = tf.where(decrease, damping * omega, tf.where(increase, damping / omega, damping))
    return tf.maximum(new, as_dtype(min_damping, dtype)), rho
