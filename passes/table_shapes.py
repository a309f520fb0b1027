"""Shapes through table lookups.

A lookup table's ``LookupTableFind(V2)`` (Keras's ``StringLookup`` and
``IntegerLookup`` inside a model) returns a tensor whose shape TensorFlow
infers from the table handle's shape data, which a GraphDef does not keep:
re-imported, every shape after the lookup is unknown, and so is the batch
there (a rule reshaping by the last axis stops). Its value is shaped as its
keys, then as its default value (a row per key). ``shaped_table_finds``
writes that into the graph: the lookup's node is renamed, and a ``Reshape``
of it to ``concat(shape(keys), shape(default))`` takes its name, so every
reader gets the shape, static where the keys' is, and under shape probes
(``passes.shape_probe``) the pinned one.
"""
from __future__ import annotations

from tensorflow.core.framework import graph_pb2

from passes.node_defs import INT32, const_int, node as new_node

FINDS = ("LookupTableFind", "LookupTableFindV2")  # (table, keys, default value)


def shaped_table_finds(graph_def) -> graph_pb2.GraphDef:
    """``graph_def`` with each table lookup's value reshaped as the module
    docstring says (``graph_def`` itself where there is none)."""
    if not any(n.op in FINDS for n in graph_def.node):
        return graph_def
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    added = []
    for node in out.node:
        if node.op not in FINDS:
            continue
        name, keys, default = node.name, node.input[1], node.input[2]
        node.name = f"{name}/kfac_find"
        key_shape = new_node(f"{name}/kfac_key_shape", "Shape", [keys], node.device,
                             T=node.attr["Tin"].type, out_type=INT32)
        value_shape = new_node(f"{name}/kfac_value_shape", "Shape", [default], node.device,
                               T=node.attr["Tout"].type, out_type=INT32)
        axis = const_int(f"{name}/kfac_axis", 0, node.device)
        shape = new_node(f"{name}/kfac_shape", "ConcatV2",
                         [key_shape.name, value_shape.name, axis.name], node.device,
                         T=INT32, Tidx=INT32)
        shape.attr["N"].i = 2
        added += [key_shape, value_shape, axis, shape,
                  new_node(name, "Reshape", [node.name, shape.name], node.device,
                           T=node.attr["Tout"].type, Tshape=INT32)]
    out.node.extend(added)
    return out

