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

import math
from typing import NamedTuple

import networkx as nx

from passes import batch_flow, ir, row_axes
from passes.batch_flow import static_batch



class Rows(NamedTuple):
    """``B`` examples, ``k`` rows each, along ``axis`` (``k = 1`` on axis 0:
    batch-leading, as the data arguments are; on another axis: the batch
    moved there, a time-major ``[T, B, d]``'s). ``batch`` is None where the
    graph's batch is known only at run time (``passes.shape_probe``), and
    ``per_example`` None where the rows per example are too (tokens of
    sequences of any length)."""

    batch: int | None
    per_example: int | None
    axis: int


def example_rows(g, batched, data, lenient=False, seeds=None) -> dict:
    """``{node: Rows}`` for the ops whose output holds the examples in row
    groups (module docstring). ``batched``: the ops whose leading axis may
    be the batch (the data's and per-example constants, ``batch_flow``);
    ``data``: the ops that depend on the arguments (a matmul's or einsum's
    other operand must not be one: each row would read other examples).
    ``lenient``: where the rows are lost (an op not followed), a data tensor
    leading with the batch (``_batch_leading``) holds them first again, as
    the rest of the pass takes it (``passes.coupling`` follows them so).
    A constant shaped ``[B, ..]`` by coincidence (a ``[q, k]`` grid with
    ``q = B``) mixes no examples into a row. ``seeds``: ``{node: Rows}`` the
    rows start from instead of the arguments (one batch: a gradient
    function's cotangents, ``passes.gradient_coupling``)."""
    if seeds:
        batch, rows = next(iter(seeds.values())).batch, dict(seeds)
    else:
        batch, rows = static_batch(g), {}
    if batch is None:
        return {}
    for node in () if seeds else g.graph["arguments"]:  # the data: the batch on axis 0
        shape = (g.nodes[node]["shapes"] or [None])[0] if node in g else None
        if shape and shape[0] == batch:
            rows[node] = Rows(batch, 1, 0)
    for node in nx.topological_sort(g):
        d = g.nodes[node]
        out = d["shapes"][0] if d["shapes"] else None
        if not out or None in out or node in rows:
            continue
        r = _rows_of(g, d, out, rows, batched, data, batch)
        if r is None and lenient and node in data and _batch_leading(g, node, batch, batched):
            r = Rows(batch, 1, 0)
        if r is not None:
            rows[node] = r
    return rows


def _rows_of(g, d, out, rows, batched, data, batch):
    """The rows op ``d``'s output holds, from its inputs' ``rows``, or None."""
    sources = [ir.split_tensor(t)[0] for t in d["inputs"]]
    if d["op"] == "Reshape":
        return _reshaped(g, d, sources[0], out, rows, batched, batch)
    found = {rows[s] for s in sources if s in rows}
    if d["op"] == "Einsum" and not found:  # an einsum may move the batch off axis 0
        leading = {s: Rows(batch, 1, 0) for s in sources
                   if _batch_leading(g, s, batch, batched)}
        axis = row_axes.axis_after_einsum(d, sources, leading, data, 0) if leading else None
        return Rows(batch, 1, axis) if axis else None
    if len(found) != 1:
        return None
    (r,) = found
    axis = row_axes.axis_after(g, d, sources, r, rows, data, len(out))
    if axis is not None and axis < len(out) and out[axis] == r.batch * r.per_example:
        return r._replace(axis=axis)
    return None


def _reshaped(g, d, source, out, rows, batched, batch):
    """The rows a Reshape's output holds, or None. Its input holds rows
    along axis ``a`` (or is batch-leading: one row each, on axis 0). In
    row-major order each example's rows fill one contiguous block of every
    slab of ``P = prod(in[:a])`` leading indices; an output axis ``a'`` with
    ``prod(out[:a']) = P`` whose size is a multiple of ``B`` cuts each slab
    into ``B`` blocks of the same size, the same examples' blocks in the
    same order: the output holds ``out[a'] / B`` rows per example there
    (one on a later axis; one on the first axis is a batch-leading tensor
    again: ``[k B, d] -> [B, k, d]`` after a Keras Dense on a sequence, or
    Keras's nearest upsampling's tile and reshape)."""
    src = ir.shape_of(g, d["inputs"][0])
    if not src or None in src:
        return None
    if source in rows:
        r = rows[source]
        gained = r.per_example == 1 and r.axis == 0  # batch-leading
    elif _batch_leading(g, source, batch, batched):
        r, gained = Rows(batch, 1, 0), True
    else:
        return None
    prefix = math.prod(src[:r.axis])
    for axis, size in enumerate(out):
        if math.prod(out[:axis]) == prefix and size % batch == 0 and size >= batch:
            if size == batch and axis == 0:  # batch-leading again ([k B, d] -> [B, k, d])
                return Rows(batch, 1, 0)
            if size == batch and gained:
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


def graph_rows(g) -> dict:
    """``example_rows`` of the whole graph, from its arguments (the pipeline
    computes it once, for the layers' uses and the loss's output)."""
    data = ir.reachable_from(g, g.graph["arguments"])
    batched = data | ir.reachable_from(g, batch_flow.batch_sources(g))
    return example_rows(g, batched, data)
