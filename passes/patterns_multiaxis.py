"""Layer patterns for transformer projections and position embeddings (data).

Multi-axis dense ("einsum") layers: a kernel ``w`` of rank r > 2 whose first
k axes are contracted with the activation's last axes and whose other r - k
axes are output axes is a dense layer with

    d_in = prod(w.shape[:k]),   d_out = prod(w.shape[k:]),

(``w`` reshaped row-major to ``[d_in, d_out]``), applied at every position of
the activation's leading axes. Two graph forms compute it:

- an ``Einsum`` op ``x,w->y`` with ``x = P + C``, ``w = C + O`` and
  ``y = P + O`` (C the contracted letters, P the positions; ``einsum_dense_axes``;
  ``w`` holding C and O in another order is the same layer on the permuted
  kernel, below);
- Keras's lowering of ``"abc,cde->abde"`` and ``"abcd,cde->abe"``:
  ``MatMul(x, Reshape(w, [d_in, d_out]))``, then maybe a ``Reshape`` of the
  last axis into the kernel's output axes.

A kernel contracted on a later axis (``"btd,ndh->btnh"``: Keras transposes
it first, ``Transpose(w, perm) -> Reshape -> MatMul``) is the same layer on
the permuted kernel ``w' = transpose(w, perm)``; the match records
``kernel_perm`` = perm and the layer's ``d_in``, ``d_out`` are ``w'``'s.

A bias whose shape is the output's trailing axes, with ``d_out`` entries in
all (``[heads, head_dim]`` or ``[d]``), belongs to the same layer. The match
records ``kernel_in_axes`` = k (``kernel_in_axes``).

Position embedding: a lookup whose ids have no batch axis, added to a
``[B, *ids.shape, D]`` activation (broadcast over the batch). The layer's
output is the Add, so its output gradient is per example; the runtime
broadcasts the ids over the batch (``ids_broadcast``). A slice
``table[start:stop]`` added the same way is the lookup of
``range(start, stop)`` (``slice_rows``; the use records ``row_range``).
keras-hub's ``PositionEmbedding`` slices its table (a part of the variable,
``passes.variable_parts``, or the whole table) and broadcasts the rows to
``[B, T, D]`` with ``BroadcastTo`` before the sum: the same lookup, its
rows read from the part's box (``passes.patterns_position``, as is a static
slice added with no ``BroadcastTo``).
"""
from __future__ import annotations

import math
import re

from passes import ir
from passes.patterns import ADD, ANY, EMBEDDING, VAR, Op, Pattern, ops, var_shape
from passes.einsum_2d import einsum_2d_form
from passes.patterns_position import table_slice_rows


def einsum_dense_form(equation: str) -> tuple[int, tuple, tuple] | None:
    """``(k, perm, out_perm)`` for an Einsum ``x,w->y`` applying a kernel of
    rank > 2 as a dense layer: ``x = P + C``, ``y`` the letters of P then O
    (P non-empty or an ellipsis), ``w`` holding the letters of C and O in
    any order; ``k = len(C)``, ``perm`` orders ``w``'s axes as C (in ``x``'s
    order) then O (in ``y``'s), and ``out_perm`` takes ``y``'s axes to
    ``P + O`` (identities when already so). ``y`` may interleave P and O
    (a mixture of experts' ``"th,ehm->etm"``: every expert on every token),
    without an ellipsis. Else None."""
    m = re.fullmatch(r"(\.\.\.)?([a-z]*),([a-z]+)->(\.\.\.)?([a-z]*)", equation.replace(" ", ""))
    if not m:
        return None
    ell_x, x, w, ell_y, y = m.groups()
    if bool(ell_x) != bool(ell_y) or len(w) < 3 or len(set(w)) != len(w) or len(set(x)) != len(x):
        return None
    contracted = [c for c in x if c in w]
    k = len(contracted)
    positions = x[:len(x) - k]
    if not k or k == len(w) or x[len(x) - k:] != "".join(contracted) or not (positions or ell_x):
        return None
    out = [c for c in y if c not in positions]
    if (len(set(y)) != len(y) or len(out) != len(w) - k or set(out) != set(w) - set(x)
            or [c for c in y if c in positions] != list(positions)
            or (ell_y and y[:len(positions)] != positions)):
        return None
    out_perm = tuple(y.index(c) for c in list(positions) + out)
    return k, tuple(w.index(c) for c in contracted + out), out_perm


def einsum_dense_axes(equation: str) -> int | None:
    """k of ``einsum_dense_form`` (None when the Einsum is no dense layer)."""
    form = einsum_dense_form(equation)
    return None if form is None else form[0]


def _shape(g, node, index=0):
    shapes = g.nodes[node]["shapes"]
    return shapes[index] if shapes and index < len(shapes) else None


def _einsum_form(g, m):
    """``einsum_dense_form`` of a matched Einsum with a kernel of rank > 2, else None."""
    data = g.nodes[m["op"]]
    if data["op"] != "Einsum" or len(var_shape(g, m["w"])) <= 2:
        return None
    return einsum_dense_form(data["attrs"].get("equation", ""))


def _unless_identity(perm):
    return None if perm is None or perm == tuple(range(len(perm))) else perm


def kernel_perm(g, m) -> tuple | None:
    """The permutation the layer applies its kernel in: a ``Transpose(w,
    perm)`` before the Reshape (role ``"perm"``), or an Einsum's
    (``einsum_dense_form``); None when it applies the kernel as stored."""
    if "perm" in m:
        perm = ir.const_value(g, g.nodes[m["perm"]]["inputs"][1])
        return _unless_identity(None if perm is None else tuple(int(p) for p in perm))
    form = _einsum_form(g, m)
    return _unless_identity(None if form is None else form[1])


def output_perm(g, m) -> tuple | None:
    """How an Einsum's output axes go to ``positions + outputs``
    (``einsum_dense_form``); None when they are in that order."""
    form = _einsum_form(g, m)
    return _unless_identity(None if form is None else form[2])


def einsum_perms(g, m, input_shape) -> dict:
    """A dense use's permutations, where not the identity: ``output_perm``
    (``einsum_dense_form``, or ``einsum_2d``'s for a 2-D kernel) and, for a
    2-D kernel contracted on an earlier axis of ``x`` (token mixing),
    ``input_perm`` with the ``input_shape`` it gives."""
    data = g.nodes[m["op"]]
    if data["op"] != "Einsum" or len(var_shape(g, m["w"])) > 2:
        perm = output_perm(g, m)
        return {} if perm is None else {"output_perm": perm}
    _, in_perm, out_perm = einsum_2d_form(data["attrs"].get("equation", ""))
    out = {} if out_perm is None else {"output_perm": out_perm}
    if in_perm is not None:
        out["input_perm"] = in_perm
        out["input_shape"] = None if input_shape is None else tuple(input_shape[p] for p in in_perm)
    return out


def kernel_shape(g, m) -> tuple:
    """The kernel's shape as the layer applies it: the variable's, permuted
    by ``kernel_perm`` when a Transpose comes first (() when unknown)."""
    w = var_shape(g, m["w"])
    perm = kernel_perm(g, m)
    if perm is None:
        return () if "perm" in m and not _identity_transpose(g, m) else w
    if sorted(perm) != list(range(len(w))):
        return ()
    return tuple(w[p] for p in perm)


def _identity_transpose(g, m) -> bool:
    perm = ir.const_value(g, g.nodes[m["perm"]]["inputs"][1])
    return perm is not None and list(perm) == list(range(len(perm)))


def _split(g, m):
    """k with ``Reshape(w)`` = ``[prod(w[:k]), prod(w[k:])]``, else None. (A
    Reshape that only drops unit axes is gone from the IR: then the MatMul's
    kernel operand had the 2-D shape.)"""
    w = kernel_shape(g, m)
    flat = _shape(g, m["wr"]) if "wr" in m else ir.shape_of(g, g.nodes[m["op"]]["raw_inputs"][1])
    if len(w) < 3 or flat is None or len(flat) != 2:
        return None
    for k in range(1, len(w)):
        if (math.prod(w[:k]), math.prod(w[k:])) == tuple(flat):
            return k
    return None


def kernel_in_axes(g, roles) -> int | None:
    """k of a matched multi-axis dense layer (None for other matches)."""
    if g.nodes[roles["op"]]["op"] != "Einsum":
        return _split(g, roles)
    data = g.nodes[roles["op"]]
    if data["op"] == "Einsum" and len(var_shape(g, roles["w"])) > 2:
        return einsum_dense_axes(data["attrs"].get("equation", ""))
    return None


def _einsum_ok(data) -> bool:
    return einsum_dense_axes(data["attrs"].get("equation", "")) is not None


def _plain_matmul(data) -> bool:
    a = data["attrs"]
    return not any(a.get(k, False) for k in ("transpose_a", "transpose_b", "adj_x", "adj_y"))


def _unflat_ok(g, m) -> bool:
    """Reshape ``[..., d_out]`` -> ``[..., *w[k:]]`` (the kernel's output axes)."""
    k, before, after = _split(g, m), _shape(g, m["op"]), _shape(g, m["unflat"])
    if k is None or before is None or after is None:
        return False
    out = kernel_shape(g, m)[k:]
    return ir.same_shape(after, (*before[:-1], *out))


def _bias_ok(g, m, out_role) -> bool:
    """The bias is the output's trailing axes, ``d_out`` entries, added as is
    (or with its unit axes squeezed: Keras adds a ``[1, n]`` bias as ``[n]``)."""
    k = kernel_in_axes(g, m)
    bias, out, before = var_shape(g, m["b"]), _shape(g, m["add"]), _shape(g, m[out_role])
    if k is not None and output_perm(g, m) is not None and bias and out:
        return _permuted_bias_ok(g, m, k, bias, out)  # (positions may be known at run time only)
    if (k is None or output_perm(g, m) is not None or not bias or out is None or before is None
            or len(bias) >= len(out)):
        return False
    if not _no_wider(out, before, bias):
        return False
    if (math.prod(bias) != math.prod(kernel_shape(g, m)[k:])
            or not ir.same_shape(out[-len(bias):], bias)):
        return False
    add = g.nodes[m["add"]]
    if str(add["attrs"].get("data_format", "NHWC")).strip("b'").startswith("NC"):
        return False
    raw = [t for t in add["raw_inputs"] if ir.resolve(g, t) == ir.tensor_name(m["b"])]
    shape = ir.shape_of(g, raw[0]) if raw else None
    squeeze = lambda dims: tuple(d for d in dims if d != 1)
    return (shape is not None and squeeze(shape) == squeeze(bias) and len(shape) <= len(out)
            and ir.same_shape(out[len(out) - len(shape):], tuple(shape)))


def _no_wider(out, before, bias) -> bool:
    """The sum ``out`` is no wider than the projection ``before`` (unit axes
    aside): equal sizes past the batch; with positions known at run time only
    (``[None, None]``), the same rank and ``before`` ending in ``bias``'s
    sizes, the only axes a bias of fewer axes than ``out`` could widen."""
    if None not in out[1:] + before[1:]:
        return math.prod(out[1:]) == math.prod(before[1:])
    return ir.same_shape(out, before) and tuple(before[len(before) - len(bias):]) == tuple(bias)


def _permuted_bias_ok(g, m, k, bias, out) -> bool:
    """An Einsum whose output interleaves positions and outputs (``"etm"``):
    the bias ``[E, M]`` (``d_out`` entries) is read as the output with its
    positions' axes 1 (``bias[:, None, :]``, GPT-OSS's experts' biases)."""
    outputs = kernel_shape(g, m)[k:]
    positions = set(output_perm(g, m)[:len(out) - len(outputs)])
    want = tuple(1 if i in positions else d for i, d in enumerate(out))
    add = g.nodes[m["add"]]
    raw = [t for t in add["raw_inputs"] if ir.resolve(g, t) == ir.tensor_name(m["b"])]
    shape = ir.shape_of(g, raw[0]) if raw else None
    return (math.prod(bias) == math.prod(outputs) and shape is not None
            and tuple(shape) == want)


def _with_bias(name, nodes, edges, out_role, check, inputs):
    both = Pattern(f"{name}_bias", "dense", {**nodes, "b": VAR, "add": ADD},
                   edges + ((out_role, "add", None), ("b", "add", None)), anchor="op",
                   output="add", params=("w", "b"), inputs=inputs,
                   check=lambda g, m: check(g, m) and _bias_ok(g, m, out_role))
    bare = Pattern(name, "dense", nodes, edges, anchor="op", output=out_role, params=("w",),
                   inputs=inputs, check=check)
    return both, bare


_MATMUL = ops("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", where=_plain_matmul)
_RESHAPED = {"x": ANY, "wr": ops("Reshape"), "op": _MATMUL, "w": VAR}
_RESHAPED_EDGES = (("w", "wr", 0), ("x", "op", 0), ("wr", "op", 1))
_IN = (("op", "in", 0),)

EINSUM_DENSE_BIAS, EINSUM_DENSE = _with_bias(
    "einsum_dense", {"x": ANY, "op": ops("Einsum", where=_einsum_ok), "w": VAR},
    (("x", "op", 0), ("w", "op", 1)), "op",
    lambda g, m: kernel_in_axes(g, m) is not None, _IN)
RESHAPED_DENSE_UNFLAT_BIAS, RESHAPED_DENSE_UNFLAT = _with_bias(
    "reshaped_kernel_dense_unflat", {**_RESHAPED, "unflat": ops("Reshape")},
    _RESHAPED_EDGES + (("op", "unflat", 0),), "unflat", _unflat_ok, _IN)
RESHAPED_DENSE_BIAS, RESHAPED_DENSE = _with_bias(
    "reshaped_kernel_dense", _RESHAPED, _RESHAPED_EDGES, "op",
    lambda g, m: _split(g, m) is not None, _IN)
# A kernel contracted on a later axis (Keras's "btd,ndh->btnh", Gemma's
# projections): Transpose(w, perm), then the forms above on the permuted
# kernel (``kernel_perm``; a Reshape that only dropped unit axes is gone).
_PERMUTED = {"x": ANY, "perm": ops("Transpose"), "wr": ops("Reshape"), "op": _MATMUL, "w": VAR}
_PERMUTED_EDGES = (("w", "perm", 0), ("perm", "wr", 0), ("x", "op", 0), ("wr", "op", 1))
PERMUTED_DENSE_UNFLAT_BIAS, PERMUTED_DENSE_UNFLAT = _with_bias(
    "permuted_kernel_dense_unflat", {**_PERMUTED, "unflat": ops("Reshape")},
    _PERMUTED_EDGES + (("op", "unflat", 0),), "unflat", _unflat_ok, _IN)
PERMUTED_DENSE_BIAS, PERMUTED_DENSE = _with_bias(
    "permuted_kernel_dense", _PERMUTED, _PERMUTED_EDGES, "op",
    lambda g, m: _split(g, m) is not None, _IN)
_PERMUTED_SQUEEZED = {"x": ANY, "perm": ops("Transpose"), "op": _MATMUL, "w": VAR}
PERMUTED_SQUEEZED_DENSE_BIAS, PERMUTED_SQUEEZED_DENSE = _with_bias(
    "permuted_squeezed_kernel_dense", _PERMUTED_SQUEEZED,
    (("w", "perm", 0), ("x", "op", 0), ("perm", "op", 1)), "op",
    lambda g, m: _split(g, m) is not None, _IN)
# A kernel with one non-unit output axis: the Reshape only dropped unit axes.
SQUEEZED_DENSE_BIAS, SQUEEZED_DENSE = _with_bias(
    "squeezed_kernel_dense", {"x": ANY, "op": _MATMUL, "w": VAR},
    (("x", "op", 0), ("w", "op", 1)), "op", lambda g, m: _split(g, m) is not None, _IN)


def _broadcast_over_batch(g, m) -> bool:
    """The lookup ``[*ids, D]`` is added to a ``[B, *ids, D]`` activation
    (ids ``[1, T]`` too, their unit axis standing for the batch: ViT's,
    unless the ids are the data's: a batch of one's token ids)."""
    rows, out = _shape(g, m["op"]), _shape(g, m["add"])
    if rows is not None and out is not None and len(rows) == len(out) >= 3 and rows[0] == 1:
        if ir.reads_values_of(g, m["ids"], g.graph["arguments"]):
            return False
        rows = rows[1:]
    return (EMBEDDING.check(g, m) and m["x"] != m["op"] and rows is not None and out is not None
            and len(out) == len(rows) + 1 and ir.same_shape(out[1:], rows))


POSITION_EMBEDDING = Pattern(
    "position_embedding", "embedding",
    {"ids": ANY, "op": EMBEDDING.nodes["op"], "w": VAR, "x": ANY, "add": ops("AddV2", "Add")},
    (("w", "op", 0), ("ids", "op", 1), ("op", "add", None), ("x", "add", None)),
    anchor="op", output="add", params=("w",), inputs=(("op", "in", 1),),
    check=_broadcast_over_batch)



def slice_rows(g, m) -> tuple[int, int | None] | None:
    """``(start, stop)`` of a slice ``w[start:stop]`` (or ``w[None, start:stop]``)
    of a ``[V, D]`` table, unit strides, every column; else None. A ``Slice``
    op's: ``patterns_position.table_slice_rows``."""
    if g.nodes[m["slice"]]["op"] == "Slice":
        return table_slice_rows(g, m)
    data = g.nodes[m["slice"]]
    a, w, out = data["attrs"], var_shape(g, m["w"]), _shape(g, m["slice"])
    begin = ir.const_value(g, data["inputs"][1])
    strides = ir.const_value(g, data["inputs"][3])
    lead = a.get("new_axis_mask", 0)
    if (len(w) != 2 or out is None or begin is None or strides is None or lead not in (0, 1)
            or a.get("ellipsis_mask", 0) or a.get("shrink_axis_mask", 0)
            or any(int(s) != 1 for s in strides) or len(out) != 2 + lead
            or out[-1] != w[1] or out[-2] is None or len(begin) > 2 + lead):
        return None
    begin = [0 if a.get("begin_mask", 0) >> i & 1 else int(b) for i, b in enumerate(begin)]
    start = begin[lead] % w[0] if len(begin) > lead else 0
    if len(begin) > lead + 1 and begin[lead + 1] != 0 or start + out[-2] > w[0]:
        return None
    return start, start + out[-2]


def _slice_broadcast(g, m) -> bool:
    rows, out = slice_rows(g, m), _shape(g, m["add"])
    return (rows is not None and out is not None and len(out) == 3 and m["x"] != m["slice"]
            and ir.same_shape(out[1:], (rows[1] - rows[0], var_shape(g, m["w"])[1])))


# A table slice added over the batch: the lookup of ids range(start, stop).
# Its operand is the slice's begin (the runtime makes the ids from the rows).
POSITION_TABLE_SLICE = Pattern(
    "position_table_slice", "embedding",
    {"w": VAR, "slice": ops("StridedSlice"), "x": ANY, "add": ops("AddV2", "Add")},
    (("w", "slice", 0), ("slice", "add", None), ("x", "add", None)),
    anchor="slice", output="add", params=("w",), inputs=(("slice", "in", 1),),
    check=_slice_broadcast)

MULTIAXIS_PATTERNS: tuple[Pattern, ...] = (
    PERMUTED_DENSE_UNFLAT_BIAS, PERMUTED_DENSE_UNFLAT, PERMUTED_DENSE_BIAS, PERMUTED_DENSE,
    PERMUTED_SQUEEZED_DENSE_BIAS, PERMUTED_SQUEEZED_DENSE,
    RESHAPED_DENSE_UNFLAT_BIAS, RESHAPED_DENSE_UNFLAT, RESHAPED_DENSE_BIAS, RESHAPED_DENSE,
    SQUEEZED_DENSE_BIAS, SQUEEZED_DENSE, EINSUM_DENSE_BIAS, EINSUM_DENSE,
    POSITION_EMBEDDING, POSITION_TABLE_SLICE)

__all__ = ["MULTIAXIS_PATTERNS", "einsum_dense_axes", "einsum_dense_form", "einsum_perms",
           "kernel_in_axes",
           "slice_rows", "kernel_perm", "output_perm", "Op"]
