"""Canonicalize: see through ops that do not change what a layer computes.

Contract: ``canonicalize(g) -> g`` returns a copy of the IR in which every
reader of the output of a *transparent* op reads the op's input instead, and
the transparent op is removed. Transparent ops: ``Identity``, ``IdentityN``,
``Snapshot``, ``ReadVariableOp``; ``Cast`` (mixed precision: a float32
variable read, then cast to float16 or bfloat16 before the op; labels cast
from one integer type to another), but not from a floating dtype to an
integer or bool, which rounds and cuts the gradient (no layer may be
matched through it); and ``Reshape``, ``Squeeze`` and ``ExpandDims`` that
only add or drop unit axes (Keras's bias reshape; Conv1D built as
ExpandDims + Conv2D + Squeeze), and a ``StridedSlice`` that keeps every
axis whole and only adds unit axes (``bias[:, None, :]``); and a
``Reshape`` of a weight read only by elementwise arithmetic (``Mul``,
``Add``, ``AddV2``, ``Sub``): a broadcast layout, as group normalisation's
``[C]`` scale laid out ``[.., G, C/G]``, which a pattern reads back from the
raw operand's shape (``shape_of`` the removed tensor). Removed tensors are
recorded in ``g.graph["aliases"]``; node names are unchanged, so every tensor
left in the IR is a tensor of the original graph. ``StopGradient`` is never
transparent: it changes the gradient.

A ``BiasAdd`` whose bias is a ``Squeeze`` of a computed tensor is read as
the ``AddV2`` of that tensor: Keras's ``ops.add(x, y)`` emits
``bias_add(x, squeeze(y))`` whenever ``y`` squeezes to one axis of ``x``'s
channels' width, so on a batch of one an LSTM cell's ``x W + h R`` (``[1,
4u]`` each) came out as a bias add and the cell's sum of products was not
seen.

An ``Einsum`` of a variable first and a computed tensor second (``"oi,bi->bo"``,
``"io,bi->bo"``: the weights on the left, as papers write ``W x``) is read
with its operands and their subscripts swapped (``"bi,oi->bo"``): the same
product, with the kernel second, where the dense patterns read it; so is a
batched matmul with a 2-D variable on the left (``tf.matmul(W, x)``,
``tf.linalg.matvec(W, x)``: ``passes.weights_left``).
"""
from __future__ import annotations

import networkx as nx

from passes import ir
from passes.weights_left import MATMULS, weights_left

_ALWAYS = frozenset({"Identity", "Snapshot", "ReadVariableOp"})
_UNIT_AXES = frozenset({"Reshape", "Squeeze", "ExpandDims"})
_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
_ELEMENTWISE = frozenset({"Mul", "Add", "AddV2", "Sub"})
_LAYOUT = _ALWAYS | _UNIT_AXES | {"Cast", "Transpose"}


def canonicalize(graph: nx.DiGraph) -> nx.DiGraph:
    g = graph.copy()
    g.graph["aliases"] = dict(graph.graph["aliases"])
    for node in [n for n, d in g.nodes(data=True) if d["op"] == "BiasAdd"]:
        _bias_add_of_product(g, node)
    data_nodes = ir.value_dependents(g, g.graph["arguments"])
    for node in list(nx.topological_sort(g)):
        data = g.nodes[node]
        op = data["op"]
        if op == "IdentityN":
            for k, t in enumerate(data["inputs"]):
                ir.bypass(g, node, k, t)
        elif (op in _ALWAYS or (op == "Cast" and not _cuts_gradient(data))
              or ((op in _UNIT_AXES or (op == "StridedSlice" and _whole_slice(g, node)))
                  and _only_unit_axes(g, node, node in data_nodes))):
            if not data["inputs"]:
                continue
            ir.bypass(g, node, 0, data["inputs"][0])
        else:
            continue
        if g.out_degree(node) == 0:
            g.remove_node(node)
    for node in [n for n, d in g.nodes(data=True) if _weight_layout(g, n, d)]:
        ir.bypass(g, node, 0, g.nodes[node]["inputs"][0])
        g.remove_node(node)
    for node in [n for n, d in g.nodes(data=True) if d["op"] == "Einsum"]:
        _kernel_second(g, node)
    for node in [n for n, d in g.nodes(data=True) if d["op"] in MATMULS]:
        weights_left(g, node)
    g.graph["output"] = ir.resolve(g, g.graph["output"])
    return g


def _bias_add_of_product(g: nx.DiGraph, node: str) -> None:
    """``BiasAdd(x, Squeeze(y))`` with ``y`` of rank >= 2 computed by an op
    (not a weight or constant laid out: Keras's channels-first bias is
    ``squeeze(reshape(b, [1, C, 1, 1]))``): ``AddV2(x, y)`` in the IR
    (module docstring)."""
    data = g.nodes[node]
    if len(data["inputs"]) != 2:
        return
    name = ir.split_tensor(data["inputs"][1])[0]
    squeeze = g.nodes[name]
    if squeeze["op"] != "Squeeze" or not squeeze["inputs"]:
        return
    y = squeeze["inputs"][0]
    shape, source = ir.shape_of(g, y), ir.split_tensor(y)[0]
    while g.nodes[source]["op"] in _LAYOUT and g.nodes[source]["inputs"]:
        source = ir.split_tensor(g.nodes[source]["inputs"][0])[0]
    if shape is None or len(shape) < 2 or g.nodes[source]["op"] in ("Variable", "Const"):
        return
    data["op"] = "AddV2"
    data["attrs"] = {k: v for k, v in data["attrs"].items() if k != "data_format"}
    ir.set_inputs(g, node, (data["inputs"][0], y))
    if g.out_degree(name) == 0:  # (else the product has another reader)
        g.remove_node(name)


def _cuts_gradient(data) -> bool:
    """A ``Cast`` from a floating dtype to another kind (an integer, bool):
    no gradient flows through it."""
    return data["attrs"].get("SrcT") in _FLOATS and data["attrs"].get("DstT") not in _FLOATS


def _only_unit_axes(g: nx.DiGraph, node: str, on_data: bool) -> bool:
    """True when input and output shapes agree once unit axes are dropped.

    Unknown dimensions must line up one to one (a ``None`` batch axis kept in
    place; an ExpandDims, or a whole slice that adds unit axes, keeps them
    all); an unknown rank is never transparent. On data (values computed
    from the arguments', not from their sizes alone), the leading (batch)
    axis must stay put: a batch of one reshaped away is not a unit axis."""
    before = ir.shape_of(g, g.nodes[node]["inputs"][0])
    after = g.nodes[node]["shapes"][0]
    if before is None or after is None:
        return False
    if on_data and (not before or not after or before[0] != after[0]):
        return False
    squeeze = lambda s: tuple(d for d in s if d != 1)  # noqa: E731
    if g.nodes[node]["op"] in ("ExpandDims", "StridedSlice"):  # unit axes added (a slice:
        return squeeze(before) == squeeze(after)  # _whole_slice's), the others kept in order
    if squeeze(before) != squeeze(after):
        return False
    dims = g.nodes[node]["attrs"].get("squeeze_dims") or ()
    raw = ir.shape_of(g, g.nodes[node]["raw_inputs"][0])
    if g.nodes[node]["op"] == "Squeeze" and dims and raw:  # named unit axes dropped
        return all(raw[d] == 1 for d in dims)  # (Conv1D's at any length), the rest in order
    return sum(d is None for d in before) <= 1


def _whole_slice(g: nx.DiGraph, node: str) -> bool:
    """A StridedSlice that keeps every axis whole and only adds unit axes
    (``bias[:, None, :]``: GPT-OSS's per-expert biases)."""
    axes = ir.slice_axes(g, g.nodes[node])
    return axes is not None and all(whole for _, whole in axes)


def _weight_layout(g: nx.DiGraph, node: str, data: dict) -> bool:
    """A Reshape of a variable whose every reader is elementwise arithmetic."""
    if data["op"] != "Reshape" or not data["inputs"]:
        return False
    src = ir.split_tensor(data["inputs"][0])[0]
    readers = list(g.successors(node))
    return (g.nodes[src]["op"] == "Variable" and bool(readers)
            and all(g.nodes[r]["op"] in _ELEMENTWISE for r in readers))


def _kernel_second(g: nx.DiGraph, node: str) -> None:
    """An Einsum ``w,x->y`` of a variable ``w`` and a computed ``x`` read as
    ``x,w->y`` (the module docstring)."""
    data = g.nodes[node]
    equation = data["attrs"].get("equation", "").replace(" ", "")
    if len(data["inputs"]) != 2 or equation.count("->") != 1 or equation.count(",") != 1:
        return
    first, second = (g.nodes[ir.node_of(g, t)].get("variable") for t in data["inputs"])
    if first is None or second is not None:
        return
    operands, out = equation.split("->")
    w, x = operands.split(",")
    data["attrs"] = {**data["attrs"], "equation": f"{x},{w}->{out}"}
    data["raw_inputs"] = data["raw_inputs"][::-1]
    ir.set_inputs(g, node, data["inputs"][::-1])
