"""Where an op puts the examples' rows of its input (``passes.example_rows``).

``axis_after(g, d, sources, r, rows, data, rank)``: the axis of ``d``'s
output that holds the rows ``r`` its inputs hold (``rows``: node -> Rows),
or None where the op mixes rows (reads several rows, or other examples'
data, into one). Row-wise ops keep the axis: elementwise ops whose other
operands broadcast along it, softmax and reductions off it, a matmul or
einsum whose other operand does not depend on the data, batched matmuls,
splits and slices that keep it whole, gathers of a table by ids in rows,
convolutions and poolings on rows on the first axis; transposes, unstacks,
ExpandDims and Squeeze move it.
"""
from __future__ import annotations

from passes import ir

# reductions over axes given by a constant (the rows' axis must not be one of them)
REDUCTIONS = frozenset({"Mean", "Sum", "Max", "Min", "Prod"})
# ops computing each index of their input's first axis on its own (weights aside)
_PER_LEADING = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative", "MaxPool", "AvgPool",
                          "MaxPool3D", "AvgPool3D", "ResizeBilinear", "ResizeNearestNeighbor",
                          "ResizeBicubic", "ResizeArea", "ScaleAndTranslate"})

_CROSS_ENTROPY = frozenset({"SparseSoftmaxCrossEntropyWithLogits",
                            "SoftmaxCrossEntropyWithLogits"})


def axis_after(g, d, sources, r, rows, data, rank):
    """The rows' axis in ``d``'s output, or None where the op mixes rows.
    The op's constants index its inputs as it reads them: ``a`` there."""
    op = d["op"]
    a = next((axis_as_read(g, t, raw, r.axis) for s, t, raw in zip(
        sources, d["inputs"], d["raw_inputs"]) if s in rows), r.axis)
    r = r._replace(axis=a)
    if op == "Transpose":
        perm = ir.const_value(g, d["inputs"][1])
        return None if perm is None else [int(p) for p in perm].index(a)
    if op == "Unpack":
        u = d["attrs"].get("axis", 0) % (rank + 1)
        return None if u == a else a - (u < a)
    if op in ("Softmax", "LogSoftmax"):
        return a if a != rank - 1 else None
    if op in _CROSS_ENTROPY:  # row n's loss from row n of the logits and of the labels
        ok = a == 0 and all(s in rows or s not in data for s in sources)
        return a if ok else None
    if op == "MatMul":
        ok = (a == 0 and sources[0] in rows and sources[1] not in data
              and not d["attrs"].get("transpose_a"))
        return a if ok else None
    if op in ("BatchMatMulV2", "BatchMatMulV3"):
        if a < rank - 2:  # its batch axes are never contracted
            return a if _aligned(g, d, sources, r, rows, rank, matrix=True) else None
        ok = (a == rank - 2 and sources[0] in rows and sources[1] not in data  # x's rows
              and not d["attrs"].get("adj_x"))
        return a if ok else None
    if op in ir.ELEMENTWISE:
        return a if _aligned(g, d, sources, r, rows, rank) else None
    if op in REDUCTIONS and sources[0] in rows:
        return _axis_after_reduction(g, d, a)
    if op == "Einsum":
        return axis_after_einsum(d, sources, rows, data, a)
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
    if op in ("GatherV2", "ResourceGather"):  # a table's rows by ids in rows
        axis = ir.const_value(g, d["inputs"][2]) if op == "GatherV2" else 0
        ok = (sources[1] in rows and sources[0] not in data and axis is not None
              and int(axis) == 0 and not d["attrs"].get("batch_dims", 0))
        return a if ok else None
    if op in _PER_LEADING:
        ok = a == 0 and sources[0] in rows and not any(s in data for s in sources[1:])
        return a if ok else None
    if op == "ConcatV2":  # every piece holds the same rows, joined along another axis
        along = ir.const_value(g, d["inputs"][-1])
        ok = along is not None and int(along) % rank != a and all(
            s in rows for s in sources[:-1])
        return a if ok else None
    if op in ("Pad", "PadV2", "MirrorPad") and sources[0] in rows:
        pads = ir.const_value(g, d["inputs"][1])
        return a if pads is not None and not any(pads[a]) else None
    if op == "Tile" and sources[0] in rows:  # kept where that axis is not repeated
        multiples = ir.const_value(g, d["inputs"][1])
        return a if multiples is not None and a < len(multiples) and int(
            multiples[a]) == 1 else None
    if ((op == "Pack" and all(s in rows for s in sources))  # stacked, or one-hot (-1: last):
            or (op == "OneHot" and sources[0] in rows)):  # one axis added at ``axis``
        at = int(d["attrs"].get("axis", 0 if op == "Pack" else -1)) % rank
        return a + (at <= a)
    if op == "Cumsum" and sources[0] in rows:
        along = ir.const_value(g, d["inputs"][1])
        return a if along is not None and int(along) % rank != a else None
    return None


def axis_after_einsum(d, sources, rows, data, a):
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
    """A StridedSlice that keeps the rows' axis whole: where it lands."""
    axes = ir.slice_axes(g, d)
    out, whole = axes[a] if axes is not None and a < len(axes) else (None, False)
    return out if whole else None


def _axis_after_reduction(g, d, a):
    """The rows' axis ``a`` of a reduction's input (as it reads it) in its
    output, or None where the reduction runs along it (or its axes are not a
    constant)."""
    axes, raw = ir.const_value(g, d["inputs"][1]), ir.shape_of(g, d["raw_inputs"][0])
    if axes is None or not raw:
        return None
    axes = {int(x) % len(raw) for x in ([axes] if axes.ndim == 0 else axes)}
    if a in axes:
        return None
    return a if d["attrs"].get("keep_dims") else a - sum(x < a for x in axes)


def reduced_axes(g, d) -> set | None:
    """The axes of a reduction's input (as the IR has it) that it reduces;
    None where they are not a constant. The op's constant axes index its
    raw input, which may have unit axes the IR saw through (a group norm's
    ``[B, T, G, C/G]`` with ``G = 1``): mapped across them."""
    axes = ir.const_value(g, d["inputs"][1])
    raw, canonical = ir.shape_of(g, d["raw_inputs"][0]), ir.shape_of(g, d["inputs"][0])
    if axes is None or not raw or not canonical:
        return None
    to_canonical = _unit_axis_map(raw, canonical)
    if to_canonical is None:
        return None
    return {to_canonical[int(x) % len(raw)] for x in ([axes] if axes.ndim == 0 else axes)
            } - {None}


def _unit_axis_map(raw, canonical):
    """For each axis of ``raw``, its axis in ``canonical`` (None for a unit
    axis only ``raw`` has), the two shapes differing by unit axes; None
    where they differ otherwise."""
    out, j = [], 0
    for d in raw:
        while j < len(canonical) and canonical[j] != d and canonical[j] == 1:
            j += 1
        if j < len(canonical) and canonical[j] == d:
            out.append(j)
            j += 1
        elif d == 1:
            out.append(None)
        else:
            return None
    return out


def _aligned(g, d, sources, r, rows, rank, matrix=False) -> bool:
    """Every operand holds the same rows, or broadcasts along their axis
    (``matrix``: a batched matmul's operands broadcast their batch axes, all
    but their last two)."""
    for s, t in zip(sources, d["raw_inputs"]):  # each as the op reads it
        if s in rows or _uniform(g, s):
            continue
        shape = ir.shape_of(g, t)
        if shape is None:
            return False
        out_rank = rank - 2 if matrix else rank
        shape = shape[:-2] if matrix else shape
        at = r.axis - (out_rank - len(shape))  # right-aligned broadcasting
        if at >= 0 and shape[at] != 1:
            return False
    return True


def _uniform(g, node) -> bool:
    """A tensor of one value throughout (``tf.ones_like`` of a static shape,
    a ``Fill`` of a constant; tf.compat.v1's weights broadcast to the terms):
    it broadcasts along the rows as a unit axis does."""
    return (g.nodes[node]["op"] in ("OnesLike", "ZerosLike")
            or ir.uniform_value(g, ir.tensor_name(node)) is not None)


def axis_in(shape, raw, axis) -> int:
    """``axis`` of ``shape`` where it lies in ``raw``, the same tensor with unit
    axes added or dropped (the IR sees through them, ``passes.canonicalize``;
    the op reads ``raw``): the same count of other-than-unit axes before it."""
    if tuple(shape) == tuple(raw) or axis >= len(shape) or shape[axis] == 1:
        return axis
    before = sum(dim != 1 for dim in shape[:axis])
    kept = [k for k, dim in enumerate(raw) if dim != 1]
    return kept[before] if before < len(kept) else axis


def axis_as_read(g, tensor, raw, axis):
    """``axis`` of ``tensor``, an op's input in the IR, in ``raw``, the input
    as the op reads it (``axis_in``); a negative one counts from the end in
    both. None stays None."""
    shape, read = ir.shape_of(g, tensor), ir.shape_of(g, raw)
    if axis is None or not shape or not read or tuple(shape) == tuple(read):
        return axis
    if axis < 0:
        return axis_in(shape, read, len(shape) + axis) - len(read)
    return axis_in(shape, read, axis)
