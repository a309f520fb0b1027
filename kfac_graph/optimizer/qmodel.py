"""The quadratic model that picks the learning rate and momentum
(Martens & Grosse 2015, §7).

With ``Delta`` the preconditioned gradient, ``delta0`` the previous update,
``g`` the gradient and ``C`` the *damped* curvature matrix (the caller
passes its quadratic forms, ``lambda I`` included), the update
``delta = alpha Delta + mu delta0`` minimises

    M(delta) = g.delta + 1/2 delta.C delta

over ``(alpha, mu)``:

    [alpha, mu]^T = -[[D.CD, D.C d0], [d0.CD, d0.C d0]]^{-1} [g.D, g.d0]^T.

With no previous update (``g.d0 = 0``, the first step) the system is 1x1:
``alpha = -g.D / D.CD``, ``mu = 0``.

Safeguards (tensorflow/kfac solves the 2x2 system as it stands and relies
on the adapted damping alone to keep ``mu`` sane; at a small fixed damping
that lets ``mu`` run to -3.5, -11, -5e4 within four steps on a small CNN):

- ``mu`` is kept in ``[0, 1)``: a negative ``mu`` walks back along the last
  step and ``mu >= 1`` lets the momentum grow without bound, both signs
  that the model has left the region where it is trustworthy. Where the
  2x2 solution has ``mu`` outside ``[0, 1)`` the 1-D solve (``mu = 0``) is
  used instead; for ``mu < 0`` it is the exact minimiser of the convex
  model on ``mu >= 0``.
- The 2x2 solve is used only where the system is well conditioned:
  ``det > tol * m11 * m22`` (``1 - cos^2`` of the angle between ``Delta``
  and ``delta0`` in the ``C`` metric), ``tol = sqrt(eps)`` of the dtype,
  and both solutions finite; otherwise the 1-D solve.
- The 1-D solve needs ``m11 > 0`` (a damped curvature is positive
  definite); otherwise ``alpha = 0`` (no step).
- The model may not promise more than the whole objective: every loss the
  pass reads (cross-entropies, squared errors) and the ``l2_reg`` penalty
  are ``>= 0``, so where the *undamped* model ``M_0(s) = M(s) -
  lambda/2 s^2 |delta|^2`` along the chosen update ``s delta`` predicts a
  value below zero at ``s = 1`` (``M_0(1) < -h``, ``h > 0`` the objective
  now), the update is shortened to the first ``s`` in ``(0, 1)`` where
  ``M_0(s) = -h`` (``cap``). Such a prediction is a sign that the model
  is not to be trusted: with softmax outputs near saturation the Fisher
  is nearly flat along a direction whose gradient is large, and the
  minimiser runs off (NASNetLarge from random weights: a predicted fall
  of 1.6e6 from a loss of 17.8, and the loss then non-finite). On a dense
  softmax problem (8 seeds, uncapped) the steps whose model promised more
  than ``h`` had ``rho`` from -0.35 to 0.90, median 0.22, those that did
  not 0.46 to 1.03, median 0.83; on the digits models at the defaults no
  step promised that much, and the cap leaves their runs as they were
  (``benchmarks/qmodel_cap.py``).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

MU_MAX = 1.0  # mu must lie in [0, MU_MAX)


def _tolerance(dtype):
    return float(np.sqrt(np.finfo(dtype.as_numpy_dtype).eps))


def solve(m11, m12, m22, c1, c2):
    """``(alpha, mu)`` minimising ``1/2 s^T m s + c^T s`` (see the module
    docstring) with ``mu`` in ``[0, 1)``; the 1x1 solve where ``c2 == 0``,
    where the 2x2 system is ill-conditioned, or where its ``mu`` falls
    outside ``[0, 1)``."""
    m11, m12, m22, c1, c2 = (tf.convert_to_tensor(v) for v in (m11, m12, m22, c1, c2))
    dtype = m11.dtype
    zero, one = tf.zeros_like(m11), tf.ones_like(m11)
    det = m11 * m22 - m12 * m12
    well_conditioned = (m11 > 0) & (m22 > 0) & (det > _tolerance(dtype) * m11 * m22)
    safe_det = tf.where(well_conditioned, det, one)
    alpha2 = -(m22 * c1 - m12 * c2) / safe_det
    mu2 = -(-m12 * c1 + m11 * c2) / safe_det
    ok2 = (well_conditioned & tf.not_equal(c2, 0)
           & tf.math.is_finite(alpha2) & tf.math.is_finite(mu2)
           & (mu2 >= 0) & (mu2 < tf.constant(MU_MAX, dtype)))
    positive = (m11 > 0) & tf.math.is_finite(m11)
    safe_m11 = tf.where(positive, m11, one)
    alpha1 = tf.where(positive, -c1 / safe_m11, zero)
    alpha = tf.where(ok2, alpha2, alpha1)
    mu = tf.where(ok2, mu2, zero)
    return alpha, mu


def cap(quadratic, linear, objective):
    """``s`` in ``(0, 1]`` for the update ``s delta`` (module docstring):
    1 where ``M_0(1) = quadratic + linear >= -objective`` or ``objective
    <= 0``, else the smaller root of ``quadratic s^2 + linear s +
    objective = 0`` (``quadratic = 1/2 delta.C_0 delta >= 0``, ``linear =
    g.delta``), in the form that does not cancel:
    ``s = 2 h / (-linear + sqrt(linear^2 - 4 quadratic h))``."""
    quadratic, linear, objective = (tf.convert_to_tensor(v) for v in
                                    (quadratic, linear, objective))
    one = tf.ones_like(linear)
    over = (objective > 0) & (quadratic + linear < -objective) & tf.math.is_finite(linear)
    # where ``over``: linear < -objective - quadratic < 0, and the discriminant
    # is positive, since the model crosses -objective between s = 0 and 1
    disc = tf.maximum(linear * linear - 4.0 * quadratic * objective, tf.zeros_like(linear))
    denom = tf.where(over, tf.sqrt(disc) - linear, one)
    return tf.where(over, 2.0 * objective / denom, one)


def model_value(alpha, mu, m11, m12, m22, c1, c2):
    """``M`` at ``alpha Delta + mu delta0`` (the constant term left out)."""
    quad = 0.5 * (alpha * alpha * m11 + 2.0 * alpha * mu * m12 + mu * mu * m22)
    return quad + alpha * c1 + mu * c2
