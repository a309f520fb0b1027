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
"""
from __future__ import annotations

import math

import tensorflow as tf

from kfac_graph import token_weights
from kfac_graph.fisher import at_least_float32, make_distribution
from kfac_graph.optimizer.example_cuts import cut_examples
from kfac_graph.taps import LayerTaps
from passes.errors import KfacGraphError


def jacobian_vector_products(registration, args, vectors, taps=None):
    """``[J u for u in vectors]`` (each shaped like the model output) and ``z``.
    ``taps``: a forward pass of ``args`` already in this graph (``LayerTaps``)
    to differentiate, instead of importing the graph again."""
    reg = registration
    variables = list(reg.variables)
    if taps is None:
        inner = tf.nest.map_structure(
            lambda a: tf.identity(a) if isinstance(a, tf.Tensor) else a, args)
        taps = LayerTaps.build(reg, inner)
    z = taps.model_output
    if z is None:
        raise ValueError("the loss pass found no model output to take the Fisher at")
    w = tf.zeros_like(z)
    r = tf.gradients(z, variables, grad_ys=w)
    # dense: an embedding's IndexedSlices cannot be differentiated again
    pairs = [(k, tf.convert_to_tensor(g)) for k, g in enumerate(r) if g is not None]
    out = []
    for u in vectors:
        jv = tf.gradients([g for _, g in pairs], w,
                          grad_ys=[tf.cast(u[k], g.dtype) for k, g in pairs])[0]
        out.append(tf.zeros_like(z) if jv is None else jv)
    return out, z


def quadratic_forms(registration, args, vectors, taps=None):
    """``[[u_a . F u_b]]`` over ``vectors`` (each a list aligned with the
    registration's variables); ``taps`` as for ``jacobian_vector_products``.
    A weighted per-token loss weighs each token's ``F_it`` by its ``w_it``
    (``kfac_graph.token_weights``)."""
    if taps is None:
        inner = tf.nest.map_structure(
            lambda a: tf.identity(a) if isinstance(a, tf.Tensor) else a, args)
        taps = LayerTaps.build(registration, inner)
    jvs, z = jacobian_vector_products(registration, args, vectors, taps)
    jvs, z = [at_least_float32(jv) for jv in jvs], at_least_float32(z)
    kind = registration.loss.kind
    dist = make_distribution(kind, tf.stop_gradient(z))
    batch = tf.cast(tf.shape(z)[0], z.dtype)
    fjvs = [dist.multiply_fisher(jv) for jv in jvs]
    if taps.token_weights is not None:
        fjvs = [token_weights.per_output(taps.token_weights, kind, f) * f for f in fjvs]
    n = len(vectors)
    return [[tf.reduce_sum(jvs[a] * fjvs[b]) / batch for b in range(n)] for a in range(n)]


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
    """``quadratic_forms`` on the first ``ceil(fraction B)`` examples of
    ``args`` (module docstring); ``fn``: the ``kg.auto_register``ed loss,
    registered again for their shape; ``vectors`` aligned with
    ``registration``'s variables."""
    part = leading_examples(args, fraction)
    sub = fn.registration(*part)
    index = {v.ref(): k for k, v in enumerate(registration.variables)}
    missing = [v.name for v in sub.variables if v.ref() not in index]
    if missing or len(sub.variables) != len(index):
        raise KfacGraphError(f"qmodel_batch_fraction: the registration of the first examples "
                             f"differs from the batch's (variable {missing[:1] or '?'})")
    order = [index[v.ref()] for v in sub.variables]
    return quadratic_forms(sub, part, [[u[k] for k in order] for u in vectors])


def batch_forms(fn, registration, args, vectors, fraction=1.0, taps=None):
    """The forms the quadratic model uses: ``quadratic_forms`` of the whole
    batch (differentiating ``taps`` when given), or with ``fraction < 1``
    ``leading_forms`` of its first examples (``taps`` unused)."""
    if fraction < 1:
        return leading_forms(fn, registration, args, vectors, fraction)
    return quadratic_forms(registration, args, vectors, taps)
