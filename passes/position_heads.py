"""Whether a loss head is per position of its model output.

A loss head ``l_i(z_i)`` whose ops keep each position of ``z`` apart has a
Hessian that is block-diagonal over the positions, ``K x K`` over ``z``'s
last axis (its classes) per position (``passes.loss_output``: a
Gauss-Newton curvature formed per position; joined outputs formed in
blocks). ``mixing_op(g, z, head)`` walks the head's ops (``head``: the IR
nodes from ``z`` to the terms) and returns the first that mixes positions
or examples, or None. Allowed: elementwise ops (broadcasting against
data), transposes that keep the examples first, softmax and log-softmax
(and, where asked, a row's cross-entropy) over the class axis when it is
last, reductions, reshapes, slices and splits of the class axis alone.
"""
from __future__ import annotations

import networkx as nx
import numpy as np

from passes import ir
from passes.loss_constants import evaluate
from passes.row_axes import axis_as_read

LAST_AXIS = frozenset({"Softmax", "LogSoftmax"})
# a row's cross-entropy over its logits' last axis: the class axis reduced away
ROW_CROSS_ENTROPY = frozenset({"SparseSoftmaxCrossEntropyWithLogits",
                               "SoftmaxCrossEntropyWithLogits"})
REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min", "Prod"})
SLICES = frozenset({"StridedSlice", "Slice", "Split", "SplitV", "Unpack"})


def mixing_op(g, z, head, row_cross_entropy: bool = False) -> str | None:
    """The first head op that is not per position of ``z`` (module docstring).
    Each varying tensor holds ``z``'s class axis at a place counted from its
    end (-1: last; a transpose that keeps the examples first moves it), or
    has lost it to a reduction (None): only a tensor that holds it may be
    reduced, along that axis alone, or go through a softmax, with it last;
    with ``row_cross_entropy``, through a cross-entropy op over it (a
    likelihood's own head, read beside others in joined outputs; a single
    output's is read as its likelihood, or, negated, refused)."""
    classes = ir.shape_of(g, z)[-1]
    where = {ir.split_tensor(z)[0]: -1}
    for node in nx.topological_sort(g.subgraph(head)):
        d = g.nodes[node]
        op, inputs = d["op"], d["inputs"]
        places = {axis_as_read(g, t, raw, where[ir.split_tensor(t)[0]])  # (as the op reads it)
                  for t, raw in zip(inputs, d["raw_inputs"]) if ir.split_tensor(t)[0] in where}
        held = places - {None}
        if len(held) > 1:
            return node
        place = held.pop() if held else None
        slot = 1 if op == "Split" else 0  # (axis, value); its axes index the input as read
        shape = ir.shape_of(g, d["raw_inputs"][slot]) if len(inputs) > slot else None
        rank = len(shape) if shape is not None else None
        if op in ir.ELEMENTWISE or (op in LAST_AXIS and place == -1):
            where[node] = place
        elif row_cross_entropy and op in ROW_CROSS_ENTROPY and place == -1 and [
                t for t in inputs if ir.split_tensor(t)[0] in where] == list(inputs[:1]):
            where[node] = None
        elif op in REDUCTIONS and place is not None and rank and _only_axis(
                g, inputs[1], rank, rank + place):
            where[node] = place if d["attrs"].get("keep_dims") else None
        elif op == "Transpose" and rank and _keeps_examples_first(g, inputs[1]):
            perm = [int(p) for p in ir.const_value(g, inputs[1])]
            where[node] = None if place is None else perm.index(rank + place) - rank
        elif op == "Reshape" and shape is not None and (place is None or (
                place == -1 and shape[-1] == classes
                and (ir.shape_of(g, ir.tensor_name(node)) or [None])[-1] == classes)):
            where[node] = place
        elif op in ("ExpandDims", "Squeeze") and place is None:
            where[node] = None
        elif op in SLICES and rank and place is not None and _slices_only(
                g, d, rank, rank + place):
            where[node] = None if op == "Unpack" or op == "StridedSlice" and ir.slice_axes(
                g, d)[rank + place][0] is None else place  # (shrunk away)
        else:
            return node
    return None


def _slices_only(g, d, rank, axis) -> bool:
    """Whether a slice, split or unstack (``SLICES``) cuts ``axis`` alone
    and keeps every other axis whole, in place (a VAE's ``h[:, :k]``)."""
    op, inputs = d["op"], d["inputs"]
    if op in ("Split", "SplitV"):
        return _only_axis(g, inputs[0] if op == "Split" else inputs[2], rank, axis)
    if op == "Unpack":
        return int(d["attrs"].get("axis", 0)) % rank == axis
    if op == "Slice":
        begin, size = (ir.const_value(g, t) for t in inputs[1:3])
        shape = ir.shape_of(g, d["raw_inputs"][0])
        return begin is not None and size is not None and all(
            k == axis or (int(begin[k]) == 0 and (int(size[k]) == -1 or int(size[k]) == shape[k]))
            for k in range(rank))
    axes = ir.slice_axes(g, d)
    if axes is None or len(axes) != rank:
        return False
    shift = lambda k: k - (1 if axes[axis][0] is None and k > axis else 0)  # noqa: E731
    return all(k == axis or (whole and out == shift(k)) for k, (out, whole) in enumerate(axes))


def _only_axis(g, axes, rank, axis) -> bool:
    value = evaluate(g, axes)
    return value is not None and {int(a) % rank for a in np.atleast_1d(value)} == {axis}


def _keeps_examples_first(g, perm) -> bool:
    value = ir.const_value(g, perm)
    return value is not None and int(np.atleast_1d(value)[0]) == 0
