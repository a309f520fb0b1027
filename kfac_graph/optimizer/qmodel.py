"""The quadratic model that picks the learning rate and momentum
(Martens & Grosse 2015, §7).

With ``Delta`` the preconditioned gradient, ``delta0`` the previous update,
``g`` the gradient and ``C`` a curvature matrix, the update
``delta = alpha Delta + mu delta0`` minimises

    M(delta) = g.delta + 1/2 delta.C delta

over ``(alpha, mu)``:

    [alpha, mu]^T = -[[D.CD, D.C d0], [d0.CD, d0.C d0]]^{-1} [g.D, g.d0]^T.

With no previous update (``g.d0 = 0``, the first step) the system is 1x1:
``alpha = -g.D / D.CD``, ``mu = 0``.
"""
from __future__ import annotations

import tensorflow as tf


def solve(m11, m12, m22, c1, c2):
    """``(alpha, mu)`` minimising ``1/2 s^T m s + c^T s`` (see the module
    docstring); the 1x1 solve where ``c2 == 0``."""
    det = m11 * m22 - m12 * m12
    safe_det = tf.where(tf.equal(det, 0), tf.ones_like(det), det)
    alpha2 = -(m22 * c1 - m12 * c2) / safe_det
    mu2 = -(-m12 * c1 + m11 * c2) / safe_det
    safe_m11 = tf.where(tf.equal(m11, 0), tf.ones_like(m11), m11)
    alpha1 = -c1 / safe_m11
    one_dim = tf.equal(c2, 0) | tf.equal(det, 0)
    alpha = tf.where(one_dim, alpha1, alpha2)
    mu = tf.where(one_dim, tf.zeros_like(mu2), mu2)
    return alpha, mu


def model_value(alpha, mu, m11, m12, m22, c1, c2):
    """``M`` at ``alpha Delta + mu delta0`` (the constant term left out)."""
    quad = 0.5 * (alpha * alpha * m11 + 2.0 * alpha * mu * m12 + mu * mu * m22)
    return quad + alpha * c1 + mu * c2
