"""A table read by ``ResourceGather`` or ``ResourceGatherNd``, made replaceable.

``tf.nn.embedding_lookup``, ``tf.gather`` (and ``embedding_lookup_sparse``)
on a ``tf.Variable`` gather rows straight from the variable's handle:
``ResourceGather(handle, ids)``; ``tf.gather_nd`` writes
``ResourceGatherNd(handle, indices)``. The generic rule takes per-example
gradients with respect to the variable's value, and DP-SGD's reweighting
takes every layer's, by replacing its reads
(``LayerTaps.build(read_variables=...)``), and a read inside an op that
takes the handle cannot be replaced. ``split_gathers`` writes each such op
as ``GatherV2(ReadVariableOp(handle), ids, axis=0)`` (``GatherNd(
ReadVariableOp(handle), indices)``) under the same name, so its output
``table[ids]``, its gradient and every tensor name stay as they were.
"""
from __future__ import annotations

from tensorflow.core.framework import graph_pb2

from passes.node_defs import INT32, const_int, node as new_node

# the op reading a variable's handle -> the op on its value
_GATHERS = {"ResourceGather": "GatherV2", "ResourceGatherNd": "GatherNd"}


def split_gathers(graph_def, placeholders) -> graph_pb2.GraphDef:
    """``graph_def`` with every ``ResourceGather`` of a variable held by one of
    ``placeholders`` (node names) written as a read, then a ``GatherV2``;
    ``graph_def`` itself where there is none."""
    if not any(n.op in _GATHERS and n.input and n.input[0] in placeholders
               for n in graph_def.node):
        return graph_def
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    added = []
    for node in out.node:
        if node.op not in _GATHERS or not node.input or node.input[0] not in placeholders:
            continue
        dtype = node.attr["dtype"].type
        read = new_node(f"{node.name}/kfac_read", "ReadVariableOp", [node.input[0]], node.device,
                        dtype=dtype)
        ids, controls = node.input[1], [t for t in node.input[2:] if t.startswith("^")]
        inputs, added = [read.name, ids], added + [read]
        if node.op == "ResourceGather":
            axis = const_int(f"{node.name}/kfac_axis", 0, node.device)
            inputs, added = inputs + [axis.name], added + [axis]
            node.attr["Taxis"].type = INT32
        node.op = _GATHERS[node.op]
        del node.input[:]
        node.input.extend(inputs + controls)
        for stale in ("dtype", "validate_indices"):
            if stale in node.attr:
                del node.attr[stale]
        node.attr["Tparams"].type = dtype
    out.node.extend(added)
    return out

