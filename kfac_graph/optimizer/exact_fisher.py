"""Exact Fisher quadratic forms ``u_a . F u_b`` on one batch.

``F = (1/B) sum_i J_i^T F_i J_i`` (``J_i = dz_i/dtheta``, ``F_i`` the loss
distribution's Fisher at the model output ``z_i``; the convention of
DESIGN.md). ``J u`` comes from the double-backward trick inside the
imported graph: ``r(w) = J^T w`` by ``tf.gradients(z, theta, grad_ys=w)``,
then ``J u = d(r . u)/dw``; so ``u_a . F u_b = (1/B) sum_i (J_i u_a) .
F_i (J_i u_b)`` with ``F_i`` applied by the distribution's
``multiply_fisher`` (no ``[K, K]`` matrix is formed).

``leading_forms``: the same forms on the batch's first ``n = ceil(f B)``
examples, ``(1/n) sum_{i<n} ...``: over a shuffled batch, an unbiased
estimate of the batch's forms at about ``f`` of their cost (a forward pass
of the ``n`` examples of their own, traced and registered for their shape).
With them comes those examples' own estimate of the rest of the batch's
quadratic model (``Part``): their loss ``h'`` and the products ``g' . u_a``
of their gradient, times ``B / n`` for a summed loss. They cost no pass
of their own: ``g' . u = w . (J u)`` with ``w = dh'/dz``, from the ``J u``
the forms compute, plus the loss's own paths to the variables that bypass
``z``. The quadratic model built from one set of
examples for all its terms picks steps whose size is the ratio of two
estimates from the same examples; with the forms from ``n`` examples and
the gradient from all ``B``, the step size swung by two orders of magnitude
between steps near the digits autoencoder's loss floor (README, "Cold
start and scale").
"""
from __future__ import annotations

import math
from typing import NamedTuple

import tensorflow as tf

from kfac_graph import double_backward, token_weights
from kfac_graph.fisher import at_least_float32
from kfac_graph.fisher.curvature import output_curvature
from kfac_graph.optimizer.example_cuts import batch_tensor, cut_examples
from kfac_graph.taps import LayerTaps
from passes.errors import KfacGraphError


class Part(NamedTuple):
    """A part of the batch's estimate of the batch's quadratic model (module
    docstring): ``loss``, its objective, and ``linear``, ``[g' . u_a]``."""

    loss: tf.Tensor
    linear: list


def _forward(registration, args, taps):
    if taps is not None:
        return taps
    inner = tf.nest.map_structure(lambda a: tf.identity(a) if isinstance(a, tf.Tensor) else a,
                                  args)
    return LayerTaps.build(registration, inner)


def _model_output(taps):
    z = taps.model_output
    if z is None:
        raise KfacGraphError(taps.registration.loss.no_fisher)
    return z


def _through_output(taps, z, variables):
    """``(w, direct)``: ``w = dL/dz`` (dense, where the loss gathers from
    ``z``; None where the loss does not read ``z``) and the loss's
    gradients along its paths to the variables that bypass ``z``."""
    w = tf.gradients(taps.loss, z)[0]
    if isinstance(w, tf.IndexedSlices):
        w = tf.convert_to_tensor(w)
    return w, tf.gradients(taps.loss, variables, stop_gradients=[z])


def loss_gradients(taps, variables):
    """``dL/dtheta`` of ``taps``' loss (as ``tf.gradients``), taken through
    the model output ``z``: ``J^T w`` with ``w = dL/dz``
    (``double_backward.pullback``), plus the loss's paths to the variables
    that bypass ``z``. The pullback is kept in ``taps.derived`` so that the
    forms on these taps differentiate it again (``J u = d(r . u)/dw``)
    instead of taking a backward pass of their own: the step's one backward
    pass serves its gradients and its forms."""
    z = taps.model_output
    if z is None:
        return tf.gradients(taps.loss, variables)
    w, direct = _through_output(taps, z, variables)
    if w is None:  # no path through z: the bypassing paths are the gradient
        return direct
    pulled = double_backward.pullback(z, w, variables)
    taps.derived["pullback"] = ([v.ref() for v in variables], w, pulled)
    return [a if b is None else b if a is None else
            tf.convert_to_tensor(a) + tf.convert_to_tensor(b) for a, b in zip(pulled, direct)]


def _jacobian_products(taps, z, variables, vectors):
    """``[J u for u in vectors]`` from the pullback ``loss_gradients`` left
    on ``taps`` (for these variables), else from a pullback of zeros."""
    refs, w, pulled = taps.derived.get("pullback", (None, None, None))
    if refs != [v.ref() for v in variables]:
        w, pulled = tf.zeros_like(z), None
    return double_backward.jacobian_products(z, w, variables, vectors, pulled)


def jacobian_vector_products(registration, args, vectors, taps=None):
    """``[J u for u in vectors]`` (each shaped like the model output) and ``z``.
    ``taps``: a forward pass of ``args`` already in this graph (``LayerTaps``)
    to differentiate, instead of importing the graph again."""
    z = _model_output(_forward(registration, args, taps))
    return double_backward.jacobian_products(z, tf.zeros_like(z), registration.variables,
                                               vectors), z


def _part(variables, taps, z, jvs, vectors):
    """``Part`` of these examples: ``g' . u = w . (J u)`` with ``w = dh'/dz``
    (no pass beyond the forms'), plus the loss's paths to the variables that
    bypass ``z``."""
    w, direct = _through_output(taps, z, variables)
    w64 = tf.cast(w, tf.float64)
    linear = []
    for u, jv in zip(vectors, jvs):
        terms = [tf.reduce_sum(w64 * tf.cast(jv, tf.float64))]
        terms += [tf.reduce_sum(tf.cast(tf.convert_to_tensor(d), tf.float64)
                                * tf.cast(x, tf.float64))
                  for d, x in zip(direct, u) if d is not None]
        linear.append(tf.add_n(terms))
    return Part(tf.cast(taps.loss, tf.float64), linear)


def quadratic_forms(registration, args, vectors, taps=None, with_part=False):
    """``[[u_a . F u_b]]`` over ``vectors`` (each a list aligned with the
    registration's variables); ``taps`` as for ``jacobian_vector_products``.
    A weighted per-token loss weighs each token's ``F_it`` by its ``w_it``
    (``kfac_graph.token_weights``). ``with_part``: ``(forms, Part)`` of these
    examples (module docstring; not scaled)."""
    taps = _forward(registration, args, taps)
    variables = list(registration.variables)
    z = _model_output(taps)
    jvs = _jacobian_products(taps, z, variables, vectors)
    part = _part(variables, taps, z, jvs, vectors) if with_part else None
    jvs, z32 = [at_least_float32(jv) for jv in jvs], at_least_float32(z)
    kind = registration.loss.kind
    dist = output_curvature(registration.loss, tf.stop_gradient(z32), taps)
    batch = tf.cast(tf.shape(z32)[0], z32.dtype)
    fjvs = [dist.multiply_fisher(jv) for jv in jvs]
    if taps.token_weights is not None:
        fjvs = [token_weights.per_output(taps.token_weights, kind, f) * f for f in fjvs]
    n = len(vectors)
    forms = [[tf.reduce_sum(jvs[a] * fjvs[b]) / batch for b in range(n)] for a in range(n)]
    return (forms, part) if with_part else forms


def leading_examples(args, fraction):
    """``args`` cut to their first ``ceil(fraction B)`` examples
    (``example_cuts.cut_examples``: every tensor whose leading axis is the batch)."""
    def first_examples(batch, first):
        if batch is None:
            n = tf.cast(tf.math.ceil(fraction * tf.cast(tf.shape(first)[0], tf.float64)),
                        tf.int32)
        else:
            n = max(1, math.ceil(fraction * batch))
        return lambda a: a[:n]

    return cut_examples(args, "qmodel_batch_fraction < 1", first_examples)


def leading_forms(fn, registration, args, vectors, fraction):
    """``(forms, Part)``: ``quadratic_forms`` on the first ``ceil(fraction B)``
    examples of ``args`` and their estimate of the batch's model (module
    docstring); ``fn``: the ``kg.auto_register``ed loss, registered again for
    their shape; ``vectors`` aligned with ``registration``'s variables."""
    part = leading_examples(args, fraction)
    sub = fn.registration(*part)
    index = {v.ref(): k for k, v in enumerate(registration.variables)}
    missing = [v.name for v in sub.variables if v.ref() not in index]
    if missing or len(sub.variables) != len(index):
        raise KfacGraphError(f"qmodel_batch_fraction: the registration of the first examples "
                             f"differs from the batch's (variable {missing[:1] or '?'})")
    order = [index[v.ref()] for v in sub.variables]
    forms, own = quadratic_forms(sub, part, [[u[k] for k in order] for u in vectors],
                                 with_part=True)
    if registration.loss.reduction == "sum":  # n examples' sum estimates B's: times B / n
        size = lambda a: tf.cast(tf.shape(batch_tensor(a, "qmodel_batch_fraction"))[0],
                                 tf.float64)
        ratio = size(args) / size(part)
        own = Part(ratio * own.loss, [ratio * c for c in own.linear])
    return forms, own


def batch_forms(fn, registration, args, vectors, fraction=1.0, taps=None):
    """``(forms, part)`` the quadratic model uses: ``quadratic_forms`` of the
    whole batch (differentiating ``taps`` when given) and None, or with
    ``fraction < 1`` ``leading_forms`` of its first examples (``taps``
    unused) and their ``Part``."""
    if fraction < 1:
        return leading_forms(fn, registration, args, vectors, fraction)
    return quadratic_forms(registration, args, vectors, taps), None
