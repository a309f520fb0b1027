"""Tensors whose rows hold the examples in groups: ``[k B, ..]`` along some axis.

A Reshape of a tensor whose leading axis is the batch ``B`` into ``N = k B``
rows keeps example ``i`` in rows ``i k .. (i + 1) k - 1`` (row-major order
keeps each example's slab of the buffer contiguous): keras-hub's mixture
of experts routes ``reshape(h, [-1, d])``, Swin attends within windows
``[B nW, N, C]``. Ops that compute each row from the same rows of their
inputs keep the grouping, and transposes and unstacks move the axis it is
on. A tensor a transpose made time-major is never taken for batch-first
(``[T, B, d]`` with ``T = B`` has the shape of one). ``example_rows(g,
batched, data)`` follows the rows (through reductions along other axes too: a
norm's moments); ``unflatten_rows`` lets a dense or scale-and-shift layer
on them (on the first axis) read them as ``[B, k, ..]`` (Qwen3.5's gated
RMSNorm on ``[B T H, d]``, RWKV-7's group norm on ``[B T, C]``), and a
grouped dense layer on ``[G, k B, d]`` as ``[G, B, k, d]``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import networkx as nx

from passes import ir
from passes.batch_flow import static_batch

# reductions over axes given by a constant (the rows' axis must not be one of them)
_REDUCTIONS = frozenset({"Mean", "Sum", "Max", "Min", "Prod"})


class Rows(NamedTuple):
    """``B`` examples, ``k`` rows each, along ``axis``."""

    batch: int
    per_example: int
    axis: int


def example_rows(g, batched, data) -> dict:
    """``{node: Rows}`` for the ops whose output holds the examples in row
    groups (module docstring). ``batched``: the ops whose leading axis may
    be the batch (the data's and per-example constants, ``batch_flow``);
    ``data``: the ops that depend on the arguments (a matmul's or einsum's
    other operand must not be one: each row would read other examples).
    A constant shaped ``[B, ..]`` by coincidence (a ``[q, k]`` grid with
    ``q = B``) mixes no examples into a row."""
    batch = static_batch(g)
    rows = {}
    if batch is None:
        return rows
    for node in nx.topological_sort(g):
        d = g.nodes[node]
        out = d["shapes"][0] if d["shapes"] else None
        if not out or None in out:
            continue
        sources = [ir.split_tensor(t)[0] for t in d["inputs"]]
        if d["op"] == "Reshape":
            r = _reshaped(g, d, sources[0], out, rows, batched, batch)
            if r is not None:
                rows[node] = r
            continue
        found = {rows[s] for s in sources if s in rows}
        if d["op"] == "Einsum" and not found:  # an einsum may move the batch off axis 0
            leading = {s: Rows(batch, 1, 0) for s in sources
                       if _batch_leading(g, s, batch, batched)}
            axis = _axis_after_einsum(d, sources, leading, data, 0) if leading else None
            if axis:
                rows[node] = Rows(batch, 1, axis)
            continue
        if len(found) != 1:
            continue
        (r,) = found
        axis = _axis_after(g, d, sources, r, rows, data, len(out))
        if axis is not None and axis < len(out) and out[axis] == r.batch * r.per_example:
            rows[node] = r._replace(axis=axis)
    return rows


def _reshaped(g, d, source, out, rows, batched, batch):
    """The rows a Reshape's output holds, or None. Its input holds rows
    along axis ``a`` (or is batch-leading: one row each, on axis 0). In
    row-major order each example's rows fill one contiguous block of every
    slab of ``P = prod(in[:a])`` leading indices; an output axis ``a'`` with
    ``prod(out[:a']) = P`` whose size is a multiple of ``B`` cuts each slab
    into ``B`` blocks of the same size, the same examples' blocks in the
    same order: the output holds ``out[a'] / B`` rows per example there
    (one on a later axis; one on the first axis is a batch-leading tensor,
    not rows)."""
    src = ir.shape_of(g, d["inputs"][0])
    if not src or None in src:
        return None
    if source in rows:
        r, gained = rows[source], False
    elif _batch_leading(g, source, batch, batched):
        r, gained = Rows(batch, 1, 0), True
    else:
        return None
    prefix = math.prod(src[:r.axis])
    for axis, size in enumerate(out):
        if math.prod(out[:axis]) == prefix and size % batch == 0 and size >= batch:
            if size == batch and (gained or axis == 0):  # batch-leading: no rows
                return None
            return Rows(batch, size // batch, axis)
        if math.prod(out[:axis]) > prefix:
            return None
    return None


def _batch_leading(g, node, batch, batched) -> bool:
    """``node``'s output leads with the batch: its first axis has the batch's
    size, it may be per example, and no transpose brought that axis there."""
    shape = (g.nodes[node]["shapes"] or [None])[0]
    return (bool(shape) and shape[0] == batch and node in batched
            and not _transposed_from(g, node))


def _transposed_from(g, node, depth=16) -> bool:
    """Whether ``node``'s first axis came from another axis by a Transpose up
    its chain of elementwise ops (a time-major ``[T, B, d]`` whose ``T``
    equals ``B`` would read as batch-first)."""
    for _ in range(depth):
        d = g.nodes[node]
        if d["op"] == "Transpose":
            perm = ir.const_value(g, d["inputs"][1])
            if perm is None or int(perm[0]) != 0:
                return True
        elif d["op"] not in ir.ELEMENTWISE and d["op"] not in ("Softmax", "LogSoftmax"):
            return False
        if not d["inputs"]:
            return False
        node = ir.split_tensor(d["inputs"][0])[0]
    return True


def _axis_after(g, d, sources, r, rows, data, rank):
    """The rows' axis in ``d``'s output, or None where the op mixes rows."""
    op, a = d["op"], r.axis
    if op == "Transpose":
        perm = ir.const_value(g, d["inputs"][1])
        return None if perm is None else [int(p) for p in perm].index(a)
    if op == "Unpack":
        u = d["attrs"].get("axis", 0) % (rank + 1)
        return None if u == a else a - (u < a)
    if op in ("Softmax", "LogSoftmax"):
        return a if a != rank - 1 else None
    if op == "MatMul":
        ok = (a == 0 and sources[0] in rows and sources[1] not in data
              and not d["attrs"].get("transpose_a"))
        return a if ok else None
    if op == "BatchMatMulV2":  # its batch axes are never contracted
        return a if a < rank - 2 and _aligned(g, d, sources, r, rows, rank) else None
    if op in ir.ELEMENTWISE:
        return a if _aligned(g, d, sources, r, rows, rank) else None
    if op in _REDUCTIONS and sources[0] in rows:
        return _axis_after_reduction(g, d, a)
    if op == "Einsum":
        return _axis_after_einsum(d, sources, rows, data, a)
    if op == "ExpandDims" and sources[0] in rows:
        e = ir.const_value(g, d["inputs"][1])
        return None if e is None else a + (int(e) % rank <= a)
    if op == "Squeeze" and sources[0] in rows:
        dims = [int(x) % (rank + 1) for x in d["attrs"].get("squeeze_dims") or ()]
        return None if not dims or a in dims else a - sum(x < a for x in dims)
    if op in ("Split", "SplitV"):  # every piece keeps the rows unless cut along them
        value, along = (1, 0) if op == "Split" else (0, 2)
        cut = ir.const_value(g, d["inputs"][along])
        return a if sources[value] in rows and cut is not None and int(cut) % rank != a else None
    if op == "StridedSlice" and sources[0] in rows and not any(s in rows for s in sources[1:]):
        return _axis_after_slice(g, d, a)
    return None


def _axis_after_einsum(d, sources, rows, data, a):
    """An Einsum whose operands in rows name the rows' axis by one letter
    that the others do not read (they must not be data, which would mix
    examples into each row) and that the output keeps."""
    equation = d["attrs"].get("equation", "")
    if "..." in equation or "->" not in equation:
        return None
    ins, out = equation.replace(" ", "").split("->")
    letters = set()
    for s, spec in zip(sources, ins.split(",")):
        if s in rows:
            letters.add(spec[a] if a < len(spec) else None)
        elif s in data:
            return None
    (letter,) = letters if len(letters) == 1 else (None,)
    others = [spec for s, spec in zip(sources, ins.split(",")) if s not in rows]
    if letter is None or letter not in out or any(letter in spec for spec in others):
        return None
    return out.index(letter)


def _axis_after_slice(g, d, a):
    """A StridedSlice that keeps the rows' axis whole (stride 1): where it
    lands, walking the slice's spec (ellipsis, new axes, shrunk axes)."""
    shape = ir.shape_of(g, d["inputs"][0])
    begin, end, strides = (ir.const_value(g, t) for t in d["inputs"][1:4])
    if shape is None or begin is None or end is None or strides is None:
        return None
    bit = lambda name, i: (d["attrs"].get(name, 0) >> i) & 1
    n = len(begin)
    plain = sum(1 for i in range(n) if not bit("ellipsis_mask", i) and not bit("new_axis_mask", i))
    at_in = at_out = 0
    for i in range(n):
        if bit("ellipsis_mask", i):
            span = len(shape) - plain
            if at_in <= a < at_in + span:
                return at_out + a - at_in
            at_in, at_out = at_in + span, at_out + span
        elif bit("new_axis_mask", i):
            at_out += 1
        elif at_in == a:
            whole = ((bit("begin_mask", i) or int(begin[i]) == 0)
                     and (bit("end_mask", i) or int(end[i]) >= shape[a]) and int(strides[i]) == 1)
            return at_out if whole and not bit("shrink_axis_mask", i) else None
        else:
            at_in, at_out = at_in + 1, at_out + (0 if bit("shrink_axis_mask", i) else 1)
    return at_out + a - at_in


def _axis_after_reduction(g, d, a):
    """The rows' axis ``a`` of a reduction's input in its output, or None
    where the reduction runs along it (or its axes are not a constant)."""
    axes = ir.const_value(g, d["inputs"][1])
    rank = len(ir.shape_of(g, d["inputs"][0]) or ())
    if axes is None or not rank:
        return None
    axes = {int(x) % rank for x in ([axes] if axes.ndim == 0 else axes)}
    if a in axes:
        return None
    return a if d["attrs"].get("keep_dims") else a - sum(x < a for x in axes)


def _aligned(g, d, sources, r, rows, rank) -> bool:
    """Every operand holds the same rows, or broadcasts along their axis."""
    for s, t in zip(sources, d["inputs"]):
        if s in rows:
            continue
        shape = ir.shape_of(g, t)
        if shape is None:
            return False
        at = r.axis - (rank - len(shape))  # right-aligned broadcasting
        if at >= 0 and shape[at] != 1:
            return False
    return True


def unflatten_rows(groups, rows) -> dict:
    """``groups`` (``(kind, keys) -> [(pattern, roles, Use)]``) with each use
    whose input ``[k B, ..]`` holds the examples' rows on its first axis
    (``rows``, from ``example_rows``) reading them as ``[B, k, ..]``: a dense
    use its ``input_shape`` (the dense kind's operands lay ``a`` and ``g``
    out by it); a scale-and-shift use (a layer or group norm on rows, a
    shift alone on them) each recorded shape that leads with ``k B``, its
    input, output and operand shapes (its rule sums over the ``k`` rows as
    over any axis its scale broadcasts along)."""
    out = {}
    for key, items in groups.items():
        out[key] = []
        for pattern, roles, use in items:
            source = ir.split_tensor(use.inputs[0] if use.inputs else use.output)[0]
            r = rows.get(source)
            if key[0] == "grouped_dense":
                use = dataclasses.replace(use, attrs=_grouped_attrs(use.attrs, r))
            elif r is not None and r.axis == 0 and key[0] in _UNFLATTEN:
                use = dataclasses.replace(use, attrs=_UNFLATTEN[key[0]](use.attrs, r))
            out[key].append((pattern, roles, use))
    return out


def _split(shape, r):
    """``shape`` read as ``[B, k, ..]`` where it leads with ``k B``."""
    if shape and shape[0] == r.batch * r.per_example:
        return (r.batch, r.per_example, *shape[1:])
    return shape


def _dense_attrs(attrs, r):
    if not attrs.get("input_shape") or "stacked_rows" in attrs:
        return attrs
    return {**attrs, "input_shape": _split(attrs["input_shape"], r)}


def _scale_shift_attrs(attrs, r):
    out = {**attrs, **{k: _split(attrs.get(k), r) for k in ("input_shape", "output_shape")}}
    out["operand_shapes"] = tuple(_split(s, r) for s in attrs.get("operand_shapes") or ())
    return out


def _grouped_attrs(attrs, r):
    """A grouped dense use (``passes.patterns_grouped``) reads its input and
    output ``[G, k B, d]`` as ``[G, B, k, d]``; without the examples' rows
    on that axis it is unsupported."""
    shapes = [attrs.get("input_shape"), attrs.get("output_shape")]
    if r is None or r.axis != 1 or any(not s or len(s) != 3 for s in shapes):
        return {**attrs, "unsupported": "a grouped dense input [G, N, d] whose rows N do "
                "not hold the examples' rows in groups"}
    split = lambda s: (s[0], r.batch, r.per_example, s[2])  # noqa: E731
    return {**attrs, "input_shape": split(shapes[0]), "output_shape": split(shapes[1])}


_UNFLATTEN = {"dense": _dense_attrs, "scale_and_shift": _scale_shift_attrs}
