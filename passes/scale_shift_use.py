"""What a scale-and-shift use records for the runtime to rebuild its
normalised input ``xhat`` and to lay out its scale.

Contract: ``use_attrs(g, pattern, roles, main, inputs, attrs) -> (inputs, attrs)``
adds to a matched scale-and-shift use

- ``normalizer`` (the pattern's; for FusedBatchNorm ``fused_inference``,
  ``fused_training`` or ``unrecoverable``) and ``has_scale``;
- ``operand_shapes``: per input tensor, the static shape in which the
  pattern's op reads it (canonicalisation sees through reshapes, so the
  tensor the pass names may hold the same values in another layout: group
  normalisation reads its input as ``[.., G, C/G]``, channels-first batch
  normalisation its mean as ``[1, C, 1, 1]``);
- ``scale_broadcast``: the shape in which the first variable (the scale, or
  the shift alone) multiplies (or is added to) ``xhat``, numpy broadcasting
  against the use's output: the variable's own shape, a layout of it
  (``[1, C, 1, 1]``, ``[G, C/G]``), or for ``BiasAdd`` and ``FusedBatchNorm``
  the channel axis their ``data_format`` names.

The runtime sums ``xhat * g`` over the axes where ``scale_broadcast`` is 1
and reads the rest as the variable's shape (row-major).
"""
from __future__ import annotations

import networkx as nx

from passes import ir
from passes.matcher import role_output
from passes.patterns_scale_shift import tiled_axis


def use_attrs(g: nx.DiGraph, pattern, roles, main, inputs, attrs):
    """``main``: the match's main op (FusedBatchNorm's, for its normaliser)."""
    attrs = {**attrs, "normalizer": pattern.normalizer, "has_scale": "gamma" in pattern.params}
    if pattern.normalizer == "fused":
        inputs, attrs = _fused_normalizer(g, main, inputs, attrs)
        shapes = [ir.shape_of(g, inputs[0])]
    else:
        shapes = [_read_shape(g, pattern, roles, role, where, k)
                  for role, where, k in pattern.inputs]
    attrs["operand_shapes"] = tuple(shapes) + (None,) * (len(inputs) - len(shapes))
    param = pattern.params[0]
    attrs["scale_broadcast"] = scale_broadcast(
        g, roles[_consumers(pattern, param)[0]], roles[param], attrs["output_shape"])
    lead = tiled_axis(g, roles["tile"]) if "tile" in roles else 0
    if lead:  # copies behind unit axes (tf.repeat's [1, B, 1, d]): read batch first
        attrs["output_shape"] = attrs["output_shape"][lead:]
        attrs["scale_broadcast"] = attrs["scale_broadcast"][lead:]
    return inputs, attrs


def scale_broadcast(g: nx.DiGraph, op: str, variable: str, output_shape):
    """The shape in which ``op`` broadcasts ``variable`` against its output."""
    data = g.nodes[op]
    shape = tuple(g.graph["variables"][g.nodes[variable]["variable"]].shape)
    if data["op"] in ("BiasAdd", "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"):
        # (a vector: the variable, or the part of one the op reads, passes.variable_parts)
        shape = tuple(ir.read_shape(g, op, ir.tensor_name(variable)) or shape)
        rank = len(output_shape or ())
        if data["attrs"].get("data_format", "NHWC").startswith("NC") and rank >= 3:
            return (*shape, *(1,) * (rank - 2))
        return shape
    read = ir.read_shape(g, op, ir.tensor_name(variable))
    return tuple(read) if read is not None else shape


def _consumers(pattern, role) -> list:
    return [dst for src, dst, *_ in pattern.edges if src == role]


def _read_shape(g, pattern, roles, role, where, k):
    node = roles[role]
    if where == "in":
        return ir.shape_of(g, g.nodes[node]["raw_inputs"][k])
    consumers = _consumers(pattern, role)
    tensor = role_output(g, pattern, roles, role, k)
    shape = ir.read_shape(g, roles[consumers[0]], tensor) if consumers else None
    return shape if shape is not None else ir.shape_of(g, tensor)


def _fused_normalizer(g, node, inputs, attrs):
    """FusedBatchNorm: in inference the normalised input comes from the
    op's mean and variance inputs; in training from its batch-mean and
    batch-variance outputs (usable only when ``exponential_avg_factor`` is 1,
    else those outputs are running averages)."""
    raw = g.nodes[node]["raw_inputs"]
    if not attrs.get("is_training", True):
        return (inputs[0], raw[3], raw[4]), {**attrs, "normalizer": "fused_inference"}
    if attrs.get("exponential_avg_factor", 1.0) == 1.0:
        return ((inputs[0], ir.tensor_name(node, 1), ir.tensor_name(node, 2)),
                {**attrs, "normalizer": "fused_training"})
    return inputs, {**attrs, "normalizer": "unrecoverable",
                    "unsupported": "fused batch norm in training with exponential_avg_factor "
                                   "!= 1: its batch statistics are not in the graph"}
