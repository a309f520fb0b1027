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


def model_value(alpha, mu, m11, m12, m22, c1, c2):
    """``M`` at ``alpha Delta + mu delta0`` (the constant term left out)."""
    quad = 0.5 * (alpha * alpha * m11 + 2.0 * alpha * mu * m12 + mu * mu * m22)
    return quad + alpha * c1 + mu * c2
