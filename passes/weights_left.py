"""A batched matmul with the weights on the left, read as the Einsum it is.

``BatchMatMulV2(W, x)`` with ``W`` a 2-D variable ``[d_out, d_in]`` and ``x``
``[B, .., d_in, n]`` (rank r >= 3, read as the op reads it) computes

    y[b, .., o, q] = sum_p W[o, p] x[b, .., p, q],

the Einsum ``"ab..pq,rp->ab..rq"`` (``adj_x``: ``W`` stored ``[d_in, d_out]``,
``"ab..pq,pr->ab..rq"``): a dense layer contracting ``x``'s second-to-last
axis, at every position of its other axes but the first (a 1x1
channels-first convolution; ``passes.einsum_2d``'s token-mixing form, which
reads ``x`` with ``p`` moved last and ``y`` with ``r`` moved last).
``tf.linalg.matvec(W, x)`` is this op on ``expand_dims(x, -1)`` (``n = 1``),
its output squeezed. ``tf.matmul(W, x)`` for ``x`` ``[B, d_in, n]`` is it
with ``n`` positions.

Contract: ``weights_left(g, node)`` relabels such a node of the IR (in place)
as that Einsum with its operands swapped, the computed one first, where the
dense patterns read it; the node keeps its name and output, so the graph
that is run is unchanged. Other nodes are left as they are (an ``adj_y``
contracts ``x``'s last axis: no such form; a ``W`` with batch axes, or an
``x`` of unknown rank, neither).
"""
from __future__ import annotations

import string

import networkx as nx

from passes import ir

MATMULS = frozenset({"BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})


def weights_left(g: nx.DiGraph, node: str) -> None:
    data = g.nodes[node]
    attrs = data["attrs"]
    if data["op"] not in MATMULS or len(data["inputs"]) != 2 or attrs.get("adj_y"):
        return
    first, second = (g.nodes[ir.node_of(g, t)].get("variable") for t in data["inputs"])
    if first is None or second is not None:
        return
    w_shape, x_shape = (ir.shape_of(g, t) for t in data["raw_inputs"])
    if w_shape is None or x_shape is None or len(w_shape) != 2 or len(x_shape) < 3:
        return
    lead = string.ascii_lowercase[:len(x_shape) - 2]
    kernel = "pr" if attrs.get("adj_x") else "rp"
    equation = f"{lead}pq,{kernel}->{lead}rq"
    data["op"] = "Einsum"
    data["attrs"] = {**{k: v for k, v in attrs.items() if k not in ("adj_x", "adj_y")},
                     "equation": equation, "N": 2}
    data["raw_inputs"] = data["raw_inputs"][::-1]
    ir.set_inputs(g, node, data["inputs"][::-1])
