"""Values the loss pass reads from constants and static shapes: the scalar
factors and divisors of the loss (``1/B``, ``1/T``, a loss scale), folded in
numpy over the IR.

Contract: ``evaluate(g, tensor)`` is the numpy value of ``tensor`` when it is
computed from constants and static shapes by the ops of ``_FOLD`` (at most
16 deep), else None; ``const_operand(g, inputs)`` is ``(value, other)``
when one of two operands is such a scalar; ``from_shapes(g, tensor)``: the
tensor reads a ``Shape`` or ``Size`` (a divisor counting the batch at run
time); ``ones_column(g, tensor)``: the tensor is an ``[n, 1]`` column of
ones, by which a matmul sums its other operand's rows (``tf.nn.nce_loss``).
"""
from __future__ import annotations

import networkx as nx
import numpy as np

from passes import ir
from passes.static_eval import strided_slice_index


def const_operand(g, inputs):
    for k, t in enumerate(inputs):
        value = evaluate(g, t)
        if value is not None and np.size(value) == 1:
            return float(np.asarray(value).reshape(())), inputs[1 - k]
    return None, None


_FOLD = {
    "Prod": lambda v, a: np.prod(v[0], axis=_axis(v[1])),
    "Cast": lambda v, a: v[0], "Identity": lambda v, a: v[0],
    "Mul": lambda v, a: v[0] * v[1], "RealDiv": lambda v, a: v[0] / v[1],
    "Maximum": lambda v, a: np.maximum(v[0], v[1]), "Sub": lambda v, a: v[0] - v[1],
    "AddV2": lambda v, a: v[0] + v[1],
    "Pack": lambda v, a: np.stack(v) if all(np.ndim(x) == 0 for x in v) else None,  # scalars
    "StridedSlice": lambda v, a: _sliced(v, a),  # tf.shape(z)[0], folded when z's is static
    # tf.compat.v1.losses' count of the weights broadcast to the terms (num_present)
    "Fill": lambda v, a: np.full(v[0], v[1]) if np.prod(v[0]) <= _MAX_FILL else None,
    "Select": lambda v, a: np.where(*v), "SelectV2": lambda v, a: np.where(*v),
    "Equal": lambda v, a: np.equal(v[0], v[1]), "NotEqual": lambda v, a: np.not_equal(v[0], v[1]),
    "Sum": lambda v, a: np.sum(v[0], axis=_axis(v[1]) if np.size(v[1]) else ()),
    "Range": lambda v, a: np.arange(v[0], v[1], v[2]),
}
_MAX_FILL = 1 << 20


def _axis(value):
    return tuple(np.atleast_1d(value).tolist())


def _sliced(values, attrs):
    index = strided_slice_index(*values[1:], *(attrs.get(k, 0) for k in (
        "begin_mask", "end_mask", "shrink_axis_mask", "ellipsis_mask", "new_axis_mask")))
    return None if index is None else np.asarray(values[0])[index]


def evaluate(g, tensor, depth=0):
    """The value of a tensor computed from constants and static shapes, or None."""
    if depth > 16:
        return None
    node, index = ir.split_tensor(tensor)
    d = g.nodes[node]
    value = ir.const_value(g, tensor)
    if value is not None:
        return value
    if d["op"] in ("Shape", "Size", "Rank", "ZerosLike", "OnesLike"):
        shape = ir.shape_of(g, d["inputs"][0])
        if shape is None or any(s is None for s in shape):
            return None
        return {"Shape": lambda: np.array(shape), "Size": lambda: np.prod(shape),
                "Rank": lambda: np.array(len(shape)), "ZerosLike": lambda: np.zeros(shape),
                "OnesLike": lambda: np.ones(shape)}[d["op"]]()
    fold = _FOLD.get(d["op"])
    if fold is None:
        return None
    values = [evaluate(g, t, depth + 1) for t in d["inputs"]]
    if any(v is None for v in values):
        return None
    return fold(values, d["attrs"])


def from_shapes(g, tensor) -> bool:
    node = ir.split_tensor(tensor)[0]
    return any(g.nodes[n]["op"] in ("Shape", "Size") for n in nx.ancestors(g, node) | {node})


def ones_column(g, tensor) -> bool:
    """Whether ``tensor`` is ``[n, 1]`` of ones: a constant, or a ``Fill`` of 1."""
    shape = ir.shape_of(g, tensor)
    if not shape or len(shape) != 2 or shape[1] != 1:
        return False
    return bool(ir.uniform_value(g, tensor) == 1)
