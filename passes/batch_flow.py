"""Which ops of the IR compute per example, and which weight-only values
reach them.

``batch_sources(g)``: besides the arguments, the ops whose rows are the
examples' although no data flows into them (module functions' docstrings).
``weights_into_data(g, on_path, batched)``: the ops computed from weights
alone whose values flow into an op with an example axis, so a variable read
among them is a use a layer must claim (else the variable is generic).
``static_batch(g)``: the arguments' static batch size, or None.
"""
from __future__ import annotations

import networkx as nx
import numpy as np

from passes import ir


def batch_sources(g) -> list:
    """Constants shaped ``[B, ...]`` for the arguments' static batch ``B``
    that repeat one row (an RNN's zero initial state), and weights or constants tiled or
    broadcast to ``[B, ...]`` (DeBERTa's relative embeddings, repeated over
    the batch; on a batch of one, those to a leading unit axis): every row is
    an example's, so what is computed from them and the weights, row by
    row (the first step of an unrolled loop, the relative embeddings'
    projections), is per example like the data."""
    batch = static_batch(g)
    if batch is None:
        return []
    constants = _repeating_constants(g, lambda shape: shape[0] == batch, rows=True)
    expands = _unit_lead if batch == 1 else _expands_to
    return constants + [n for n, d in g.nodes(data=True)
                        if d["op"] in ("Tile", "BroadcastTo") and expands(g, d, batch)]


def batch_copies(g) -> list:
    """Constants of one value repeated (``tf.ones``) with the static batch's
    size on some axis: a value multiplied by one is spread over the
    examples, each a copy (XLNet's position encodings, ``ones([2T, B, d])
    * pe``), so a layer on it is per example as on a tiled weight."""
    batch = static_batch(g)
    if batch is None:
        return []
    return _repeating_constants(g, lambda shape: batch in shape, rows=False)


def _repeating_constants(g, fits, rows: bool) -> list:
    """``Const`` and ``Fill`` nodes of rank >= 2 whose shape ``fits`` and that
    repeat one row (``rows``) or one value: a zero initial state ``[B, d]``
    holds one row ``B`` times, while rows that differ are data of something
    else that happens to number ``B`` (a graph's node features, ``B`` nodes),
    on which a layer meets no example."""
    out = []
    for n, d in g.nodes(data=True):
        shape = d["shapes"][0] if d["op"] in ("Const", "Fill") and d["shapes"] else None
        if not shape or len(shape) < 2 or not fits(shape):
            continue
        value = d.get("value")
        if value is not None and np.size(value) == 0:  # empty (an accumulator's start): no rows
            continue
        if d["op"] == "Fill" or d.get("splat") or (value is not None and bool(
                np.all(value == (value[:1] if rows else value.flat[0])))):
            out.append(n)
    return out


def _expands_to(g, d, batch) -> bool:
    """Whether the op copies its input ``batch`` times along a new leading
    axis (unit axes before it allowed: ``repeat`` tiles ``[1, B, ...]``)."""
    out = d["shapes"][0] if d["shapes"] else None
    src = ir.shape_of(g, d["inputs"][0])
    if out is None or src is None or len(src) > len(out):
        return False
    for o, s in zip(out, (1,) * (len(out) - len(src)) + tuple(src)):
        if o != 1:
            return o == batch and s == 1
    return False


def _unit_lead(g, d, batch) -> bool:
    """On a batch of one, where every unit axis would read as the batch's:
    whether the op copies its input onto an output that leads with a unit
    axis the input lacks or has as one (``repeat(w, B)``, ``broadcast_to(w,
    [B, H, T, 1])``, ``tile(w, [B, 4, 1])`` traced with ``B = 1``). A
    leading unit axis needs no copying: a model copies a weight explicitly
    to the data's shape, whose leading axis is the batch's."""
    out = d["shapes"][0] if d["shapes"] else None
    src = ir.shape_of(g, d["inputs"][0])
    return (out is not None and src is not None and len(out) >= 2 and out[0] == batch
            and (len(src) < len(out) or (len(src) == len(out) and src[0] == 1)))


_NOT_DIFFERENTIABLE = frozenset({"Shape", "ShapeN", "Size", "Rank", "StopGradient"})


def weights_into_data(g, on_path, batched) -> set:
    """The ops on the loss's path computed from weights and constants alone
    whose values flow on (through floating-point ops) into a data-dependent
    op with an example axis: a variable read there is a use of the variable
    that a layer must claim (DeBERTa's relative embeddings projected by the
    attention's own query and key layers), unlike a weight penalty, whose
    value meets the data only in the scalar loss."""
    into = set()
    for node in reversed(list(nx.topological_sort(g.subgraph(on_path)))):
        d = g.nodes[node]
        if node in batched or d["op"] in _NOT_DIFFERENTIABLE or not any(
                t.startswith(("float", "bfloat", "half", "complex")) for t in d["dtypes"]):
            continue
        for s in g.successors(node):
            if s not in on_path:
                continue
            if s in into or (s in batched and any(shape is None or len(shape) >= 1
                                                  for shape in g.nodes[s]["shapes"])):
                into.add(node)
                break
    return into


def static_batch(g):
    """The leading dimension of the first argument that has a static one
    (None when none has)."""
    return next((s[0] for a in g.graph["arguments"] if a in g
                 for s in g.nodes[a]["shapes"][:1] if s and s[0] is not None), None)


def run_time_batch_axes(g, node) -> tuple:
    """The axes of ``node``'s output that hold the batch, where the batch is
    known at run time only (found by ``passes.shape_probe``; ``()`` else)."""
    return tuple(g.graph.get("batch_axes", {}).get(node, ()))
