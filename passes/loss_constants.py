"""Values the loss pass reads from constants and static shapes: the scalar
factors and divisors of the loss (``1/B``, ``1/T``, a loss scale), folded in
numpy over the IR.

Contract: ``evaluate(g, tensor)`` is the numpy value of ``tensor`` when it is
computed from constants and static shapes by the ops of ``_FOLD`` (at most
16 deep), else None; ``const_operand(g, inputs)`` is ``(value, other)``
when one of two operands is such a scalar; ``from_shapes(g, tensor)``: the
tensor reads a ``Shape`` or ``Size`` (a divisor counting the batch at run
time).
"""
from __future__ import annotations

import networkx as nx
import numpy as np

from passes import ir


def const_operand(g, inputs):
    for k, t in enumerate(inputs):
        value = evaluate(g, t)
        if value is not None and np.size(value) == 1:
            return float(np.asarray(value).reshape(())), inputs[1 - k]
    return None, None


_FOLD = {
    "Prod": lambda v, x: np.prod(v[0], axis=_axis(x[1]) if x[1] is not None else None),
    "Cast": lambda v, x: v[0], "Identity": lambda v, x: v[0],
    "Mul": lambda v, x: v[0] * v[1], "RealDiv": lambda v, x: v[0] / v[1],
    "Maximum": lambda v, x: np.maximum(v[0], v[1]), "Sub": lambda v, x: v[0] - v[1],
    "AddV2": lambda v, x: v[0] + v[1],
    "Pack": lambda v, x: np.stack(v) if all(np.ndim(a) == 0 for a in v) else None,  # scalars
}


def _axis(value):
    return tuple(np.atleast_1d(value).tolist())


def evaluate(g, tensor, depth=0):
    """The value of a tensor computed from constants and static shapes, or None."""
    if depth > 16:
        return None
    node, index = ir.split_tensor(tensor)
    d = g.nodes[node]
    value = ir.const_value(g, tensor)
    if value is not None:
        return value
    if d["op"] in ("Shape", "Size"):
        shape = ir.shape_of(g, d["inputs"][0])
        if shape is None or any(s is None for s in shape):
            return None
        return np.array(shape) if d["op"] == "Shape" else np.prod(shape)
    fold = _FOLD.get(d["op"])
    if fold is None:
        return None
    values = [evaluate(g, t, depth + 1) for t in d["inputs"]]
    if any(v is None for v in values):
        return None
    return fold(values, values)


def from_shapes(g, tensor) -> bool:
    node = ir.split_tensor(tensor)[0]
    return any(g.nodes[n]["op"] in ("Shape", "Size") for n in nx.ancestors(g, node) | {node})
