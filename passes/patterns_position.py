"""A position table sliced to a length known at run time only.

keras-hub's ``PositionEmbedding`` slices its table to the sequence length,
``Slice(table, [s, 0], [T, D])``, broadcasts the rows over the batch,
``BroadcastTo(rows, [B, T, D])``, and the backbone adds them to the token
embeddings. Traced with a static length the slice is a part of the table
(``passes.variable_parts``) and ``POSITION_BROADCAST`` reads it; under an
input signature whose length is ``None`` (a SavedModel for sequences of
any length) ``T`` comes from ``tf.shape`` at run time. The use is then a
lookup of ids ``range(s, s + T)`` added over the batch (``ids_broadcast``),
recorded as ``row_range = (s, None)``: the runtime reads ``T`` from the
output gradient's positions (``kfac_graph/layers/embedding.py``).
"""
from __future__ import annotations

from passes import ir
from passes.patterns import ANY, VAR, Pattern, ops, var_shape


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

POSITION_PATTERNS = (POSITION_SLICE_BROADCAST,)
