"""Precision: where the loss computes in a narrower float than its inputs.

Contract: ``mark_narrowing(g) -> g`` returns a copy of the IR (before
canonicalize, which sees through ``Cast``) whose ``g.graph["narrowing"]``
lists, as ``(op name, widest input dtype, output dtype)`` in topological
order, every op on a path from the data (the arguments and the variables)
to the loss whose floating output is narrower than one of its floating
inputs: a ``Cast`` from ``float64`` to ``float32``, say, which a Keras layer
with the default ``float32`` policy inserts in an otherwise ``float64``
model.

Such an op rounds the forward values and, through its gradient, every
cotangent that flows back through it, to the narrower type. Rounding is not
linear, so two exact ways of computing the same derivative (pulling back
each column of a Fisher square root, or each row of a Jacobian) differ by
the narrower type's epsilon, relative: a model of ``float64`` variables is
no more precise than the narrowest float it computes in.
"""
from __future__ import annotations

import networkx as nx

from passes import ir

# bits of the floating types (precision order; complex types are left out)
WIDTH = {"bfloat16": 16, "float16": 16, "float32": 32, "float64": 64}


def mark_narrowing(graph: nx.DiGraph) -> nx.DiGraph:
    g = graph.copy()
    g.graph["narrowing"] = narrowing_ops(g)
    return g


def narrowing_ops(g: nx.DiGraph) -> tuple[tuple[str, str, str], ...]:
    """``(op, widest input dtype, output dtype)`` for every op between the
    data and the loss whose floating output is narrower than a floating input
    (see the module docstring)."""
    sources = [ir.split_tensor(a)[0] for a in g.graph["arguments"]]
    sources += [n for n, d in g.nodes(data=True) if d["op"] == "Variable"]
    output = ir.node_of(g, g.graph["output"])
    if output not in g:
        return ()
    on_path = ir.reachable_from(g, sources) & (nx.ancestors(g, output) | {output})
    found = []
    for node in nx.topological_sort(g.subgraph(on_path)):
        data = g.nodes[node]
        inputs = [d for d in (_dtype_of(g, t) for t in data["inputs"]) if _width(d)]
        outputs = [d for d in data["dtypes"] if _width(d)]
        if not inputs or not outputs:
            continue
        widest, narrowest = max(inputs, key=_width), min(outputs, key=_width)
        if _width(narrowest) < _width(widest):
            found.append((node, widest, narrowest))
    return tuple(found)


def _dtype_of(g: nx.DiGraph, tensor: str) -> str | None:
    node, index = ir.split_tensor(tensor)
    dtypes = g.nodes[node]["dtypes"] if node in g else ()
    return dtypes[index] if index < len(dtypes) else None


def _width(dtype: str | None) -> int:
    """Bits of a floating dtype; 0 for anything else (never narrowed)."""
    return WIDTH.get(dtype, 0)
