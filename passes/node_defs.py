"""NodeDefs written into a GraphDef by the rewrites that add ops to it
(``grouped_conv3d``, ``table_shapes``, ``kfac_graph.gather_reads``)."""
from __future__ import annotations

import tensorflow as tf

INT32 = tf.int32.as_datatype_enum


def node(name, op, inputs=(), device="", **types):
    """A NodeDef; ``types``: attribute name -> a ``DataType`` enum."""
    out = tf.compat.v1.NodeDef(name=name, op=op, input=list(inputs), device=device)
    for key, value in types.items():
        out.attr[key].type = value
    return out


def const_int(name, value, device=""):
    """An int32 ``Const`` holding ``value`` (a number or a list)."""
    out = node(name, "Const", device=device, dtype=INT32)
    out.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, tf.int32))
    return out
