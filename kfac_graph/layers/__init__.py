"""Layer kinds: one record per kind, and the one table of kinds.

Each module holds one kind's math: its spec (read from the matched op's
attributes), what its rules take from the graph, its per-example gradient
and norm rule, the rows of its Kronecker factors, and its record
(`kind.LayerKind`), which also names its Fisher blocks. `KINDS` maps kind
names to records and is the only list of kinds; adding a kind is one module
with its record, one entry here, and the pass's pattern entries.
"""
import types

from kfac_graph.layers import (conv, conv3d, conv_transpose, dense, depthwise, embedding,
                               generic, grouped_dense, scale_shift, tied_embedding)
from kfac_graph.layers.kind import LayerKind

KINDS = types.MappingProxyType({
    k.name: k for k in (dense.KIND, conv.KIND, conv3d.KIND, conv_transpose.KIND,
                        conv3d.TRANSPOSE_KIND, depthwise.KIND, grouped_dense.KIND,
                        scale_shift.KIND, embedding.KIND, tied_embedding.KIND,
                        generic.KIND)
})
GENERIC = generic.KIND.name


def kind(name: str) -> LayerKind:
    """The record of the kind ``name``."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown layer kind {name!r}; known kinds: {', '.join(KINDS)}") from None


__all__ = ["KINDS", "GENERIC", "LayerKind", "kind"]
