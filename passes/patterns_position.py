"""Position tables sliced to the sequence's length and added over the batch.

keras-hub's ``PositionEmbedding`` slices its table to the sequence length,
``Slice(table, [s, 0], [T, D])``, broadcasts the rows over the batch,
``BroadcastTo(rows, [B, T, D])``, and the backbone adds them to the token
embeddings. Traced with a static length the slice is a part of the table
(``passes.variable_parts``) and ``POSITION_BROADCAST`` reads it; under an
input signature whose length is ``None`` (a SavedModel for sequences of
any length) ``T`` comes from ``tf.shape`` at run time. The use is then a
lookup of ids ``range(s, s + T)`` added over the batch (``ids_broadcast``),
recorded as ``row_range = (s, None)``: the runtime reads ``T`` from the
output gradient's positions (``kfac_graph/layers/embedding.py``). A static
slice added as it is, ``x + table[:T]`` (no ``BroadcastTo``), is a part
added over the batch (``POSITION_PART``), the lookup of ids ``range(0, T)``.
"""
from __future__ import annotations

from passes import ir
from passes.patterns import ANY, VAR, VAR_PART, Pattern, ops, var_shape


def table_slice_rows(g, m) -> tuple[int, int | None] | None:
    """``(start, stop)`` of ``Slice(w, begin, size)`` of a ``[V, D]`` table
    that keeps every column, from a constant start; ``stop`` is None where
    the slice's length is known at run time only. Else None."""
    data = g.nodes[m["slice"]]
    w, out = var_shape(g, m["w"]), (data["shapes"] or [None])[0]
    begin = ir.const_value(g, data["inputs"][1])
    if (len(w) != 2 or begin is None or len(begin) != 2 or int(begin[1]) != 0
            or out is None or len(out) != 2 or out[1] != w[1]):
        return None
    start = int(begin[0])
    if out[0] is None:
        return (start, None) if 0 <= start < w[0] else None
    return (start, start + out[0]) if 0 <= start and start + out[0] <= w[0] else None


def _broadcast_over_the_batch(g, m) -> bool:
    """The sliced rows ``[T, D]``, broadcast to ``[B, T, D]``, are added to an
    activation of that shape that is not themselves."""
    rows = table_slice_rows(g, m)
    bc, out = ((g.nodes[m[k]]["shapes"] or [None])[0] for k in ("bc", "add"))
    if rows is None or not bc or not out or len(bc) != 3 or len(out) != 3 or m["x"] == m["bc"]:
        return False
    length = None if rows[1] is None else rows[1] - rows[0]
    return ir.same_shape(out, bc) and ir.same_shape(bc[1:], (length, var_shape(g, m["w"])[1]))


POSITION_SLICE_BROADCAST = Pattern(
    "position_slice_broadcast", "embedding",
    {"w": VAR, "slice": ops("Slice"), "bc": ops("BroadcastTo"), "x": ANY,
     "add": ops("AddV2", "Add")},
    (("w", "slice", 0), ("slice", "bc", 0), ("bc", "add", None), ("x", "add", None)),
    anchor="slice", output="add", params=("w",), inputs=(("bc", "in", 1),),
    check=_broadcast_over_the_batch)

def part_rows(g, m) -> tuple[int, int] | None:
    """``(start, stop)``: the rows of a ``[V, D]`` table that ``m["w"]`` holds
    (a part of it with every column, or the whole table); else None."""
    data, whole = g.nodes[m["w"]], g.graph["variables"][g.nodes[m["w"]]["variable"]].shape
    if whole is None or len(whole) != 2 or None in whole:
        return None
    box = data.get("part")
    if box is None:
        return 0, int(whole[0])
    if len(box["begin"]) != 2 or box["begin"][1] != 0 or box["end"][1] != whole[1]:
        return None
    return int(box["begin"][0]), int(box["end"][0])


def _rows_over_the_batch(g, m, shape) -> bool:
    """``shape`` is ``[B, stop - start, D]`` for the rows ``part_rows`` reads."""
    rows = part_rows(g, m)
    return (rows is not None and shape is not None and len(shape) == 3
            and ir.same_shape(shape[1:], (rows[1] - rows[0], var_shape(g, m["w"])[-1])))


def _part_broadcast(g, m) -> bool:
    """``BroadcastTo(rows [T, D], [B, T, D])`` added to an activation of that shape."""
    bc = ir.shape_of(g, m["bc"])
    return (_rows_over_the_batch(g, m, bc) and m["x"] != m["bc"]
            and ir.same_shape(ir.shape_of(g, m["add"]), bc))


# keras-hub's PositionEmbedding: table rows broadcast over the batch, then
# added. Its operand is the broadcast's shape (the runtime makes the ids).
POSITION_BROADCAST = Pattern(
    "position_broadcast", "embedding",
    {"w": VAR_PART, "bc": ops("BroadcastTo"), "x": ANY, "add": ops("AddV2", "Add")},
    (("w", "bc", 0), ("bc", "add", None), ("x", "add", None)),
    anchor="bc", output="add", params=("w",), inputs=(("bc", "in", 1),),
    check=_part_broadcast)


def _part_added(g, m) -> bool:
    """A part ``table[start:stop]`` of a ``[V, D]`` table, every column
    (``passes.variable_parts`` makes a static slice of a variable one),
    added as it is to a ``[B, stop - start, D]`` activation."""
    return (g.nodes[m["w"]].get("part") is not None and m["x"] != m["w"]
            and _rows_over_the_batch(g, m, ir.shape_of(g, m["add"])))


# A static slice of a position table added over the batch: a part of the
# table (read as the lookup of ids range(start, stop)). Its operand is the part.
POSITION_PART = Pattern(
    "position_part", "embedding",
    {"w": VAR_PART, "x": ANY, "add": ops("AddV2", "Add")},
    (("w", "add", None), ("x", "add", None)),
    anchor="add", output="add", params=("w",), inputs=(("w", "out", 0),),
    check=_part_added)


POSITION_PATTERNS = (POSITION_SLICE_BROADCAST, POSITION_BROADCAST, POSITION_PART)
# the patterns whose rows are the table's own (``part_rows``: ``row_range``)
TABLE_ROWS = frozenset({POSITION_BROADCAST.name, POSITION_PART.name})
