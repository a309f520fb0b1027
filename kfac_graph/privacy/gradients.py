"""The privatised gradient: per-example clipping, masking, noise and
normalisation in one compiled function (the engine under ``kg.dp_gradients``,
``kg.DPSGD`` and ``kg.DPModel``).

    g~ = (sum_i sum_k m_i w_{i,k} g_{i,k} + N(0, sigma^2 S^2 I)) / D

``g_{i,k}`` example i's gradient over clipping group k, ``w_{i,k}`` its
clipping weight and ``S`` the sensitivity (``clipping.py``), ``m_i`` the mask
(1 without one), ``sigma`` the noise multiplier, and ``D`` the normaliser of
a mean loss: the expected batch size ``qN`` under Poisson sampling (given as
``denominator``), else the batch size B; a sum loss has ``D = 1``.

``method="reweight"`` computes the per-layer squared norms by the rules'
norm forms (no per-example gradient is written), then one backward pass of
``sum_i stop_gradient(m_i w_{i,k}) l_i`` per clipping group, keeping that
group's variables (flat clipping: one pass, as a batch gradient).
``"materialize"`` builds the ``[B, ...]`` per-example gradients, takes their
norms and contracts them with the weights.
"""
from __future__ import annotations

import tensorflow as tf

from kfac_graph import per_example as pe
from kfac_graph.per_example.gradients import per_layer_results, squared_norms
from kfac_graph.privacy import clipping as clip_lib
from kfac_graph.privacy import noise as noise_lib
from kfac_graph.registration import Registration
from kfac_graph.taps import LayerTaps


def compiled(fn, reg: Registration, method: str, plan: clip_lib.ClipPlan, masked: bool):
    """``run(thresholds [G] float64, noise_multiplier, key [2], denominator
    float64, mask, *args)``
    -> gradients aligned with ``reg.variables``; cached on ``fn`` per
    registration, method, clipping structure and whether a mask is passed
    (``mask`` is ignored when ``masked`` is False; ``denominator <= 0``
    means the batch size)."""
    key = ("privacy", method, id(reg), plan.structure, masked)
    if key in fn.derived:
        return fn.derived[key]
    registry = pe.default_registry()
    variables = list(reg.variables)
    layer_of_variable = [i for i, layer in enumerate(reg.layers) for _ in layer.variables]
    group_of_layer = {i: k for k, g in enumerate(plan.groups) for i in g}

    @tf.function(autograph=False)  # (no tensor-dependent Python control flow)
    def run(thresholds, noise_multiplier, noise_key, denominator, mask, *args):
        mask = mask if masked else None
        reads = variables if method == "reweight" else reg.generic_variables
        taps = LayerTaps.build(reg, args, read_variables=reads)
        batch = taps.batch_size
        if mask is not None:
            tf.debugging.assert_equal(tf.shape(mask)[0], batch,
                                      message="the mask needs one entry per example")
        if method == "reweight":
            layer_sq = per_layer_results(reg, taps, registry, "norms")
            weights = clip_lib.clip_weights(plan, clip_lib.group_squared_norms(plan, layer_sq),
                                            thresholds, mask)
            summed = _reweighted_sums(taps, variables, layer_of_variable, group_of_layer,
                                      weights)
        else:
            per_layer = per_layer_results(reg, taps, registry, "grads")
            layer_sq = [squared_norms(grads) for grads in per_layer]
            weights = clip_lib.clip_weights(plan, clip_lib.group_squared_norms(plan, layer_sq),
                                            thresholds, mask)
            summed = [tf.tensordot(tf.cast(weights[group_of_layer[i]], g.dtype), g, axes=1)
                      for i, grads in enumerate(per_layer) for g in grads]
        stddev = tf.cast(noise_multiplier, tf.float64) * clip_lib.sensitivity(thresholds)
        noisy = [g + z for g, z in zip(summed, noise_lib.gaussian(summed, stddev, noise_key))]
        if reg.loss.reduction != "mean":
            return noisy
        d = tf.cast(denominator, tf.float64)
        d = tf.where(d > 0, d, tf.cast(batch, tf.float64))
        return [g / tf.cast(d, g.dtype) for g in noisy]

    fn.derived[key] = run
    return run


def _reweighted_sums(taps, variables, layer_of_variable, group_of_layer, weights):
    """Per variable: ``sum_i w_{i,k} dl_i/dv`` for its group k, one backward
    pass per group."""
    terms = taps.per_example_loss
    out = [None] * len(variables)
    for k, w in enumerate(weights):
        idx = [j for j, i in enumerate(layer_of_variable) if group_of_layer[i] == k]
        weighted = tf.reduce_sum(tf.stop_gradient(tf.cast(w, terms.dtype)) * terms)
        grads = tf.gradients(weighted, [taps.variable_reads[variables[j].ref()] for j in idx])
        for j, g in zip(idx, grads):
            v = variables[j]
            out[j] = tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g)
    return out
