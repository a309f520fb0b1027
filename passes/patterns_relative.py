"""A relative-position bias table: a lookup by ids without an example axis,
transposed, added to every example's attention scores (T5's
``take(table, buckets [q, k])`` -> ``[q, k, H]`` -> ``transpose(2, 0, 1)``
-> ``[1, H, q, k]`` added to the scores ``[B, H, q, k]``, or first to their
padding mask).

Like a position embedding (``passes.patterns_multiaxis``), the layer's
output is the Add, so its output gradient is per example; the runtime
broadcasts the ids over the batch (``ids_broadcast``) and reads the output
gradient back in the lookup's layout (``grad_perm``, set by
``passes.lookup_ids``).
"""
from __future__ import annotations

from passes import ir
from passes.batch_flow import run_time_batch_axes
from passes.patterns import EMBEDDING, ANY, VAR, Pattern, ops


def lookup_perm(g, m) -> tuple | None:
    """The Transpose's permutation, when constant."""
    perm = ir.const_value(g, g.nodes[m["perm"]]["inputs"][1])
    return None if perm is None else tuple(int(p) for p in perm)


def grad_perm(g, m) -> tuple | None:
    """How the output gradient ``[B, *transpose(lookup, perm)]`` goes back to
    ``[B, *lookup]``."""
    perm = lookup_perm(g, m)
    return None if perm is None else (0, *(1 + perm.index(j) for j in range(len(perm))))


def _added_over_the_batch(g, m) -> bool:
    """The transposed lookup ``[*P]`` is added to a ``[B, *P]`` activation
    that is not itself."""
    perm = lookup_perm(g, m)
    rows = (g.nodes[m["op"]]["shapes"] or [None])[0]
    out = (g.nodes[m["add"]]["shapes"] or [None])[0]
    if (not EMBEDDING.check(g, m) or perm is None or not rows or not out
            or sorted(perm) != list(range(len(rows))) or m["x"] == m["perm"]
            or len(out) != len(rows) + 1):
        return False
    if None not in rows:
        return tuple(out[1:]) == tuple(rows[p] for p in perm)
    # sizes known at run time only (T5's [q, k] under a [None, None] signature): the
    # probes say the sum leads with the batch and the lookup holds no batch axis
    return (0 in run_time_batch_axes(g, m["add"]) and not run_time_batch_axes(g, m["op"])
            and ir.same_shape(out[1:], tuple(rows[p] for p in perm)))


RELATIVE_POSITION_BIAS = Pattern(
    "relative_position_bias", "embedding",
    {"ids": ANY, "op": EMBEDDING.nodes["op"], "w": VAR, "perm": ops("Transpose"), "x": ANY,
     "add": ops("AddV2", "Add")},
    (("w", "op", 0), ("ids", "op", 1), ("op", "perm", 0), ("perm", "add", None),
     ("x", "add", None)),
    anchor="op", output="add", params=("w",), inputs=(("op", "in", 1),),
    check=_added_over_the_batch)

RELATIVE_PATTERNS = (RELATIVE_POSITION_BIAS,)
