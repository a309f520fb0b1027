"""Lookups without an example axis.

Contract: ``ids_without_batch(g, groups, data, rows) -> groups`` takes the
matcher's groups ``{(kind, variable keys): [(pattern, roles, Use)]}``, the
set of nodes that depend on the arguments and the examples' rows
(``passes.example_rows``), and returns them with every embedding use whose
ids carry no example axis marked ``unsupported``.
"""
from __future__ import annotations

import dataclasses

from passes import ir
from passes.batch_flow import run_time_batch_axes
from passes.patterns_relative import grad_perm


_CONSTANT = ("a lookup of ids that do not depend on the data (no example axis), not added "
             "over the batch")
_BAG = ("a lookup of ids whose first axis is not the examples' (a sparse or ragged bag's ids, "
        "combined per example after the lookup)")
_JOINED = ("a lookup of ids whose first axis holds {n} rows for a batch of {b}, not the "
           "examples' (the examples' ids joined with others, as tf.nn.sampled_softmax_loss and "
           "nce_loss join the labels and the sampled classes)")


def ids_without_batch(g, groups, data, rows):
    """A lookup whose ids do not depend on the arguments (``table[range(T)]``)
    and is not a recognised position embedding (added over the batch) has
    no example axis unless the ids are laid out ``[B, ...]`` themselves
    (constant segment ids): its kind's rule would read position t as
    example t. Such a use is marked ``unsupported`` (the table becomes
    generic, whose per-example gradients are exact). Constant ids whose
    leading axis has the batch's size are per example only where the
    lookup meets the data elementwise, its leading axis on the data's (a
    relative-position table looked up on a ``[q, k]`` grid with ``q = B``
    and contracted with the queries is no such lookup). Where the batch is
    known at run time only, ids computed from the data's sizes (``range(T)``
    from ``tf.shape``) depend on the arguments too: their first axis must
    be one the probes found holding the batch (``passes.shape_probe``).
    With a static batch, a vector of data ids of unknown length (a sparse or
    ragged bag's ids, ``embedding_lookup_sparse``: N ids for B examples,
    combined per example by a segment reduction after the lookup) leads with
    no example either (ids ``[?, T]``, as ``TextVectorization`` pads them,
    are taken to lead with the examples, which the rule checks when run), nor
    does a vector of data ids of another static length than the batch's,
    where the rows tracker lost the examples: the examples' ids joined with
    others (``tf.nn.sampled_softmax_loss`` looks up ``concat([labels,
    sampled])``, ``[B + S]``, and the sampled rows meet every example)."""
    batch_sizes = {shape[0] for shape in (
        (g.nodes[a]["shapes"] or [None])[0] for a in g.graph["arguments"]) if shape}

    probed = bool(g.graph.get("batch_axes"))  # the batch known at run time only, probed

    def why_not(use) -> str:
        if use.attrs.get("ids_broadcast"):
            return ""
        ids = ir.resolve(g, use.inputs[0])
        shape = ir.shape_of(g, ids)
        if ir.split_tensor(ids)[0] in data:  # (data, or sizes read from it: probed)
            if probed:
                return "" if 0 in run_time_batch_axes(g, ir.split_tensor(ids)[0]) else _CONSTANT
            if shape and len(shape) == 1 and shape[0] is None:
                return _BAG
            lost = rows.get(ir.split_tensor(ids)[0]) is None
            return _JOINED.format(n=shape[0], b=min(batch_sizes)) if (
                lost and shape and shape[0] is not None and batch_sizes
                and shape[0] not in batch_sizes) else ""
        return "" if (bool(shape) and len(shape) >= 2 and shape[0] in batch_sizes
                      and _meets_data_on_batch(g, ir.split_tensor(use.output)[0], data)
                      ) else _CONSTANT

    out = {}
    for (kind, keys), items in groups.items():
        if kind == "embedding":
            items = [(pattern, roles, _with_grad_perm(g, roles, use)) for pattern, roles, use
                     in items]
            items = [(pattern, roles, use) if not why_not(use)
                     else (pattern, roles, dataclasses.replace(use, attrs={
                         **use.attrs, "unsupported": why_not(use)}))
                     for pattern, roles, use in items]
        out[(kind, keys)] = items
    return out


def _meets_data_on_batch(g, node, data, depth=16) -> bool:
    """Whether ``node``'s output ``[n, ..]``, followed through ops that
    compute it alone elementwise (a cast, a scale by a constant), meets a
    data tensor in an elementwise op that lines their leading axes up
    (same rank, the same leading size)."""
    shape = (g.nodes[node]["shapes"] or [None])[0]
    if not shape:
        return False
    for _ in range(depth):
        nexts = list(g.successors(node))
        if len(nexts) != 1 or g.nodes[nexts[0]]["op"] not in ir.ELEMENTWISE:
            return False
        d = g.nodes[nexts[0]]
        others = [t for t in d["inputs"] if ir.split_tensor(t)[0] != node]
        met = [ir.shape_of(g, t) for t in others if ir.split_tensor(t)[0] in data]
        if met:
            return all(s is not None and len(s) == len(shape) and s[0] == shape[0] for s in met)
        node = nexts[0]
    return False


def _with_grad_perm(g, roles, use):
    """A relative-position bias (``passes.patterns_relative``) records how its
    output gradient goes back to the lookup's layout (``grad_perm``)."""
    if "perm" not in roles:
        return use
    return dataclasses.replace(use, attrs={**use.attrs, "grad_perm": grad_perm(g, roles)})
