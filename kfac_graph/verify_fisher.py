"""``kg.verify``'s Fisher check: each layer's full Fisher block against the
batch's Fisher computed by brute force.

The block: ``FisherEstimator(fn, estimation_mode, approximations={layer:
"full"})`` after one update (the debiased average is that batch's
estimate). The reference, for ``v`` supported on the layer's variables:
``v.F v = (1/B) sum_i (J_i v).F_i (J_i v)`` (``"exact"``: the distribution's
Fisher ``F_i`` at the model output) or ``(1/B) sum_i (c_i . J_i v)^2``
(``"empirical"``: ``c_i = d(-log p(y_i|z_i))/dz_i`` at the data's
targets), with ``J_i v`` from double-backward Jacobian-vector products
(as ``optimizer.exact_fisher`` takes them, with an embedding's sparse
gradient made dense), no per-example rule involved.

The full block is exact (and so checked) only when no layer couples the
examples, the model output is ``[B, K]``, or in exact mode has positions
and at most ``MAX_COLUMNS`` positions times classes (the estimator takes one
Fisher-square-root column per position and class, ``position_columns=
"separate"``; a per-token loss's weights enter both sides), and the layer
has at most ``max_params`` parameters (the block is a dense ``[n, n]`` matrix); other
layers get a placeholder block that computes nothing.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from kfac_graph import double_backward, token_weights
from kfac_graph.fisher.block_choice import ALIASES, PER_EXAMPLE
from kfac_graph.fisher.blocks_base import FisherBlock
from kfac_graph.fisher.curvature import output_curvature
from kfac_graph.fisher.estimator import FisherEstimator
from kfac_graph.taps import LayerTaps
from kfac_graph.verify_report import Check
from passes import ir

MAX_COLUMNS = 256  # positions x classes: one backward pass each

MODES = ("exact", "empirical")


class _Unchecked(FisherBlock):
    """A block for the layers the Fisher check leaves out: takes the
    estimator's data and keeps nothing."""

    def update(self, data, decay=None):
        return None


class _UncheckedGeneric(_Unchecked):
    stats = PER_EXAMPLE


def _unchecked(var_shapes, attrs=None, **options):
    return _Unchecked(var_shapes, attrs, **options)


def _unchecked_generic(var_shapes, attrs=None, **options):
    return _UncheckedGeneric(var_shapes, attrs, **options)


def skip_reason(reg, layer, coupled: bool, max_params: int, mode: str = "exact") -> str:
    """Why the full block of ``layer`` is not exact here ("" when it is)."""
    if coupled:
        return "couples examples"
    if reg.loss.output is None:
        return "no model output"
    shape = ir.shape_of(reg.ir, reg.loss.output) if reg.ir is not None else None
    if shape is None or any(d is None for d in shape[1:]):
        return "output shape unknown"
    columns = int(np.prod(shape[1:]))
    if len(shape) != 2 and mode != "exact":
        return "output has positions"
    if (len(shape) != 2 or reg.loss.blocks) and columns > MAX_COLUMNS:  # blocks: per value
        return f"{columns:,} position columns > {MAX_COLUMNS}"
    if "full" not in ALIASES[layer.kind]:
        return "no full block"
    if layer.num_parameters > max_params:
        return f"{layer.num_parameters:,} params > {max_params:,}"
    return ""


def fisher_checks(fn, reg, args, mode, directions, rng, max_params, coupled, tol,
                  state, notes) -> list:
    """One ``Check("fisher", ...)`` per layer of ``reg``; appends to ``notes``
    when the curvature at the output is zero. The estimator and
    the reference are built once per registration, mode and set of checked
    layers (``fn.derived``); the directions are their arguments. ``state``
    (``verify_state.SavedState``) runs each from the same variables."""
    reasons = [skip_reason(reg, layer, coupled, max_params, mode) for layer in reg.layers]
    checked = tuple(k for k, r in enumerate(reasons) if not r)
    out = [Check("fisher", "skipped", note=r) for r in reasons]
    if not checked or directions < 1:
        return out
    key = ("verify_fisher", id(reg), mode, checked)
    cached = fn.derived.get(key)
    if cached is None:
        approximations = {layer.name: "full" if not r else
                          _unchecked_generic if layer.kind == "generic" else _unchecked
                          for layer, r in zip(reg.layers, reasons)}
        # decay 0: each update replaces the statistics (the debiased average
        # of one batch is that batch's estimate)
        estimator = FisherEstimator(fn, estimation_mode=mode, approximations=approximations,
                                    damping=0.0, cov_ema_decay=0.0,
                                    position_columns="separate")
        cached = fn.derived[key] = (estimator, _quadratic_forms(reg, mode, checked))
    estimator, forms = cached
    state.run(estimator.update, *args)
    parts = [[rng.standard_normal((directions, *tuple(v.shape))) for v in reg.layers[k].variables]
             for k in checked]
    tangents = [[tf.constant(p, v.dtype) for p, v in zip(layer_parts, reg.layers[k].variables)]
                for k, layer_parts in zip(checked, parts)]
    try:
        exact, flat = state.run(forms, tuple(args), tangents)
    except tf.errors.InvalidArgumentError:
        # TensorFlow's oneDNN rewrites on the CPU break some double backward passes
        # pruned to one layer (a convolution beside another in a concat: "input depth
        # must be evenly divisible by filter depth"); through every variable they run
        whole = fn.derived.setdefault(key + ("whole",), _quadratic_forms(reg, mode, checked,
                                                                         whole=True))
        exact, flat = state.run(whole, tuple(args), tangents)
    exact = exact.numpy()
    for row, (k, layer_parts) in enumerate(zip(checked, parts)):
        matrix = estimator.blocks[k].full_matrix().numpy().astype(np.float64)
        worst, ok = 0.0, True
        for d in range(directions):
            v = np.concatenate([p[d].ravel() for p in layer_parts])
            got, want = float(v @ matrix @ v), float(exact[row, d])
            diff, scale = abs(got - want), abs(want)
            error = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
            ok = ok and diff <= tol[1] + tol[0] * scale
            worst = max(worst, error)
        out[k] = Check("fisher", "pass" if ok else "fail", worst)
    if bool(flat):
        notes.append(f"the loss's Hessian at its output {reg.loss.output}, made positive "
                     "semidefinite, is zero on every example (the loss is concave or piecewise "
                     "linear there): every Fisher block is zero, and K-FAC preconditions by the "
                     "damping alone")
    return out


def _quadratic_forms(reg, mode, checked, whole=False):
    """A ``tf.function`` of ``(args, directions)``, ``directions[r][j]`` shaped
    ``[D, *variable.shape]`` for variable ``j`` of layer ``checked[r]``:
    ``[len(checked), D]``, ``v.F v`` for the batch's exact or empirical Fisher.
    ``whole``: each layer's ``J v`` through every variable of the loss, the
    others' directions zero (the same products, a larger graph)."""

    @tf.function(autograph=False)
    def run(args, directions):
        inner = tf.nest.map_structure(
            lambda a: tf.identity(a) if isinstance(a, tf.Tensor) else a, args)
        taps = LayerTaps.build(reg, inner)
        z = taps.model_output
        z0 = tf.stop_gradient(z)
        weights, kind = taps.token_weights, reg.loss.kind
        # (a "ggn" loss's empirical Fisher needs no Hessian)
        dist = (None if (mode, kind) == ("empirical", "ggn")
                else output_curvature(reg.loss, z0, taps))
        batch = tf.cast(tf.shape(z)[0], z.dtype)
        if dist is None:  # each example's own loss
            c = tf.gradients(tf.reduce_sum(taps.per_example_loss), z)[0]
        elif mode == "empirical":
            y = taps.targets if taps.targets is not None else tf.zeros_like(z0)
            c = tf.gradients(-tf.reduce_sum(dist.log_prob(tf.stop_gradient(y))), z0)[0]
            c = token_weights.scaled(weights, kind, c)
        w = tf.zeros_like(z)
        rows = []
        for k, layer_directions in zip(checked, directions):
            forms = []
            variables = reg.layers[k].variables
            vectors = [[u[d] for u in layer_directions]
                       for d in range(int(layer_directions[0].shape[0]))]
            if whole:
                own = {id(v): j for j, v in enumerate(variables)}
                vectors = [[u[own[id(v)]] if id(v) in own else tf.zeros(v.shape, v.dtype)
                            for v in reg.variables] for u in vectors]
                variables = reg.variables
            for jv in double_backward.jacobian_products(z, w, variables, vectors):
                if mode == "exact":
                    fjv = dist.multiply_fisher(jv)
                    if weights is not None:
                        fjv = token_weights.per_output(weights, kind, fjv) * fjv
                    form = tf.reduce_sum(tf.cast(jv, fjv.dtype) * fjv)
                else:
                    form = tf.reduce_sum(tf.square(tf.reduce_sum(c * jv, axis=-1)))
                forms.append(tf.cast(form, tf.float64) / tf.cast(batch, tf.float64))
            rows.append(tf.stack(forms))
        flat = dist.flat() if hasattr(dist, "flat") else tf.constant(False)
        return tf.stack(rows), flat

    return run
