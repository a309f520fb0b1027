"""Layer patterns, declared as data.

A ``Pattern`` is a small graph of roles. Each role is an ``Op``: a set of op
types (or any op), whether it must be a trainable variable, an optional
predicate on the op's attributes, and whether the node becomes the match's own
(``exclusive``: not shared with another match). Edges name the input slot of
the consumer (``None``: any slot, for commutative ops). ``params`` lists the
variable roles (kernel or scale first), ``inputs`` the tensors the layer reads
as ``(role, "in", k)`` (the op's k-th input as the original graph has it) or
``(role, "out", k)`` (the role's k-th output), ``output`` the role producing the pre-activation.

This module holds the dense, convolution and embedding patterns; the
scale-and-shift ones are in ``passes.patterns_scale_shift``, and the ordered
catalogue of all of them in ``passes.catalogue``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import networkx as nx

from passes import ir
from passes.einsum_2d import einsum_2d_form
from passes.bias_axes import bias_fits, dense_channel_axis, var_shape  # noqa: F401


@dataclasses.dataclass(frozen=True)
class Op:
    types: frozenset[str] | None = None
    variable: bool = False
    where: Callable[[dict], bool] | None = None
    exclusive: bool = True

    def accepts(self, g: nx.DiGraph, node: str) -> bool:
        data = g.nodes[node]
        if self.variable and data.get("lora") is None:  # (an adapter's kernel: passes.lora)
            key = data.get("variable")
            if data["op"] != "Variable" or key is None or not g.graph["variables"][key].trainable:
                return False
        elif self.types is not None and data["op"] not in self.types:
            return False
        return self.where is None or self.where(data)


@dataclasses.dataclass(frozen=True)
class Pattern:
    name: str
    kind: str
    nodes: Mapping[str, Op]
    edges: tuple
    anchor: str
    output: str
    params: tuple[str, ...]
    inputs: tuple[tuple[str, str, int], ...]
    normalizer: str = ""
    check: Callable[[nx.DiGraph, dict], bool] | None = None


ANY = Op(exclusive=False)
# a whole variable; VAR_PART also a box of one (passes.variable_parts): a dense
# kernel, a scale or a shift alone, whose kinds pad a part's operands
VAR = Op(variable=True, exclusive=False, where=lambda data: data.get("part") is None)
VAR_PART = Op(variable=True, exclusive=False)


def weighted_roles(pattern: Pattern) -> set:
    """The pattern's roles that depend on its weights, its output aside."""
    flow = nx.DiGraph([(src, dst) for src, dst, _ in pattern.edges])
    return set().union(*(nx.descendants(flow, r) for r in pattern.params if r in flow)) - {
        pattern.output}


def ops(*types, where=None) -> Op:
    return Op(frozenset(types), where=where)


def _attr(name, value):
    return lambda data: data["attrs"].get(name, value) == value


# --- dense -----------------------------------------------------------------

def einsum_kernel_layout(equation: str) -> str | None:
    """For an Einsum ``x,w->y`` that applies a 2-D ``w`` as a dense layer
    (``einsum_2d``), ``"io"`` (w is [in, out]) or ``"oi"`` ([out, in]); else None."""
    form = einsum_2d_form(equation)
    return None if form is None else form[0]


_MATMUL = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum")


def _dense_op(data) -> bool:
    a = data["attrs"]
    if data["op"] == "Einsum":
        return einsum_kernel_layout(a.get("equation", "")) is not None
    return not a.get("transpose_a", False) and not a.get("adj_x", False)


def _dense_kernel_ok(g, m) -> bool:
    return len(var_shape(g, m["w"])) == 2


def _conv_bias_ok(g, m) -> bool:
    fmt = g.nodes[m["op"]]["attrs"].get("data_format", "NHWC")
    rank = len(g.nodes[m["op"]]["shapes"][0] or ())
    return bias_fits(g, m, channel_axis=1 if fmt.startswith("NC") else -1) if rank else False


def _merges_leading(g, m) -> bool:
    """Tensordot: Reshape [.., d] -> [N, d], MatMul, Reshape [N, o] -> [.., o]."""
    before = ir.shape_of(g, g.nodes[m["flat"]]["raw_inputs"][0])  # (as read: unit axes kept)
    flat = g.nodes[m["flat"]]["shapes"][0]
    after = g.nodes[m["unflat"]]["shapes"][0]
    if before is None or flat is None or after is None or len(before) < 3:
        return False
    return (len(flat) == 2 and flat[-1] == before[-1] and len(after) == len(before)
            and tuple(after[:-1]) == tuple(before[:-1]) and _dense_kernel_ok(g, m))


ADD = ops("BiasAdd", "Add", "AddV2")
MATMUL = ops(*_MATMUL, where=_dense_op)

DENSE_TENSORDOT_BIAS = Pattern(
    "dense_tensordot_bias", "dense",
    {"x": ANY, "flat": ops("Reshape"), "op": ops("MatMul", where=_dense_op),
     "unflat": ops("Reshape"), "w": VAR_PART, "b": VAR, "add": ADD},
    (("x", "flat", 0), ("flat", "op", 0), ("w", "op", 1), ("op", "unflat", 0),
     ("unflat", "add", None), ("b", "add", None)),
    anchor="op", output="add", params=("w", "b"), inputs=(("flat", "in", 0),),
    check=lambda g, m: _merges_leading(g, m) and bias_fits(
        g, {**m, "op": m["unflat"]}, -1))
DENSE_TENSORDOT = Pattern(
    "dense_tensordot", "dense",
    {"x": ANY, "flat": ops("Reshape"), "op": ops("MatMul", where=_dense_op),
     "unflat": ops("Reshape"), "w": VAR_PART},
    (("x", "flat", 0), ("flat", "op", 0), ("w", "op", 1), ("op", "unflat", 0)),
    anchor="op", output="unflat", params=("w",), inputs=(("flat", "in", 0),),
    check=_merges_leading)
DENSE_BIAS = Pattern(
    "dense_bias", "dense",
    {"x": ANY, "op": MATMUL, "w": VAR_PART, "b": VAR, "add": ADD},
    (("x", "op", 0), ("w", "op", 1), ("op", "add", None), ("b", "add", None)),
    anchor="op", output="add", params=("w", "b"), inputs=(("op", "in", 0),),
    check=lambda g, m: _dense_kernel_ok(g, m) and bias_fits(g, m, dense_channel_axis(g, m)))
DENSE = Pattern(
    "dense", "dense",
    {"x": ANY, "op": MATMUL, "w": VAR_PART},
    (("x", "op", 0), ("w", "op", 1)),
    anchor="op", output="op", params=("w",), inputs=(("op", "in", 0),),
    check=_dense_kernel_ok)

# --- convolutions ----------------------------------------------------------


def output_channel_part(g, node) -> bool:
    """A variable read whole, or a box of a convolution kernel that takes
    every entry but along its last axis (its output channels: ConvLSTM's
    four gates split ``[k, k, Cin, 4F]``)."""
    box = g.nodes[node].get("part")
    if box is None:
        return True
    whole = g.graph["variables"][g.nodes[node]["variable"]].shape or ()
    return len(whole) >= 3 and all(
        (b, e) == (0, d) for b, e, d in zip(box["begin"][:-1], box["end"][:-1], whole[:-1]))


def whole_kernel(g, node, op_shape):
    """The op's kernel shape for the whole variable: a part along the output
    channels (``output_channel_part``) widened to all of them."""
    box = g.nodes[node].get("part")
    if box is None or not op_shape:
        return op_shape
    return (*op_shape[:-1], g.graph["variables"][g.nodes[node]["variable"]].shape[-1])


def _conv(kind, types, name, x_slot=0, check=None):
    """A convolution reading its input at ``x_slot`` and its kernel at slot 1,
    with and without a bias; ``check``: a further condition on both. A
    Conv2D or Conv3D kernel may be read as a part along its output channels
    (``output_channel_part``)."""
    op = ops(*types)
    parts_ok = kind in ("conv2d", "conv3d")
    check_w = lambda g, m: output_channel_part(g, m["w"]) if parts_ok else (  # noqa: E731
        g.nodes[m["w"]].get("part") is None)
    both = check_w if check is None else lambda g, m: check_w(g, m) and check(g, m)
    with_bias = Pattern(
        f"{name}_bias", kind,
        {"x": ANY, "op": op, "w": VAR_PART, "b": VAR, "add": ADD},
        (("x", "op", x_slot), ("w", "op", 1), ("op", "add", None), ("b", "add", None)),
        anchor="op", output="add", params=("w", "b"), inputs=(("op", "in", x_slot),),
        check=lambda g, m: both(g, m) and _conv_bias_ok(g, m))
    bare = Pattern(
        name, kind, {"x": ANY, "op": op, "w": VAR_PART},
        (("x", "op", x_slot), ("w", "op", 1)),
        anchor="op", output="op", params=("w",), inputs=(("op", "in", x_slot),), check=both)
    return with_bias, bare


def _image_output(g, m) -> bool:
    """The op's output is 4-D or 5-D (a spatial size known at run time only
    makes the layer generic with that reason, ``passes.match_layers``)."""
    shape = g.nodes[m["op"]]["shapes"][0]
    return shape is not None and len(shape) in (4, 5)


def _conv3d_channels(g, m) -> bool:
    """A Conv3D whose kernel reads its input's channels or a whole share of them (grouped:
    ``Cin = G * cg``; the graph that is run has it per group, see
    ``passes.grouped_conv3d``)."""
    x = ir.shape_of(g, g.nodes[m["op"]]["raw_inputs"][0])
    fmt = g.nodes[m["op"]]["attrs"].get("data_format", "NDHWC")
    kernel = ir.shape_of(g, g.nodes[m["op"]]["raw_inputs"][1])
    if x is None or kernel is None or len(x) != 5 or len(kernel) != 5:
        return False
    channels = x[1] if fmt.startswith("NC") else x[-1]
    return channels is not None and channels % kernel[3] == 0


def _permutes_kernel(g, m) -> bool:
    """``Transpose(w, perm)`` with a constant ``perm`` gives the op its kernel
    (up to unit axes)."""
    perm = ir.const_value(g, g.nodes[m["perm"]]["inputs"][1])
    w = var_shape(g, m["w"])
    if g.nodes[m["w"]].get("part") is not None:
        return False
    kernel = ir.shape_of(g, g.nodes[m["op"]]["raw_inputs"][1])
    if perm is None or kernel is None or sorted(int(p) for p in perm) != list(range(len(w))):
        return False
    return [d for d in (w[int(p)] for p in perm) if d != 1] == [d for d in kernel if d != 1]


def kernel_transposed(pattern: Pattern) -> Pattern:
    """``pattern`` (a convolution's) on a kernel stored in another layout and
    transposed before the op (role ``"perm"``; Qwen3.5's causal convolution
    keeps its depthwise kernel ``[C, k]``): the use's ``kernel_perm``."""
    edges = tuple(e for e in pattern.edges if e[:2] != ("w", "op"))
    slot = next(e[2] for e in pattern.edges if e[:2] == ("w", "op"))
    check = pattern.check or (lambda g, m: True)
    return dataclasses.replace(
        pattern, name=f"{pattern.name}_transposed_kernel",
        nodes={**pattern.nodes, "perm": ops("Transpose")},
        edges=edges + (("w", "perm", 0), ("perm", "op", slot)),
        check=lambda g, m: _permutes_kernel(g, m) and check(g, m))


CONV2D_BIAS, CONV2D = _conv("conv2d", ("Conv2D",), "conv2d")
CONV3D_BIAS, CONV3D = _conv("conv3d", ("Conv3D",), "conv3d", check=_conv3d_channels)
DEPTHWISE_BIAS, DEPTHWISE = _conv("depthwise_conv2d", ("DepthwiseConv2dNative",),
                                  "depthwise_conv2d")
# Conv2DTranspose (and Conv1DTranspose on a unit axis): the input gradient of
# a forward convolution, Conv2DBackpropInput(input_sizes, filter, out_backprop=x).
CONV2D_TRANSPOSE_BIAS, CONV2D_TRANSPOSE = _conv(
    "conv2d_transpose", ("Conv2DBackpropInput",), "conv2d_transpose", x_slot=2,
    check=_image_output)
CONV3D_TRANSPOSE_BIAS, CONV3D_TRANSPOSE = _conv(
    "conv3d_transpose", ("Conv3DBackpropInputV2",), "conv3d_transpose", x_slot=2,
    check=_image_output)

# --- embedding -------------------------------------------------------------

EMBEDDING = Pattern(
    "embedding", "embedding",
    {"ids": ANY, "op": ops("GatherV2", "ResourceGather", "Gather"), "w": VAR},
    (("w", "op", 0), ("ids", "op", 1)),
    anchor="op", output="op", params=("w",), inputs=(("op", "in", 1),),
    check=lambda g, m: (g.nodes[m["op"]]["op"] != "GatherV2" or _const_axis_zero(g, m["op"]))
    and g.nodes[m["op"]]["attrs"].get("batch_dims", 0) == 0)


def _const_axis_zero(g, node) -> bool:
    value = ir.const_value(g, g.nodes[node]["inputs"][2])
    return value is not None and int(value) == 0


def _transposed_kernel(g, m) -> bool:
    """Transpose(w, perm=[1, 0]) feeding the MatMul (tied weights)."""
    perm = ir.const_value(g, g.nodes[m["t"]]["inputs"][1])
    return perm is not None and list(perm) == [1, 0] and _dense_kernel_ok(g, m)


DENSE_TRANSPOSED_BIAS = Pattern(
    "dense_transposed_bias", "dense",
    {"x": ANY, "op": MATMUL, "t": ops("Transpose"), "w": VAR, "b": VAR, "add": ADD},
    (("x", "op", 0), ("w", "t", 0), ("t", "op", 1), ("op", "add", None), ("b", "add", None)),
    anchor="op", output="add", params=("w", "b"), inputs=(("op", "in", 0),),
    check=lambda g, m: _transposed_kernel(g, m) and bias_fits(g, m, dense_channel_axis(g, m)))
DENSE_TRANSPOSED = Pattern(
    "dense_transposed", "dense",
    {"x": ANY, "op": MATMUL, "t": ops("Transpose"), "w": VAR},
    (("x", "op", 0), ("w", "t", 0), ("t", "op", 1)),
    anchor="op", output="op", params=("w",), inputs=(("op", "in", 0),),
    check=_transposed_kernel)


def _atrous(kind, types, name):
    """TensorFlow's atrous convolution: SpaceToBatchND -> conv -> BatchToSpaceND.
    Any such chain matches (so its conv never passes for a layer on ``d*B``
    rows); ``passes.atrous`` reads the dilated convolution it computes on the
    input of SpaceToBatchND, or why there is none (the layer is then generic)."""
    nodes = {"x": ANY, "s2b": ops("SpaceToBatchND"), "op": ops(*types), "w": VAR,
             "b2s": ops("BatchToSpaceND")}
    edges = (("x", "s2b", 0), ("s2b", "op", 0), ("w", "op", 1), ("op", "b2s", 0))
    with_bias = Pattern(
        f"{name}_bias", kind, {**nodes, "b": VAR, "add": ADD},
        edges + (("b2s", "add", None), ("b", "add", None)),
        anchor="op", output="add", params=("w", "b"), inputs=(("s2b", "in", 0),),
        check=lambda g, m: bias_fits(g, {**m, "op": m["b2s"]}, -1))
    bare = Pattern(name, kind, nodes, edges, anchor="op", output="b2s", params=("w",),
                   inputs=(("s2b", "in", 0),))
    return with_bias, bare


ATROUS_CONV2D_BIAS, ATROUS_CONV2D = _atrous("conv2d", ("Conv2D",), "atrous_conv2d")
ATROUS_CONV3D_BIAS, ATROUS_CONV3D = _atrous("conv3d", ("Conv3D",), "atrous_conv3d")
ATROUS_DEPTHWISE_BIAS, ATROUS_DEPTHWISE = _atrous(
    "depthwise_conv2d", ("DepthwiseConv2dNative",), "atrous_depthwise_conv2d")

# Tensordot on a transposed kernel (``matmul(h [B, T, d], transpose(E))``,
# a tied LM head written with Keras ops).
_TENSORDOT_T_NODES = {"x": ANY, "flat": ops("Reshape"), "op": ops("MatMul", where=_dense_op),
                      "t": ops("Transpose"), "unflat": ops("Reshape"), "w": VAR}
_TENSORDOT_T_EDGES = (("x", "flat", 0), ("flat", "op", 0), ("w", "t", 0), ("t", "op", 1),
                      ("op", "unflat", 0))
DENSE_TENSORDOT_TRANSPOSED_BIAS = Pattern(
    "dense_tensordot_transposed_bias", "dense", {**_TENSORDOT_T_NODES, "b": VAR, "add": ADD},
    _TENSORDOT_T_EDGES + (("unflat", "add", None), ("b", "add", None)),
    anchor="op", output="add", params=("w", "b"), inputs=(("flat", "in", 0),),
    check=lambda g, m: (_merges_leading(g, m) and _transposed_kernel(g, m)
                        and bias_fits(g, {**m, "op": m["unflat"]}, -1)))
DENSE_TENSORDOT_TRANSPOSED = Pattern(
    "dense_tensordot_transposed", "dense", _TENSORDOT_T_NODES, _TENSORDOT_T_EDGES,
    anchor="op", output="unflat", params=("w",), inputs=(("flat", "in", 0),),
    check=lambda g, m: _merges_leading(g, m) and _transposed_kernel(g, m))

DENSE_AND_CONV_PATTERNS: tuple[Pattern, ...] = (
    DENSE_TENSORDOT_BIAS, DENSE_TENSORDOT,
    DENSE_TENSORDOT_TRANSPOSED_BIAS, DENSE_TENSORDOT_TRANSPOSED,
    DENSE_TRANSPOSED_BIAS, DENSE_TRANSPOSED,
    DENSE_BIAS, DENSE,
    ATROUS_CONV2D_BIAS, ATROUS_CONV2D, ATROUS_CONV3D_BIAS, ATROUS_CONV3D,
    ATROUS_DEPTHWISE_BIAS, ATROUS_DEPTHWISE,
    CONV2D_BIAS, CONV2D, CONV3D_BIAS, CONV3D, DEPTHWISE_BIAS, DEPTHWISE,
    CONV2D_TRANSPOSE_BIAS, CONV2D_TRANSPOSE, CONV3D_TRANSPOSE_BIAS, CONV3D_TRANSPOSE,
    *map(kernel_transposed, (
        ATROUS_CONV2D_BIAS, ATROUS_CONV2D, ATROUS_CONV3D_BIAS, ATROUS_CONV3D,
        ATROUS_DEPTHWISE_BIAS, ATROUS_DEPTHWISE,
        CONV2D_BIAS, CONV2D, CONV3D_BIAS, CONV3D, DEPTHWISE_BIAS, DEPTHWISE,
        CONV2D_TRANSPOSE_BIAS, CONV2D_TRANSPOSE, CONV3D_TRANSPOSE_BIAS, CONV3D_TRANSPOSE)),
    EMBEDDING,
)
