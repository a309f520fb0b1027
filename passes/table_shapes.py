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

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

FINDS = ("LookupTableFind", "LookupTableFindV2")  # (table, keys, default value)
_INT32 = tf.int32.as_datatype_enum


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
        key_shape = _node(f"{name}/kfac_key_shape", "Shape", [keys], node.device,
                          T=node.attr["Tin"].type, out_type=_INT32)
        value_shape = _node(f"{name}/kfac_value_shape", "Shape", [default], node.device,
                            T=node.attr["Tout"].type, out_type=_INT32)
        axis = _node(f"{name}/kfac_axis", "Const", [], node.device, dtype=_INT32)
        axis.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(0, tf.int32))
        shape = _node(f"{name}/kfac_shape", "ConcatV2",
                      [key_shape.name, value_shape.name, axis.name], node.device,
                      T=_INT32, Tidx=_INT32)
        shape.attr["N"].i = 2
        added += [key_shape, value_shape, axis, shape,
                  _node(name, "Reshape", [node.name, shape.name], node.device,
                        T=node.attr["Tout"].type, Tshape=_INT32)]
    out.node.extend(added)
    return out


def _node(name, op, inputs, device, **types):
    node = graph_pb2.GraphDef().node.add()
    node.name, node.op, node.device = name, op, device
    node.input.extend(inputs)
    for key, value in types.items():
        node.attr[key].type = value
    return node
