"""K-FAC's update rules: the update ``delta`` from the gradient ``g``.

``P`` is the preconditioner ``(c F~ + (lambda + l2_reg) I)^{-1}`` (a
``precondition`` callable), ``v`` the velocities (the previous update for
``"qmodel"``), ``lr`` the learning rate and ``mu`` the momentum:

- ``"regular"``: ``v <- mu v + P g``, ``delta = -lr v``;
- ``"adam"``: ``v <- mu v + g``, ``delta = -lr P v``;
- ``"qmodel"``: ``delta = alpha P g + mu v`` with ``(alpha, mu)``
  minimising the quadratic model ``M(delta) = g.delta + 1/2 delta.C delta``
  (``qmodel.py``) of a damped curvature ``C``, given by its quadratic
  forms ``[[u_a . C u_b]]``; ``lr`` and ``mu`` then record ``-alpha`` and
  ``mu``, and the model change excludes the adapted damping:
  ``M(delta) - lambda/2 |delta|^2``; where that undamped model promises
  more than the whole objective, the update is shortened (``qmodel.cap``);
  a learning-rate schedule's value ``r`` scales it (``r = 1``: the model's
  own step; a decay to 0 anneals it, as a first-order method's schedule).

The quadratic forms of ``C``: ``c F + (lambda + l2_reg) I`` with ``F`` the
exact Fisher of the batch (``exact_quadratics``) or the damped K-FAC
matrix ``c F~`` (``kfac_quadratics``, from its products). Where the exact
forms are taken on a part of the batch (``qmodel_batch_fraction < 1``), the
model is that part's own: its gradient in the linear terms and its
objective in the cap (``Forms``), so that all of the model's terms are
estimated from the same examples.

The norm constraint ``C_n`` ("regular", "adam"): the preconditioned vector
``p = P u`` (``u``: the vector it preconditions, ``g`` or ``v``) is scaled by
``min(1, sqrt(C_n / (lr^2 p.u)))`` so that ``lr^2 p.u <= C_n``
(tensorflow/kfac's ``_clip_updates``, Ba et al. 2017 §5).
"""
from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from kfac_graph.optimizer import qmodel
from kfac_graph.optimizer import vectors as vec
from kfac_graph.layers.scalars import as_dtype


class Direction(NamedTuple):
    """An update: ``delta``, the new velocities, the learning rate and momentum
    it used (to record), the quadratic model's change ``M(delta)`` without
    the adapted damping and whether its cap shortened the update (None for
    the rules without a model)."""

    delta: list
    velocity: list
    learning_rate: tf.Tensor
    momentum: tf.Tensor
    model_change: tf.Tensor | None
    capped: tf.Tensor | None = None


class Forms(NamedTuple):
    """What the quadratic model's curvature gives for the vectors ``u_a``:
    ``matrix``, ``[[u_a . C u_b]]``; where those forms were taken on a part of
    the batch, that part's own ``linear`` terms ``[g' . u_a]`` (``g'`` the
    gradient of its objective) and ``objective`` (its value now), else None
    (the batch's gradient and objective are used)."""

    matrix: list
    linear: list | None = None
    objective: tf.Tensor | None = None


def clip(vectors, preconditioned, lr, norm_constraint):
    """``preconditioned`` scaled so that ``lr^2 preconditioned.vectors <= norm_constraint``
    (as it is when ``norm_constraint`` is None)."""
    if norm_constraint is None:
        return preconditioned
    sq = lr * lr * tf.cast(vec.dot(vectors, preconditioned), lr.dtype)
    tiny = tf.constant(1e-30, lr.dtype)
    coeff = tf.minimum(tf.ones([], lr.dtype),
                       tf.sqrt(as_dtype(norm_constraint, lr.dtype) / tf.maximum(sq, tiny)))
    return vec.scale(coeff, preconditioned)


def regular(grads, precondition, velocities, lr, mu, norm_constraint=None) -> Direction:
    """``v <- mu v + clip(P g)``, ``delta = -lr v``."""
    p = clip(grads, precondition(grads), lr, norm_constraint)
    velocity = vec.axpy(mu, velocities, p)
    return Direction(vec.scale(-lr, velocity), velocity, lr, mu, None)


def adam(grads, precondition, velocities, lr, mu, norm_constraint=None) -> Direction:
    """``v <- mu v + g``, ``delta = -lr clip(P v)``."""
    velocity = vec.axpy(mu, velocities, grads)
    p = clip(velocity, precondition(velocity), lr, norm_constraint)
    return Direction(vec.scale(-lr, p), velocity, lr, mu, None)


def quadratic_model(grads, precondition, previous, quadratics, damping, dtype,
                    objective=None, annealing=None) -> Direction:
    """``delta = s (alpha P g + mu previous)``, ``(alpha, mu)`` minimising the
    quadratic model whose curvature ``quadratics([u_1, u_2])`` gives (a
    ``Forms``: with its own linear terms and objective where it has them);
    ``damping``: the adapted ``lambda`` in ``C``, left out of the
    recorded model change; ``s = qmodel.cap(...)`` for ``objective`` (the
    objective's value now), 1 without it, times ``annealing`` (a scalar, the
    value of a learning-rate schedule) if given. The recorded change is the
    model's at the step taken, ``s^2 quadratic + s linear``; ``capped``:
    whether the cap shortened it."""
    p = precondition(grads)
    forms = quadratics([p, previous])
    (m11, m12), (_, m22) = forms.matrix
    if forms.linear is None:
        c1, c2 = tf.cast(vec.dot(grads, p), dtype), tf.cast(vec.dot(grads, previous), dtype)
    else:
        c1, c2 = (tf.cast(c, dtype) for c in forms.linear)
        objective = None if objective is None else forms.objective
    alpha, mu = qmodel.solve(m11, m12, m22, c1, c2)
    direction = vec.combine(alpha, p, mu, previous)
    dd = tf.cast(vec.dot(direction, direction), dtype)
    linear = alpha * c1 + mu * c2  # g.direction; below, 1/2 direction.C_0 direction
    quadratic = 0.5 * (alpha * alpha * m11 + 2.0 * alpha * mu * m12 + mu * mu * m22
                       - damping * dd)
    s = tf.ones([], dtype) if objective is None else qmodel.cap(
        quadratic, linear, tf.cast(objective, dtype))
    capped = s < 1
    if annealing is not None:
        s = s * tf.cast(annealing, dtype)
    delta = vec.scale(s, direction)
    change = s * s * quadratic + s * linear
    alpha, mu = s * alpha, s * mu
    return Direction(delta, delta, -alpha, mu, change, capped)


def kfac_quadratics(vectors, curvature_multiply, dtype):
    """``Forms`` of ``[[u_a . C u_b]]`` with ``C u = curvature_multiply(u)``."""
    n = len(vectors)
    products = [curvature_multiply(u) for u in vectors]
    return Forms([[tf.cast(vec.dot(vectors[a], products[b]), dtype) for b in range(n)]
                  for a in range(n)])


def exact_quadratics(vectors, fisher, scale, damping, dtype):
    """``[[u_a . (c F + damping I) u_b]]`` from ``fisher = [[u_a . F u_b]]``,
    ``scale = c``."""
    n = len(vectors)
    return [[scale * tf.cast(fisher[a][b], dtype)
             + damping * tf.cast(vec.dot(vectors[a], vectors[b]), dtype) for b in range(n)]
            for a in range(n)]
