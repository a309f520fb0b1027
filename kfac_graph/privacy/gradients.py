"""The privatised gradient: per-example clipping, masking, noise and
normalisation in one compiled function (the engine under ``kg.dp_gradients``,
``kg.DPSGD`` and ``kg.DPModel``).

    g~ = (sum_i sum_k m_i w_{i,k} g_{i,k} + N(0, sigma^2 S^2 I)) / D

``g_{i,k}`` example i's gradient over clipping group k, ``w_{i,k}`` its
clipping weight and ``S`` the sensitivity (``clipping.py``), ``m_i`` the mask
(1 without one), ``sigma`` the noise multiplier, and ``D`` the normaliser of
a mean loss: the expected batch size ``qN`` under Poisson sampling (given as
``denominator``), else the batch size B; a sum loss has ``D = 1``.

``method="reweight"``: one backward pass gives every layer's output gradient
``G_i = dl_i/ds_i`` (``LayerTaps.output_gradients``); the layers' rules turn
``(a, G)`` into per-example squared norms without writing a per-example
gradient; then each layer's weighted sum ``sum_i w_i dl_i/dW`` is the
gradient of its own op alone, ``tf.gradients(s, W, grad_ys=w * G)`` (the
weights folded into the output gradient along the batch axis: the "ghost"
step, no second pass through the network). That needs the op's output to
have the batch on axis 0 and one use; other layers (shared weights, outputs
with the batch folded into another axis, generic layers) get one backward
pass of ``sum_i stop_gradient(m_i w_{i,k}) l_i`` per clipping group.
``"materialize"`` builds the ``[B, ...]`` per-example gradients, takes their
norms and contracts them with the weights.

A weight penalty in the loss (``LossSpec.penalties``: Keras's
``kernel_regularizer``) reads no example, so it costs no privacy: its
gradient ``dR`` is added to ``g~`` as it is, neither clipped nor noised
(the clipped ``g_{i,k}`` are the examples' own terms').
"""
from __future__ import annotations

import tensorflow as tf

from kfac_graph import invariants
from kfac_graph import layers as layer_kinds
from kfac_graph import per_example as pe
from kfac_graph.per_example.gradients import (generic_jacobians, layer_squared_norms,
                                              penalty_gradients, per_layer_results,
                                              squared_norms)
from kfac_graph.privacy import clipping as clip_lib
from kfac_graph.privacy import noise as noise_lib
from kfac_graph.registration import Registration
from kfac_graph.taps import LayerTaps, layer_operands
from kfac_graph.layers.scalars import as_dtype


def compiled(fn, reg: Registration, method: str, plan: clip_lib.ClipPlan, masked: bool):
    """``run(thresholds [G] float64, noise_multiplier, key [2], denominator
    float64, share float64, mask, *args) -> (loss, gradients aligned with
    reg.variables)``; cached on ``fn`` per registration, method, clipping
    structure and whether a mask is passed (``mask`` is ignored when
    ``masked`` is False; ``denominator <= 0`` means the batch size). The
    noise and the penalty's gradient are scaled by ``share``: 1 on one
    device, ``1 / R`` on each of R replicas that add the same noise (one
    key) to their own clipped sums, so that the replicas' sum is one
    device's ``g~``. ``loss`` is the batch loss at the current weights (not
    private)."""
    key = ("privacy", method, id(reg), plan.structure, masked)
    if key in fn.derived:
        return fn.derived[key]
    registry = pe.default_registry()
    variables = list(reg.variables)
    group_of_layer = {i: k for k, g in enumerate(plan.groups) for i in g}

    @tf.function(autograph=False)  # (no tensor-dependent Python control flow)
    def run(thresholds, noise_multiplier, noise_key, denominator, share, mask, *args):
        mask = mask if masked else None
        reads = variables if method == "reweight" else reg.generic_variables
        taps = LayerTaps.build(reg, args, read_variables=reads)
        batch = taps.batch_size
        if mask is not None:
            tf.debugging.assert_equal(tf.shape(mask)[0], batch,
                                      message="the mask needs one entry per example")
        if method == "reweight":
            summed = _reweight(reg, taps, registry, plan, group_of_layer, thresholds, mask)
        else:
            per_layer = per_layer_results(reg, taps, registry, "grads", penalties=False)
            layer_sq = [squared_norms(grads) for grads in per_layer]
            weights = clip_lib.clip_weights(plan, clip_lib.group_squared_norms(plan, layer_sq),
                                            thresholds, mask)
            summed = [tf.tensordot(tf.cast(weights[group_of_layer[i]], g.dtype), g, axes=1)
                      for i, grads in enumerate(per_layer) for g in grads]
        stddev = as_dtype(noise_multiplier, tf.float64) * clip_lib.sensitivity(thresholds)
        noisy = [g + z * tf.cast(share, z.dtype)
                 for g, z in zip(summed, noise_lib.gaussian(summed, stddev, noise_key))]
        if reg.loss.reduction == "mean":
            d = tf.cast(denominator, tf.float64)
            d = tf.where(d > 0, d, tf.cast(batch, tf.float64))
            noisy = [g / tf.cast(d, g.dtype) for g in noisy]
        # a weight penalty reads no example: its gradient joins unclipped and unnoised
        return taps.loss, [g if p is None else g + tf.cast(p, g.dtype) * tf.cast(share, g.dtype)
                           for g, p in zip(noisy, penalty_gradients(reg, taps))]

    fn.derived[key] = run
    return run


def _reweight(reg, taps, registry, plan, group_of_layer, thresholds, mask):
    """The clipped sums by norms from the rules and the ghost step (module
    docstring)."""
    batch = taps.batch_size
    static_batch = invariants.static_batch(batch)
    outgrads = taps.output_gradients()
    operands = layer_operands(reg, taps, [outgrads])
    jacobians = None
    layer_sq = []
    for index, (layer, uses) in enumerate(zip(reg.layers, operands)):
        if uses is None:  # generic: the norm of its per-example Jacobian
            if jacobians is None:
                jacobians = generic_jacobians(reg, taps, taps.per_example_loss)
            layer_sq.append(squared_norms([jacobians[v.ref()] for v in layer.variables]))
        else:
            layer_sq.append(layer_squared_norms(registry, layer,
                                                [(a, gs[0]) for a, gs in uses], batch))
    weights = clip_lib.clip_weights(plan, clip_lib.group_squared_norms(plan, layer_sq),
                                    thresholds, mask)
    out = {}
    rest = []  # layers summed by a backward pass of the reweighted loss terms
    for index, layer in enumerate(reg.layers):
        outputs = taps.outputs[index]
        ghost = (layer.kind != layer_kinds.GENERIC and layer.uses == 1
                 and static_batch is not None and outputs[0].shape.rank
                 and outputs[0].shape[0] == static_batch)
        if not ghost:
            rest.append(index)
            continue
        s, g = outputs[0], outgrads[index][0]
        w = tf.cast(weights[group_of_layer[index]], g.dtype)
        scaled = g * tf.reshape(w, [-1] + [1] * (g.shape.rank - 1))
        reads = [taps.variable_reads[v.ref()] for v in layer.variables]
        for v, grad in zip(layer.variables, tf.gradients(s, reads, grad_ys=scaled)):
            out[v.ref()] = _dense(grad, v)
    if rest:
        terms = taps.per_example_loss
        for k, w in enumerate(weights):
            members = [i for i in rest if group_of_layer[i] == k]
            if not members:
                continue
            vs = [v for i in members for v in reg.layers[i].variables]
            weighted = tf.reduce_sum(tf.stop_gradient(tf.cast(w, terms.dtype)) * terms)
            grads = tf.gradients(weighted, [taps.variable_reads[v.ref()] for v in vs])
            for v, grad in zip(vs, grads):
                out[v.ref()] = _dense(grad, v)
    return [out[v.ref()] for v in reg.variables]


def _dense(grad, variable):
    if grad is None:
        return tf.zeros(variable.shape, variable.dtype)
    return tf.convert_to_tensor(grad)
