"""Small integer tensors of the IR that are known when tracing, in numpy.

``constant(g, tensor)`` is the value of ``tensor`` where it is computed
from constants alone by the ops below (index arithmetic such as
``arange(B) * T``, Keras's ``take`` wrapping negative ids by ``where(ids <
0, ids + n, ids)``), else None. Only small values (at most ``MAX_ELEMENTS``)
are computed: these are ids and offsets, not data.
"""
from __future__ import annotations

import networkx as nx
import numpy as np

from passes import ir
from passes.static_eval import strided_slice_index

MAX_ELEMENTS = 4096

_BINARY = {"Mul": np.multiply, "Add": np.add, "AddV2": np.add, "Sub": np.subtract,
           "FloorDiv": np.floor_divide, "FloorMod": np.mod, "Maximum": np.maximum,
           "Minimum": np.minimum, "Less": np.less, "LessEqual": np.less_equal,
           "Greater": np.greater, "GreaterEqual": np.greater_equal, "Equal": np.equal}


def constant(g: nx.DiGraph, tensor: str, depth: int = 16):
    """The numpy value of ``tensor``, or None (module docstring)."""
    value = ir.const_value(g, tensor)
    if value is not None or depth == 0:
        return value
    node, index = ir.split_tensor(tensor)
    if node not in g or index != 0:
        return None
    d = g.nodes[node]
    ins = [constant(g, t, depth - 1) for t in d["inputs"]]
    if any(v is None for v in ins):
        return None
    try:
        out = _apply(d["op"], d["attrs"], ins)
    except (ValueError, TypeError, IndexError):
        return None
    return out if out is not None and np.size(out) <= MAX_ELEMENTS else None


def _apply(op, attrs, ins):
    if op in _BINARY:
        return _BINARY[op](ins[0], ins[1])
    if op in ("Identity", "Cast"):
        return np.asarray(ins[0])
    if op == "Range":
        return np.arange(ins[0], ins[1], ins[2])
    if op in ("SelectV2", "Select"):
        return np.where(ins[0], ins[1], ins[2])
    if op == "ExpandDims":
        return np.expand_dims(ins[0], int(ins[1]))
    if op == "Squeeze":
        dims = tuple(attrs.get("squeeze_dims") or ())
        return np.squeeze(ins[0], axis=dims or None)
    if op == "Reshape":
        return np.reshape(ins[0], [int(x) for x in np.ravel(ins[1])])
    if op == "Pack":
        return np.stack(ins, axis=int(attrs.get("axis", 0)))
    if op == "StridedSlice":
        index = strided_slice_index(*ins[1:4], **{k: int(attrs.get(k, 0)) for k in (
            "begin_mask", "end_mask", "shrink_axis_mask", "ellipsis_mask", "new_axis_mask")})
        return None if index is None else np.asarray(ins[0][index])
    return None
