"""Which ops of the IR compute per example, and which weight-only values
reach them.

``batch_sources(g)``: besides the arguments, the ops whose rows are the
examples' although no data flows into them (module functions' docstrings).
``weights_into_data(g, on_path, batched)``: the ops computed from weights
alone whose values flow into an op with an example axis, so a variable read
among them is a use a layer must claim (else the variable is generic).
``flattened_rows(g, batched)``: the ops laid out in rows that flatten the
batch with positions, batch-major.
"""
from __future__ import annotations

import dataclasses

import networkx as nx

from passes import ir


def batch_sources(g) -> list:
    """Constants shaped ``[B, ...]`` for the arguments' static batch ``B``
    (an RNN's zero initial state), and weights or constants tiled or
    broadcast to ``[B, ...]`` (DeBERTa's relative embeddings, repeated over
    the batch): every row is an example's, so what is computed from them
    and the weights, row by row (the first step of an unrolled loop, the
    relative embeddings' projections), is per example like the data."""
    batch = _static_batch(g)
    if batch is None:
        return []
    constants = [n for n, d in g.nodes(data=True) if d["op"] in ("Const", "Fill")
                 and d["shapes"] and d["shapes"][0] and len(d["shapes"][0]) >= 2
                 and d["shapes"][0][0] == batch]
    if batch == 1:  # every unit axis would read as the batch's
        return constants
    return constants + [n for n, d in g.nodes(data=True)
                        if d["op"] in ("Tile", "BroadcastTo") and _expands_to(g, d, batch)]


def _expands_to(g, d, batch) -> bool:
    """Whether the op copies its input ``batch`` times along a new leading
    axis (unit axes before it allowed: ``repeat`` tiles ``[1, B, ...]``)."""
    out = d["shapes"][0] if d["shapes"] else None
    node, index = ir.split_tensor(d["inputs"][0])
    src = g.nodes[node]["shapes"][index] if len(g.nodes[node]["shapes"]) > index else None
    if out is None or src is None or len(src) > len(out):
        return False
    for o, s in zip(out, (1,) * (len(out) - len(src)) + tuple(src)):
        if o != 1:
            return o == batch and s == 1
    return False


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


# ops that compute each row of their output from the same row of their
# row-laid-out inputs (softmax over the last axis; a matmul on a weight; a
# batched matmul of two row tensors, which never contracts their rows)
_ROW_WISE = frozenset({
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Maximum", "Minimum", "Pow", "Neg", "Square",
    "Sqrt", "Rsqrt", "Exp", "Log", "Erf", "Sigmoid", "Tanh", "Relu", "Relu6", "Elu", "Selu",
    "Softplus", "LeakyRelu", "Softmax", "LogSoftmax", "Cast", "BiasAdd", "MatMul",
    "BatchMatMulV2", "Transpose"})


def flattened_rows(g, batched) -> dict:
    """``{node: (B, k)}`` for the ops whose output ``[N, ..]`` (``N = k B``)
    holds example ``i`` in rows ``i k .. (i + 1) k - 1``: a Reshape of a
    tensor whose leading axis is the batch (or that is laid out so itself)
    into ``N`` rows, which row-major order keeps grouped by example
    (``reshape(h, [-1, d])`` before a mixture of experts' router, Swin's
    windows ``[B nW, N, C]``), and what row-wise ops compute from them. A
    layer on such rows reads them as ``[B, k, ..]``; ``batched``: the
    data-dependent ops (a matmul's weight operand must not be one)."""
    batch = _static_batch(g)
    rows = {}
    if batch is None:
        return rows
    for node in nx.topological_sort(g):
        d = g.nodes[node]
        out = d["shapes"][0] if d["shapes"] else None
        if not out or len(out) < 2 or out[0] is None:
            continue
        sources = [ir.split_tensor(t)[0] for t in d["inputs"]]
        if d["op"] == "Reshape":
            src = ir.shape_of(g, d["inputs"][0])
            grouped = sources[0] in rows or (src and src[0] == batch and sources[0] in batched)
            if grouped and out[0] > batch and out[0] % batch == 0:
                rows[node] = (batch, out[0] // batch)
            continue
        leads = {rows[s] for s in sources if s in rows}
        if d["op"] not in _ROW_WISE or len(leads) != 1:
            continue
        lead = leads.pop()
        if lead[0] * lead[1] != out[0]:
            continue
        if d["op"] == "MatMul":
            ok = (sources[0] in rows and sources[1] not in batched
                  and not d["attrs"].get("transpose_a"))
        elif d["op"] == "Transpose":
            perm = g.nodes[sources[1]].get("value")
            ok = perm is not None and int(perm[0]) == 0
        else:
            ok = all(s in rows or _broadcasts_over_rows(g, t, len(out))
                     for s, t in zip(sources, d["inputs"]))
        if ok:
            rows[node] = lead
    return rows


def _broadcasts_over_rows(g, tensor, rank) -> bool:
    shape = ir.shape_of(g, tensor)
    return shape is not None and (len(shape) < rank or shape[0] == 1)


def _static_batch(g):
    return next((s[0] for a in g.graph["arguments"] if a in g
                 for s in g.nodes[a]["shapes"][:1] if s and s[0] is not None), None)


def unflatten_dense_rows(groups, rows) -> dict:
    """``groups`` (``(kind, keys) -> [(pattern, roles, Use)]``) with each
    dense use whose input ``[k B, ..]`` is laid out in rows grouped by
    example (``rows``, from ``flattened_rows``) reading it as ``[B, k, ..]``: its
    ``input_shape``, which the dense kind's operands lay ``a`` and ``g`` out
    by."""
    out = {}
    for key, items in groups.items():
        out[key] = []
        for pattern, roles, use in items:
            source = ir.split_tensor(use.inputs[0])[0] if use.inputs else None
            shape = use.attrs.get("input_shape")
            if key[0] == "dense" and source in rows and shape and "stacked_rows" not in use.attrs:
                use = dataclasses.replace(
                    use, attrs={**use.attrs, "input_shape": (*rows[source], *shape[1:])})
            out[key].append((pattern, roles, use))
    return out
