"""Which axes a size computed from shapes counts.

A loss traced with sizes known at run time only divides by sizes computed
from shapes: Keras's ``sum_over_batch_size`` by ``size(terms)`` (``B T``),
a hand-written mean over positions by ``shape(z)[1]`` (``T``, no batch), a
detection loss by its boxes' count. Whether such a divisor counts the
batch decides the reduction: a mean over the batch (each example's term
read without the ``1/B``), or a sum whose terms the divisor scales.

``counts_the_batch(g, tensor) -> bool | None``: whether the scalar
``tensor`` is a product of sizes (``Size``, ``Prod(Shape)``, elements of
``Shape`` sliced with constant bounds, the sum of a ``Fill`` of a folded
shape: tf.compat.v1's ``num_present``; through ``Cast``, and ``Mul`` also by
a scalar of constants, a weight) one of which is a first axis; None where
it is computed otherwise (then the pass keeps reading it as the batch's, as
before). A shape TensorFlow folded to a
constant (a static trace's ``tf.shape(z)``, a ``Const`` named ``Shape``)
counts as one: its value alone cannot say whether ``6`` is ``B = 6`` or
``T = 6``. ``averages_the_examples``: whether a mean over a first axis
averages over the examples. ``summed_rank`` and
``rows_per_example``: whether what a mean reduces holds more than one row
per example (``[B, T]``, or ``[B T]`` flattened), whose count the divisor
then holds too.

``SizeDivisor``: a divisor of the loss that is a size known at run time
only, as the runtime reads it: ``prod(shape(tensor)[axes])`` (a mean over
axes left ``None``), or the scalar ``tensor``'s value (a size computed from
shapes), over the batch ``B`` where that divisor is what makes the
reduction a mean (``sum(l) / size(l)``, Keras's ``sum_over_batch_size``:
``B T / B = T``). ``size_divisor`` reads one from a division by a size.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from passes import ir, loss_logits
from passes.loss_constants import evaluate

_THROUGH = frozenset({"Cast", "Identity"})


@dataclasses.dataclass(frozen=True)
class SizeDivisor:
    """``prod(shape(tensor)[axes])`` (``axes`` given) or ``tensor``'s value
    (``axes`` None), divided by the batch where ``over_batch`` (module
    docstring)."""
    tensor: str
    axes: tuple[int, ...] | None = None
    over_batch: bool = False

    @property
    def words(self) -> str:
        if self.axes is None:
            what = f"the size {self.tensor}"
        else:
            what = f"the size of axis {', '.join(map(str, self.axes))} of {self.tensor}"
        return what + (" over the batch" if self.over_batch else "")


def size_divisor(g, rows, tensor, divisor, batch_mean) -> tuple[bool, SizeDivisor | None]:
    """A loss ``tensor`` divided by ``divisor``, a size computed from shapes:
    ``(batch_mean, the size read at run time or None)``. A size that counts
    the batch (or may: ``counts_the_batch`` None) makes a sum a mean; where
    what it divides sums one term per example, it is ``B`` itself."""
    made_mean = not batch_mean and counts_the_batch(g, divisor) is not False
    batch_mean = batch_mean or made_mean
    if batch_mean and summed_rank(g, rows, tensor) == 1:
        return True, None
    return batch_mean, SizeDivisor(divisor, None, made_mean)


def counts_the_batch(g, tensor) -> bool | None:
    axes = _axes(g, tensor, depth=16)
    return None if axes is None else 0 in axes


def _axes(g, tensor, depth) -> set | None:
    """The axes (of the tensors whose shapes it reads) that ``tensor``
    multiplies, or None."""
    if depth == 0:
        return None
    node = ir.split_tensor(ir.resolve(g, tensor))[0]
    d = g.nodes[node]
    op, inputs = d["op"], d["inputs"]
    if op in _THROUGH:
        return _axes(g, inputs[0], depth - 1)
    if op == "Mul":  # sizes, or a size and a scalar of constants alone (a weight)
        parts = [set() if _scalar(g, t) else _axes(g, t, depth - 1) for t in inputs[:2]]
        return None if None in parts or parts == [set(), set()] else parts[0] | parts[1]
    if op == "Size" or op == "Const" and _folded(node, "Size"):
        return {0}
    if op == "Sum":  # of a tensor of a folded shape: its count (tf.compat.v1's num_present)
        return _axes(g, inputs[0], depth - 1)
    if op == "Fill" and _shape_of_rank(g, inputs[0]) is not None:
        return set(range(_shape_of_rank(g, inputs[0])))
    if op == "Prod":  # of a shape, or of a slice of one (prod(shape(z)[1:]): no batch)
        rank = _shape_of_rank(g, inputs[0])
        return set(range(rank)) if rank is not None else _axes(g, inputs[0], depth - 1)
    rank = _shape_of_rank(g, inputs[0]) if op == "StridedSlice" else None
    if rank is not None:  # shape(z)[k], shape(z)[a:b]; negative bounds count from the end
        begin, end = (ir.const_value(g, t) for t in inputs[1:3])
        if begin is None or end is None or len(begin) != 1:
            return None
        mask = lambda name: d["attrs"].get(name, 0) & 1  # noqa: E731
        start = 0 if mask("begin_mask") else int(begin[0]) % max(rank, 1)
        if mask("shrink_axis_mask"):
            return {start}
        stop = rank if mask("end_mask") else int(end[0]) + (rank if int(end[0]) < 0 else 0)
        return set(range(start, min(stop, rank)))
    return None


def _scalar(g, tensor) -> bool:
    value = evaluate(g, tensor)
    return value is not None and np.size(value) == 1


def _folded(node, op) -> bool:
    """A constant TensorFlow folded ``op`` (``Shape``, ``Size``) of a
    tensor of static shape to: it keeps the op's name (``ones_like``'s
    ``Shape/shape_as_tensor``)."""
    parts = node.rsplit("/", 2)
    return (re.fullmatch(op + r"(_\d+)?", parts[-1]) is not None
            or (parts[-1] == "shape_as_tensor" and len(parts) > 1 and parts[-2] == op))


def _shape_of_rank(g, tensor) -> int | None:
    """The rank of the tensor whose ``Shape`` ``tensor`` is, else None."""
    node = ir.split_tensor(ir.resolve(g, tensor))[0]
    d = g.nodes[node]
    if d["op"] == "Const" and _folded(node, "Shape"):
        value = ir.const_value(g, tensor)
        return None if value is None or np.ndim(value) != 1 else len(value)
    if d["op"] != "Shape" or not d["inputs"]:
        return None
    shape = ir.shape_of(g, d["raw_inputs"][0])  # (as read: unit axes kept)
    return None if shape is None else len(shape)


def rows_per_example(rows, tensor):
    """How many rows of ``tensor`` each example has (1 where the tracker did
    not follow it; None where known at run time only)."""
    r = rows.get(ir.split_tensor(tensor)[0])
    return 1 if r is None or r.axis != 0 else r.per_example


def summed_rank(g, rows, tensor) -> int | None:
    """The rank of what the ``Sum`` under ``tensor`` reduces (through ops
    that pass a value on), or None where there is none; a vector that holds
    several rows per example (``[B T]`` flattened) counts as more than one."""
    for _ in range(len(g)):
        d = g.nodes[ir.split_tensor(tensor)[0]]
        if d["op"] == "Sum":
            shape = ir.shape_of(g, d["inputs"][0])
            if shape is not None and len(shape) == 1 and rows_per_example(
                    rows, d["inputs"][0]) != 1:
                return None
            return None if shape is None else len(shape)
        if d["op"] not in loss_logits.PASS_THROUGH and d["op"] != "Neg" or not d["inputs"]:
            return None
        tensor = d["inputs"][0]
    return None


def averages_the_examples(g, rows, tensor, batch) -> bool:
    """Whether a mean over the first axis of ``tensor`` averages over the
    examples: its rows say the examples are there; where the rows were not
    followed, no reduction over a first axis made ``tensor`` (the outer mean
    of ``reduce_mean(reduce_mean(l, 0))`` over ``[B, T]`` averages over
    ``T``) and its first axis is a multiple of the batch (unknown, where the
    batch is known at run time only)."""
    r = rows.get(ir.split_tensor(tensor)[0])
    if r is not None:
        return r.axis == 0
    shape = ir.shape_of(g, tensor)
    if not shape or _reduced_first_axis(g, tensor):
        return False
    if batch is None:
        return shape[0] is None
    return shape[0] is None or shape[0] >= batch and shape[0] % batch == 0


def _reduced_first_axis(g, tensor) -> bool:
    for _ in range(len(g)):
        d = g.nodes[ir.split_tensor(tensor)[0]]
        if d["op"] in ("Mean", "Sum") and not d["attrs"].get("keep_dims"):
            axes = ir.const_value(g, d["inputs"][1])
            shape = ir.shape_of(g, d["raw_inputs"][0])  # (as read: unit axes kept)
            return axes is not None and bool(shape) and 0 in {
                int(a) % len(shape) for a in np.atleast_1d(axes)}
        if d["op"] not in loss_logits.PASS_THROUGH and d["op"] != "Neg" or not d["inputs"]:
            return False
        tensor = d["inputs"][0]
    return False
