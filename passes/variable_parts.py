"""Parts of variables: a static slice of a trainable variable is read as a
variable of its own, so layer patterns match the ops that apply it.

Contract: ``mark_parts(g) -> g`` on a canonical IR returns a copy in which
each output of a ``Split``, ``SplitV``, ``StridedSlice``, ``Slice`` or
``Unpack`` of a trainable variable (or of a part of one: slices compose),
with constant operands and a static variable shape, whose elements are a
box of the variable in its own order, is read from a new ``"Variable"``
holder of the same key: ``"<slice>/part_<k>"``, with the output's shape and
``part = {"begin": (...), "end": (...)}``, the box in the whole variable's
coordinates. The slice is removed when nothing else reads it. A strided or
reversed slice is no box: it stays, and its variable stays generic.

Why: Keras's recurrent cells slice their weights (GRU's bias ``[2, 3u]``
is split into the input and the recurrent bias; ``reset_after=False``
multiplies by ``recurrent_kernel[:, :2u]`` and ``[:, 2u:]``;
``implementation=1`` slices every gate). A use of a part is exactly a use
of the whole variable whose operands are zero outside the box
(``kfac_graph.layers.parts``), so the layer kinds need no new rule.

The box is found by slicing an array of the variable's flat element
indices the way the graph slices the variable (so every mask, and a
canonicalized unit-axis reshape in between, is handled by numpy itself).
"""
from __future__ import annotations

import networkx as nx
import numpy as np

from passes import ir
from passes.static_eval import strided_slice_index

_SLICES = frozenset({"Split", "SplitV", "StridedSlice", "Slice", "Unpack"})
_MAX_ELEMENTS = 1 << 22  # larger variables are not sliced by any cell we know


def mark_parts(graph: nx.DiGraph) -> nx.DiGraph:
    """The module docstring's contract."""
    g = graph.copy()
    g.graph["aliases"] = dict(graph.graph["aliases"])
    indices = {}  # part holder -> flat element indices of the whole variable
    for node in list(nx.topological_sort(g)):
        data = g.nodes[node]
        if data["op"] not in _SLICES or node not in g:
            continue
        slot = 1 if data["op"] == "Split" else 0
        source = ir.split_tensor(data["inputs"][slot])[0]
        key = g.nodes[source].get("variable")
        if key is None or not g.graph["variables"][key].trainable:
            continue
        whole = indices.get(source)
        if whole is None:
            shape = g.graph["variables"][key].shape
            if not shape or None in shape or int(np.prod(shape)) > _MAX_ELEMENTS:
                continue
            whole = np.arange(int(np.prod(shape))).reshape(shape)
        raw = ir.shape_of(g, data["raw_inputs"][slot])
        if raw is None or None in raw or int(np.prod(raw, dtype=np.int64)) != whole.size:
            continue
        pieces = _slice(g, node, whole.reshape(raw))
        if pieces is None:
            continue
        full_shape = g.graph["variables"][key].shape
        boxes = [_box(piece, full_shape) for piece in pieces]
        if any(box is None for box in boxes):
            continue
        for k, (piece, box) in enumerate(zip(pieces, boxes)):
            holder = _unique(g, f"{node}/part_{k}")
            g.add_node(holder, op="Variable", variable=key, part=box, attrs={}, inputs=(),
                       raw_inputs=(), control_inputs=(), dtypes=(data["dtypes"][k],),
                       shapes=(tuple(piece.shape),))
            indices[holder] = piece
            ir.bypass(g, node, k, ir.tensor_name(holder))
        if g.out_degree(node) == 0:
            g.remove_node(node)
    return g


def _slice(g, node, x):
    """The slice op's outputs applied to ``x``, or None when its operands
    are not constants."""
    data = g.nodes[node]
    op, attrs = data["op"], data["attrs"]
    const = [ir.const_value(g, t) for t in data["inputs"]]
    try:
        if op == "Split":
            return np.split(x, attrs["num_split"], axis=int(const[0]))
        if op == "SplitV":
            sizes, axis = const[1], const[2]
            if sizes is None or axis is None or -1 in list(sizes):
                return None
            return np.split(x, np.cumsum(sizes)[:-1], axis=int(axis))
        if op == "Unpack":
            return [np.take(x, i, axis=attrs.get("axis", 0)) for i in range(attrs["num"])]
        if op == "Slice":
            begin, size = const[1], const[2]
            if begin is None or size is None:
                return None
            return [x[tuple(slice(b, None if s == -1 else b + s) for b, s in zip(begin, size))]]
        begin, end, strides = const[1:4]
        if begin is None or end is None or strides is None:
            return None
        index = strided_slice_index(begin, end, strides, *(attrs.get(k, 0) for k in (
            "begin_mask", "end_mask", "shrink_axis_mask", "ellipsis_mask", "new_axis_mask")))
        return None if index is None else [x[index]]
    except (ValueError, IndexError, TypeError):
        return None


def _box(piece, shape):
    """``{"begin", "end"}`` when ``piece`` holds a box of a variable of
    ``shape`` in row-major order, else None."""
    if piece.size == 0:
        return None
    coords = np.unravel_index(piece.reshape(-1), shape)
    begin = tuple(int(c.min()) for c in coords)
    end = tuple(int(c.max()) + 1 for c in coords)
    box = np.arange(int(np.prod(shape))).reshape(shape)[tuple(map(slice, begin, end))]
    if not np.array_equal(box.reshape(-1), piece.reshape(-1)):
        return None
    return {"begin": begin, "end": end}


def _unique(g, name: str) -> str:
    out, i = name, 1
    while out in g:
        out, i = f"{name}_{i}", i + 1
    return out
