"""Tied input/output embeddings: one table, looked up and projected onto.

A table ``E [V, D]`` gathered by token ids (an embedding use) and applied
transposed as an output projection, ``logits = h @ E^T`` (GPT-2's LM head,
Keras's ``ReversibleEmbedding(reverse=True)`` with tied weights), is claimed
by an ``"embedding"`` and a ``"dense"`` match at once. Each is exact for its
own uses; the variable's gradient is the sum over both, so the two become one
layer of kind ``"tied_embedding"`` whose uses keep their role
(``attrs["tied_role"]``: ``"lookup"`` or ``"projection"``).

Contract: ``merge_tied(groups, detach_bias) -> groups`` takes the matcher's
groups ``{(kind, variable keys): [(pattern, roles, Use)]}`` and returns them
with every such pair merged under ``("tied_embedding", (table,))``. A
projection's bias (``h @ E^T + b``) is not the table's: ``detach_bias(roles,
use)`` returns the use without it and the bias's own shift item
``(pattern, roles, Use)``, which joins a scale-and-shift layer of the bias.
Only the forms the runtime states exactly are merged: the projection
multiplies by the whole table transposed (a 2-D kernel, no part of it),
the lookups read whole rows. Any other mix of
kinds is left to the caller's conflict rule (generic, with the reason).
"""
from __future__ import annotations

import collections
import dataclasses

TIED = "tied_embedding"
LOOKUP, PROJECTION = "lookup", "projection"


def _fits(kind: str, attrs) -> bool:
    if "parts" in attrs:
        return False
    if kind == "dense":
        return bool(attrs.get("transpose_kernel")) and not attrs.get("kernel_in_axes")
    return kind == "embedding"


def merge_tied(groups: dict, detach_bias) -> dict:
    """The module docstring's contract (``groups`` is not modified)."""
    groups = dict(groups)
    by_table = collections.defaultdict(list)
    for kind, keys in groups:
        by_table[keys[0]].append((kind, keys))
    for table, owners in by_table.items():
        if {kind for kind, _ in owners} != {"embedding", "dense"}:
            continue
        if not all(_fits(owner[0], use.attrs) for owner in owners for _, _, use in groups[owner]):
            continue
        merged = []
        for kind, keys in owners:
            role = LOOKUP if kind == "embedding" else PROJECTION
            for pattern, roles, use in groups.pop((kind, keys)):
                if len(keys) > 1:  # a projection's bias: a shift layer of its own
                    use, shift = detach_bias(roles, use)
                    groups.setdefault(("scale_and_shift", keys[1:]), []).append(shift)
                merged.append((pattern, roles, dataclasses.replace(
                    use, attrs={**use.attrs, "tied_role": role})))
        groups[(TIED, (table,))] = merged
    return groups
