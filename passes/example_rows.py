"""Tensors whose rows hold the examples in groups: ``[k B, ..]`` along some axis.

A Reshape of a tensor whose leading axis is the batch ``B`` into ``N = k B``
rows keeps example ``i`` in rows ``i k .. (i + 1) k - 1`` (row-major order
keeps each example's slab of the buffer contiguous): keras-hub's mixture
of experts routes ``reshape(h, [-1, d])``, Swin attends within windows
``[B nW, N, C]``. Ops that compute each row from the same rows of their
inputs keep the grouping, and transposes and unstacks move the axis it is
on. A tensor a transpose made time-major is never taken for batch-first
(``[T, B, d]`` with ``T = B`` has the shape of one). ``example_rows(g,
batched)`` follows the rows; ``unflatten_dense_rows`` lets a dense layer on
them (on the first axis) read them as ``[B, k, ..]``.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import networkx as nx

from passes import ir
from passes.batch_flow import static_batch

# the output's rows, at the rows' axis, are computed from the same rows of
# the inputs (the other operands broadcast along that axis)
_ELEMENTWISE = frozenset({
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Maximum", "Minimum", "Pow", "Neg", "Square",
    "Sqrt", "Rsqrt", "Exp", "Log", "Erf", "Sigmoid", "Tanh", "Relu", "Relu6", "Elu", "Selu",
    "Softplus", "LeakyRelu", "Cast", "BiasAdd", "SelectV2"})


class Rows(NamedTuple):
    """``B`` examples, ``k`` rows each, along ``axis``."""

    batch: int
    per_example: int
    axis: int


def example_rows(g, batched) -> dict:
    """``{node: Rows}`` for the ops whose output holds the examples in row
    groups (module docstring); ``batched``: the data-dependent ops (a
    matmul's weight operand must not be one)."""
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
            src = ir.shape_of(g, d["inputs"][0])
            first = (rows[sources[0]].axis == 0 if sources[0] in rows else
                     bool(src) and src[0] == batch and sources[0] in batched
                     and not _transposed_from(g, sources[0]))
            if first and out[0] > batch and out[0] % batch == 0:
                rows[node] = Rows(batch, out[0] // batch, 0)
            continue
        found = {rows[s] for s in sources if s in rows}
        if len(found) != 1:
            continue
        (r,) = found
        axis = _axis_after(g, d, sources, r, rows, batched, len(out))
        if axis is not None and axis < len(out) and out[axis] == r.batch * r.per_example:
            rows[node] = r._replace(axis=axis)
    return rows


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
        elif d["op"] not in _ELEMENTWISE and d["op"] not in ("Softmax", "LogSoftmax"):
            return False
        if not d["inputs"]:
            return False
        node = ir.split_tensor(d["inputs"][0])[0]
    return True


def _axis_after(g, d, sources, r, rows, batched, rank):
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
        ok = (a == 0 and sources[0] in rows and sources[1] not in batched
              and not d["attrs"].get("transpose_a"))
        return a if ok else None
    if op == "BatchMatMulV2":  # its batch axes are never contracted
        return a if a < rank - 2 and _aligned(g, d, sources, r, rows, rank) else None
    if op in _ELEMENTWISE:
        return a if _aligned(g, d, sources, r, rows, rank) else None
    return None


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


def unflatten_dense_rows(groups, rows) -> dict:
    """``groups`` (``(kind, keys) -> [(pattern, roles, Use)]``) with each
    dense use whose input ``[k B, ..]`` holds the examples' rows on its first
    axis (``rows``, from ``example_rows``) reading it as ``[B, k, ..]``: its
    ``input_shape``, which the dense kind's operands lay ``a`` and ``g`` out
    by."""
    out = {}
    for key, items in groups.items():
        out[key] = []
        for pattern, roles, use in items:
            source = ir.split_tensor(use.inputs[0])[0] if use.inputs else None
            shape = use.attrs.get("input_shape")
            r = rows.get(source)
            if (key[0] == "dense" and r is not None and r.axis == 0 and shape
                    and "stacked_rows" not in use.attrs):
                use = dataclasses.replace(use, attrs={
                    **use.attrs, "input_shape": (r.batch, r.per_example, *shape[1:])})
            out[key].append((pattern, roles, use))
    return out
