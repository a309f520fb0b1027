"""The IR: a ``networkx.DiGraph`` whose nodes are ops and whose edges are tensors.

Node attributes (all plain Python values):

- ``op``: the op type (``"MatMul"``); resource placeholders resolved to a
  variable get ``"Variable"``.
- ``attrs``: the op's attributes as Python values (strings decoded, lists as
  tuples); small constants, and integer ConcatV2 and Pack of constants alone,
  also carry ``value`` (a numpy array).
- ``inputs``: the data inputs as tensor names ``"node:index"``, in order. This
  is the source of truth; edges mirror it.
- ``raw_inputs``: the data inputs as they were before any pass rewired them.
- ``dtypes`` / ``shapes``: per output, the dtype name and the static shape (a
  tuple with ``None`` for unknown dimensions, or ``None`` for unknown rank).
- ``variable``: for ``"Variable"`` nodes, the key of the variable in
  ``graph.graph["variables"]``.

An edge ``u -> v`` carries ``slots``: a tuple of ``(output_index, input_index)``
pairs, one per tensor of ``u`` that ``v`` reads (an op may read the same tensor
twice, as in ``Mul(x, x)``).

Graph attributes: ``variables`` (key -> ``VariableInfo``), ``arguments`` (the
function arguments' placeholder names, in order), ``output`` (the loss tensor
name) and ``aliases`` (tensor name removed by a pass -> the tensor that now
stands for it).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sized
from typing import Any, Iterable

import networkx as nx
import numpy as np
import tensorflow as tf

from passes.static_eval import StaticEvaluator

_MAX_CONST_ELEMENTS = 64
# integer ops of constants alone whose value ``const_value`` reads: a
# Tensordot's permutation, ``concat([free, axes])``, in a graph traced with
# an unknown batch (Python folds it where the shapes are static)
_FOLDED = frozenset({"ConcatV2", "Pack"})
# ops computing each output element from the same elements of their inputs
# (numpy broadcasting)
ELEMENTWISE = frozenset({
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Maximum", "Minimum", "Pow", "Neg", "Square",
    "Sqrt", "Rsqrt", "Exp", "Log", "Erf", "Sigmoid", "Tanh", "Relu", "Relu6", "Elu", "Selu",
    "Softplus", "LeakyRelu", "Cast", "BiasAdd", "SelectV2", "SquaredDifference", "Identity",
    "StopGradient", "Abs", "Reciprocal", "ClipByValue", "Sin", "Cos", "Sign", "Floor",
    "Softsign", "Log1p", "Expm1", "Erfc", "Less", "LessEqual", "Greater", "GreaterEqual",
    "Equal", "NotEqual", "LogicalAnd", "LogicalOr", "LogicalNot", "IsFinite", "IsNan",
    "ZerosLike", "OnesLike", "Pow", "Xlogy", "Xlog1py", "DivNoNan", "AddN", "Select", "Cosh",
    "Sinh", "Atan"})

# ops whose gradient is zero by construction
GRADIENT_STOPS = frozenset({"StopGradient", "PreventGradient"})


@dataclasses.dataclass(frozen=True)
class VariableInfo:
    """What the IR knows about a variable: its key, name, shape and dtype."""
    key: str
    name: str
    shape: tuple
    dtype: str
    trainable: bool = True


def tensor_name(node: str, index: int = 0) -> str:
    return f"{node}:{index}"


def split_tensor(name: str) -> tuple[str, int]:
    """``"a/b:1"`` -> ``("a/b", 1)``; a bare node name means output 0."""
    node, sep, index = name.rpartition(":")
    if not sep or not index.isdigit():
        return name, 0
    return node, int(index)


def _attr_value(value: tf.compat.v1.AttrValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "s":
        return value.s.decode("utf-8", "replace")
    if kind in ("i", "f", "b"):
        return getattr(value, kind)
    if kind == "type":
        return tf.dtypes.as_dtype(value.type).name
    if kind == "shape":
        return _shape(tf.TensorShape(value.shape))
    if kind == "func":
        return value.func.name
    if kind == "list":
        lst = value.list
        if lst.s:
            return tuple(s.decode("utf-8", "replace") for s in lst.s)
        for field in ("i", "f", "b"):
            if getattr(lst, field):
                return tuple(getattr(lst, field))
        if lst.type:
            return tuple(tf.dtypes.as_dtype(t).name for t in lst.type)
        if lst.shape:
            return tuple(_shape(tf.TensorShape(s)) for s in lst.shape)
        return ()
    return None


def _shape(shape: tf.TensorShape):
    if shape.rank is None:
        return None
    return tuple(shape.as_list())


def from_tf_graph(graph: tf.Graph, arguments: Iterable[str], output: str,
                  variables: dict[str, VariableInfo],
                  placeholder_variables: dict[str, str]) -> nx.DiGraph:
    """Builds the IR from an imported ``tf.Graph``.

    ``placeholder_variables`` maps a resource placeholder (or VarHandleOp) node
    name to the key of the variable it holds; those nodes become ``Variable``.
    """
    g = nx.DiGraph(variables=dict(variables), arguments=tuple(arguments),
                   output=output, aliases={}, tensor_shapes={})
    constants = StaticEvaluator(shapes=False)
    for op in graph.get_operations():
        attrs = {k: _attr_value(op.node_def.attr[k]) for k in op.node_def.attr
                 if not k.startswith("_")}
        data = dict(
            op=op.type, attrs=attrs,
            inputs=tuple(t.name for t in op.inputs),
            raw_inputs=tuple(t.name for t in op.inputs),
            control_inputs=tuple(c.name for c in op.control_inputs),
            dtypes=tuple(t.dtype.name for t in op.outputs),
            shapes=tuple(_shape(t.shape) for t in op.outputs),
            variable=None)
        if op.type == "Const":
            tensor = op.node_def.attr["value"].tensor
            dims = tensor.tensor_shape.dim
            n = int(np.prod([d.size for d in dims])) if dims else 1
            if n <= _MAX_CONST_ELEMENTS:
                data["value"] = tf.make_ndarray(tensor)
            else:  # one value repeated (TensorFlow's splat encoding): tf.zeros([B, d])
                data["splat"] = not tensor.tensor_content and all(
                    not isinstance(v, Sized) or len(v) <= 1 for f, v in tensor.ListFields()
                    if f.name.endswith("_val"))
        elif op.type in _FOLDED and op.outputs[0].dtype in (tf.int32, tf.int64):
            value = constants.value(op.outputs[0])
            if value is not None and np.size(value) <= _MAX_CONST_ELEMENTS:
                data["value"] = value
        if op.name in placeholder_variables:
            key = placeholder_variables[op.name]
            data.update(op="Variable", variable=key, shapes=(variables[key].shape,),
                        dtypes=(variables[key].dtype,))
        g.add_node(op.name, **data)
        for k, shape in enumerate(data["shapes"]):
            g.graph["tensor_shapes"][tensor_name(op.name, k)] = shape
    for name in list(g.nodes):
        _add_input_edges(g, name)
    return g


def _add_input_edges(g: nx.DiGraph, node: str) -> None:
    for slot, t in enumerate(g.nodes[node]["inputs"]):
        src, index = split_tensor(t)
        if g.has_edge(src, node):
            g.edges[src, node]["slots"] += ((index, slot),)
        else:
            g.add_edge(src, node, slots=((index, slot),))


def producer(g: nx.DiGraph, node: str, slot: int) -> tuple[str, int]:
    """The (node, output index) feeding input ``slot`` of ``node``."""
    return split_tensor(g.nodes[node]["inputs"][slot])


def shape_of(g: nx.DiGraph, tensor: str):
    """The static shape of a tensor, also of one a pass has removed."""
    node, index = split_tensor(tensor)
    if node not in g:
        return g.graph.get("tensor_shapes", {}).get(tensor_name(node, index))
    shapes = g.nodes[node]["shapes"]
    return shapes[index] if index < len(shapes) else None


def dtype_of(g: nx.DiGraph, tensor: str) -> str:
    """The dtype name of a tensor (``resolve``'s)."""
    node, index = split_tensor(resolve(g, tensor))
    return g.nodes[node]["dtypes"][index]


def read_shape(g: nx.DiGraph, node: str, tensor: str):
    """The static shape in which ``node`` reads ``tensor`` (one of its inputs
    now): the shape of the original input a pass rewired to ``tensor`` (a
    canonicalised reshape's output); None when ``node`` does not read it."""
    data = g.nodes[node]
    for now, raw in zip(data["inputs"], data["raw_inputs"]):
        if now == tensor:
            return shape_of(g, raw)
    return None


def slice_axes(g: nx.DiGraph, data: dict) -> list | None:
    """Per input axis of a StridedSlice (``data``: its node's), ``(out_axis,
    whole)``: where the axis lands in the output (None: shrunk away) and
    whether the slice keeps all of it (stride 1, start to end); walks the
    spec's ellipsis and new axes. None when the shape or spec is unknown.
    The input is the op's as it reads it (``raw_inputs``: unit axes a pass
    saw through kept), which the spec indexes."""
    shape = shape_of(g, data["raw_inputs"][0])
    begin, end, strides = (const_value(g, t) for t in data["inputs"][1:4])
    if shape is None or begin is None or end is None or strides is None:
        return None
    bit = lambda name, i: (data["attrs"].get(name, 0) >> i) & 1  # noqa: E731
    plain = sum(1 for i in range(len(begin))
                if not bit("ellipsis_mask", i) and not bit("new_axis_mask", i))
    axes, out = [], 0
    for i in range(len(begin)):
        if bit("ellipsis_mask", i):
            axes += [(out + k, True) for k in range(len(shape) - plain)]
            out += len(shape) - plain
        elif bit("new_axis_mask", i):
            out += 1
        elif len(axes) >= len(shape):
            return None
        elif bit("shrink_axis_mask", i):
            axes.append((None, False))
        else:
            dim = shape[len(axes)]
            whole = bool((bit("begin_mask", i) or int(begin[i]) == 0) and int(strides[i]) == 1
                         and (bit("end_mask", i) or (dim is not None and int(end[i]) >= dim)))
            axes.append((out, whole))
            out += 1
    return axes + [(out + k, True) for k in range(len(shape) - len(axes))]


def const_value(g: nx.DiGraph, tensor: str):
    """The numpy value of a small constant tensor, else None."""
    node, index = split_tensor(tensor)
    data = g.nodes[node]
    if index == 0 and "value" in data:
        return data["value"]
    return None


def uniform_value(g: nx.DiGraph, tensor: str):
    """The one value every element of ``tensor`` holds where it is a small
    constant of one value or a ``Fill`` of a constant (``tf.ones_like`` of a
    static shape), else None."""
    d = g.nodes[node_of(g, tensor)]
    value = const_value(g, d["inputs"][1]) if d["op"] == "Fill" else const_value(g, tensor)
    flat = None if value is None else np.ravel(value)
    return flat[0] if flat is not None and flat.size and np.all(flat == flat[0]) else None


def consumers(g: nx.DiGraph, tensor: str) -> list[tuple[str, int]]:
    """(consumer node, input slot) pairs reading ``tensor``."""
    node, index = split_tensor(tensor)
    out = []
    for dst in g.successors(node):
        out.extend((dst, slot) for (i, slot) in g.edges[node, dst]["slots"] if i == index)
    return out


def bypass(g: nx.DiGraph, node: str, output: int, replacement: str) -> None:
    """Rewires every reader of ``node:output`` to read ``replacement`` instead."""
    old = tensor_name(node, output)
    for dst, _ in consumers(g, old):
        inputs = tuple(replacement if t == old else t for t in g.nodes[dst]["inputs"])
        g.nodes[dst]["inputs"] = inputs
        _rebuild_in_edges(g, dst)
    g.graph["aliases"][old] = replacement


def set_inputs(g: nx.DiGraph, node: str, inputs) -> None:
    """``node`` reads ``inputs`` now (its edges rebuilt)."""
    g.nodes[node]["inputs"] = tuple(inputs)
    _rebuild_in_edges(g, node)


def _rebuild_in_edges(g: nx.DiGraph, node: str) -> None:
    for src in list(g.predecessors(node)):
        g.remove_edge(src, node)
    _add_input_edges(g, node)


def node_of(g: nx.DiGraph, tensor: str) -> str:
    """The node that produces ``tensor`` now (``resolve``'s)."""
    return split_tensor(resolve(g, tensor))[0]


def resolve(g: nx.DiGraph, tensor: str) -> str:
    """Follows ``aliases`` to the tensor that stands for ``tensor`` now."""
    aliases = g.graph["aliases"]
    seen = set()
    while tensor in aliases and tensor not in seen:
        seen.add(tensor)
        tensor = aliases[tensor]
    return tensor


def reachable_from(g: nx.DiGraph, sources: Iterable[str]) -> set[str]:
    """Every node reachable from any of ``sources`` (the sources included),
    in one traversal."""
    seen = {s for s in sources if s in g}
    stack = list(seen)
    while stack:
        for nxt in g.successors(stack.pop()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def same_shape(a, b) -> bool:
    """Static shapes equal, an unknown size matching any."""
    return len(a) == len(b) and all(x is None or y is None or x == y for x, y in zip(a, b))


def value_dependents(g: nx.DiGraph, sources: Iterable[str]) -> set[str]:
    """``reachable_from`` without going through ``Shape``, ``Size`` and
    ``Rank``: the nodes whose values depend on the sources' values, not on
    their sizes alone (``range(T)`` from ``tf.shape(x)`` carries no example)."""
    seen = {s for s in sources if s in g}
    stack = list(seen)
    while stack:
        for nxt in g.successors(stack.pop()):
            if nxt not in seen and g.nodes[nxt]["op"] not in ("Shape", "Size", "Rank"):
                seen.add(nxt)
                stack.append(nxt)
    return seen


def reads_values_of(g: nx.DiGraph, node: str, sources) -> bool:
    """Whether ``node``'s value depends on a value of ``sources`` (the
    backward counterpart of ``value_dependents``, walking ``node``'s
    ancestors alone: a ``Shape``, ``Size`` or ``Rank`` reads no value)."""
    sources, seen, stack = set(sources), {node}, [node]
    while stack:
        current = stack.pop()
        if current in sources:
            return True
        if g.nodes[current]["op"] in ("Shape", "Size", "Rank"):
            continue
        for prev in g.predecessors(current):
            if prev not in seen:
                seen.add(prev)
                stack.append(prev)
    return False


def real_tensor(g: nx.DiGraph, tensor: str) -> str:
    """A tensor of the original graph that carries ``tensor``'s value: the
    tensor itself, or for a variable holder (which the front end made up)
    one of the reads of the variable that a pass saw through."""
    node, _ = split_tensor(tensor)
    if node not in g or g.nodes[node]["op"] != "Variable":
        return tensor
    reads = sorted(k for k in g.graph["aliases"] if resolve(g, k) == tensor)
    return reads[0] if reads else tensor
