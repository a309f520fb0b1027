"""Layers whose normaliser mixes the examples, read from the registration.

Batch normalisation in training mode scales each example by moments of the
whole batch. The pass finds the moments' reduction over the examples where
it follows the examples' rows to them (``passes.coupling``); this reads the
same from the layers the pass matched, whatever ops came before them: a
``scale_and_shift`` layer whose normaliser is FusedBatchNorm in training
mode (``fused_training``), or a ``center_scale`` one whose mean is computed
from the data and has no batch axis (Keras's ``BatchNormalization`` with
``training=True``). ``kg.verify`` skips its one-example checks on them and
DP-SGD refuses them, as it refuses ``reg.coupling``.
"""
from __future__ import annotations

import networkx as nx

from passes import ir


def coupling_layers(reg) -> tuple[str, ...]:
    """The names of the layers whose normaliser mixes the examples: batch
    normalisation in training mode (FusedBatchNorm ``fused_training``, or a
    ``center_scale`` normaliser whose mean is computed from the data without
    a batch axis, Keras's BatchNormalization(training=True))."""
    arguments = set(reg.arguments)
    out = []
    for layer in reg.layers:
        if layer.kind != "scale_and_shift":
            continue
        for attrs, inputs in zip(layer.use_attrs, layer.inputs):
            normalizer = attrs.get("normalizer")
            if normalizer == "fused_training" or (
                    normalizer == "center_scale" and len(inputs) >= 2
                    and _batch_statistic(reg, inputs[0], inputs[1], arguments)):
                out.append(layer.name)
                break
    return tuple(out)


def _batch_statistic(reg, x, mean, arguments) -> bool:
    """Whether ``mean`` is computed from the data and has no batch axis."""
    g = reg.ir
    node = ir.split_tensor(mean)[0]
    if g is None or node not in g or not (arguments & nx.ancestors(g, node)):
        return False
    x_shape, m_shape = ir.shape_of(g, x), ir.shape_of(g, mean)
    if x_shape is None or m_shape is None:
        return True
    if len(m_shape) < len(x_shape):
        return True
    return m_shape[0] == 1 and x_shape[0] != 1
