"""Where the examples meet: ops that make one example's loss depend on others.

Per-example gradients are defined for a loss that is a sum (or mean) of
per-example terms, each computed from its own example. Some models compute
a term from the whole batch: batch normalisation in training mode (its
moments are reductions along the examples' axis), a contrastive loss (the
logits ``a @ b^T`` pair every example with every other), a pairwise
distance (``x[:, None] - y[None]``). There the pass still gives each
example's share of the batch gradient, but it is no batch-of-one
gradient, and clipping it bounds no one example's influence (DP-SGD).

``coupling_ops(g, rows, terms)``: the ops among the ancestors of the loss's
per-example ``terms`` (``passes.match_loss``) that

- reduce a tensor along the axis that holds its examples' rows
  (``passes.example_rows``: ``Mean``, ``Sum``, ``Max``, ``Min``, ``Prod``
  with constant axes), or run ``FusedBatchNorm`` in training mode on one;
- combine two tensors that hold the examples other than row by row: a
  matmul, batched matmul, einsum or elementwise op whose operands hold
  different rows (one transposed, or broadcast against the other), or the
  same rows where the op reads across them (``row_axes.axis_after`` finds
  none).
- reorder the rows that hold the examples (``_moves_rows``: a reverse, a
  roll, a shuffle, a gather by ids that read no data, along their axis:
  in-batch mixup), or
- sum or pick one tensor's examples into other rows (``_mixes_rows``): a
  product contracting the axis that holds them (a graph network's
  adjacency ``A @ H``, dense or sparse), a gather along that axis by ids
  that are not the examples' own (an edge list's ``gather(H, sources)``),
  a segment reduction of them (messages summed per node).

Reductions and meets count where they depend on the variables: a
statistic of the data alone (the sum of a padding mask a masked mean divides
by) scales the terms as a weight read for the batch, as the loss pass reads
it. Ops that move one example's data into another's row count on the data
too (mixup with a reversed batch, ``gather(x, perm)``): example i's term
then reads example j's input. Where the row tracker
loses the examples (an op it does not read), a data tensor whose first
axis has the batch's size is taken to hold them there when two tensors
meet (CLIP's pooled embeddings, then ``a @ b^T``), as the rest of the pass
takes it; a reduction counts only along rows the tracker followed (a
mixture of experts' ``[E, k B, d]`` with ``E = B``, summed over its
experts, is no batch statistic).
"""
from __future__ import annotations

import networkx as nx
import numpy as np

from passes import batch_flow, ir, ir_constants, row_axes
from passes.example_rows import example_rows

_MEETS = frozenset({"MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"}) | ir.ELEMENTWISE
_BATCH_NORMS = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})
_SEGMENTS = frozenset({f"{kind}Segment{r}" for kind in ("", "Unsorted", "Sparse")
                       for r in ("Sum", "Mean", "Max", "Min", "Prod", "SqrtN")})


def coupling_ops(g: nx.DiGraph, rows: dict, terms: str | None) -> tuple[str, ...]:
    """The coupling ops on the way to ``terms``, in the graph's order (module docstring)."""
    if not terms:
        return ()
    target = ir.node_of(g, terms)
    if target not in g:
        return ()
    before = nx.ancestors(g, target) | {target}
    data = ir.reachable_from(g, g.graph["arguments"])
    weighted = ir.reachable_from(g, (n for n, d in g.nodes(data=True) if d.get("variable")))
    # where the rows are lost, a data tensor leading with the batch holds them first (for
    # the meets alone: a reduction along a first axis the batch's size by chance, as a
    # mixture of experts' [E, kB, d] with E = B, is no batch statistic)
    return coupling_among(g, rows, lenient_rows(g, data), before, data, weighted)


def lenient_rows(g, data) -> dict:
    """``example_rows`` of ``g`` where a data tensor (``data``: the ops that
    depend on the arguments) leading with the batch holds the examples
    first wherever the rows are lost (module docstring)."""
    return example_rows(g, data | ir.reachable_from(g, batch_flow.batch_sources(g)), data,
                        lenient=True)


def coupling_among(g, rows, lenient, nodes, data, weighted) -> tuple[str, ...]:
    """The ops among ``nodes`` that couple the examples (module docstring),
    in the graph's order: ``rows`` and ``lenient`` are ``example_rows``'s,
    strict and lenient; ``data`` the ops that depend on the examples' data,
    ``weighted`` those a reduction or meet counts at (the others'
    statistics are weights)."""
    out = []
    for node in nx.topological_sort(g.subgraph(nodes)):
        d = g.nodes[node]
        sources = [ir.split_tensor(t)[0] for t in d["inputs"]]
        if _moves_rows(g, d, sources, rows):  # one example's data in another's row, anywhere
            out.append(node)
        elif node in weighted and (  # (a statistic of the data alone, a mask's sum: a weight)
                _reduces_rows(g, d, sources, rows) or _mixes_rows(g, d, sources, rows)
                or _meets(g, d, sources, lenient, data)):
            out.append(node)
    return tuple(out)


def batch_statistics(g: nx.DiGraph, rows: dict, output: str | None) -> tuple[str, ...]:
    """The ops on the way to the loss ``output`` that reduce the data alone
    (no variable above them) along the axis holding the examples: a masked
    mean's ``sum(mask)`` over the batch, Keras's ``ignore_class`` or masked
    losses (which divide by the batch's count of valid tokens), inputs
    standardised by the batch's moments. Each example's term is then scaled
    or shifted by the other examples' data: per-example gradients are still
    each example's share of the batch gradient (the statistic a constant
    for the batch), but clipping them bounds no one example's influence
    (removing it changes the others' terms), so DP-SGD refuses such a loss.
    A tensor's size (``Shape``, ``Size``) or a value-free ``OnesLike``
    carries no example's data. Where the row tracker lost the examples (a
    detector's label encoder: ``BroadcastTo``, a gather by flattened
    ``[B * G]`` ids), a data tensor leading with the batch holds them first
    (``lenient_rows``), as for the meets: RetinaNet's
    ``sum(labels > -1)`` over the batch's anchors, read from such labels,
    was missed and DP-SGD ran."""
    if not output:
        return ()
    target = ir.node_of(g, output)
    if target not in g:
        return ()
    seen = {s for s in g.graph["arguments"] if s in g}
    stack = list(seen)
    while stack:  # the nodes whose values carry the data's
        for nxt in g.successors(stack.pop()):
            if nxt not in seen and g.nodes[nxt]["op"] not in _VALUE_FREE:
                seen.add(nxt)
                stack.append(nxt)
    weighted = ir.reachable_from(g, (n for n, d in g.nodes(data=True) if d.get("variable")))
    before = nx.ancestors(g, target) | {target}
    out, lenient = [], None
    for node in nx.topological_sort(g.subgraph(before & seen - weighted)):
        d = g.nodes[node]
        sources = [ir.split_tensor(t)[0] for t in d["inputs"]]
        if d["op"] in row_axes.REDUCTIONS and sources and sources[0] not in rows:
            if lenient is None:  # (only where the strict rows were lost: one more walk)
                lenient = lenient_rows(g, ir.reachable_from(g, g.graph["arguments"]))
            found = _reduces_rows(g, d, sources, lenient)
        else:
            found = _reduces_rows(g, d, sources, rows)
        if found:
            out.append(node)
    return tuple(out)


def padded_to_longest(g: nx.DiGraph, output: str | None) -> tuple[str, ...]:
    """The ops on the way to the loss ``output`` that pad ragged data to the
    batch's longest row (``RaggedTensorToTensor`` with a padded axis of
    unknown size: ``TextVectorization`` without ``output_sequence_length``,
    ``RaggedTensor.to_tensor()`` without a shape). The padded length is a
    statistic of the batch's data: where the padding is not masked out (a
    mean over the positions, an RNN over the padded steps) each example's
    term depends on the other examples' lengths, so DP-SGD refuses such a
    loss (which of its uses the padding reaches is not read)."""
    target = ir.node_of(g, output) if output else None
    if target not in g:
        return ()
    before = nx.ancestors(g, target) & ir.reachable_from(g, g.graph["arguments"])
    return tuple(n for n in nx.topological_sort(g.subgraph(before))
                 if g.nodes[n]["op"] == "RaggedTensorToTensor" and any(
                     shape and len(shape) >= 2 and None in shape[1:]
                     for shape in g.nodes[n]["shapes"][:1]))


_VALUE_FREE = frozenset({"Shape", "ShapeN", "Size", "Rank", "OnesLike", "ZerosLike"})


def _reduces_rows(g, d, sources, rows) -> bool:
    if d["op"] in row_axes.REDUCTIONS and sources[0] in rows:
        return rows[sources[0]].axis in (row_axes.reduced_axes(g, d) or ())
    return d["op"] in _BATCH_NORMS and sources[0] in rows and bool(
        d["attrs"].get("is_training", True))


def _mixes_rows(g, d, sources, rows) -> bool:
    """Whether ``d`` sums or picks the examples of one input into other rows
    (module docstring): the axis it contracts, gathers along or segments is
    the one that holds them."""
    op, attrs = d["op"], d["attrs"]
    held = {i: rows[s].axis for i, s in enumerate(sources) if s in rows}
    if op in _SEGMENTS:
        return held.get(0) == 0
    if op == "GatherV2" and 0 in held and 1 not in held and not attrs.get("batch_dims", 0):
        axis, rank = ir.const_value(g, d["inputs"][2]), len(_read_shape(g, d, 0))
        return (axis is not None and rank > 0 and int(axis) % rank == _read_axis(g, d, 0, held[0])
                and not _own_rows(g, d["inputs"][1], rows[sources[0]]))
    if op == "SparseTensorDenseMatMul":  # (indices, values, shape, dense)
        return held.get(3, -1) == (1 if attrs.get("adjoint_b") else 0)
    if op == "MatMul":
        contracted = {0: 0 if attrs.get("transpose_a") else 1,
                      1: 1 if attrs.get("transpose_b") else 0}
        return any(contracted[i] == a for i, a in held.items())
    if op in ("BatchMatMulV2", "BatchMatMulV3"):
        for i, a in held.items():
            # as the op reads it: unit axes the IR saw through count here (Keras's
            # Dot: [B, 1, d] @ [B, d, 1] contracts d, not the examples)
            raw = ir.shape_of(g, d["raw_inputs"][i]) or ()
            a, rank = row_axes.axis_in(ir.shape_of(g, d["inputs"][i]) or (), raw, a), len(raw)
            flipped = attrs.get("adj_x" if i == 0 else "adj_y")
            if a == rank - (2 if (i == 0) == bool(flipped) else 1):
                return True
        return False
    if op == "Einsum":
        equation = attrs.get("equation", "").replace(" ", "")
        if "..." in equation or "->" not in equation:
            return False
        ins, out = equation.split("->")
        specs = ins.split(",")
        held = {i: _read_axis(g, d, i, a) for i, a in held.items()}  # (the letters' axes)
        return any(a < len(specs[i]) and specs[i][a] not in out for i, a in held.items())
    return False


def _moves_rows(g, d, sources, rows) -> bool:
    """Whether ``d`` reorders the examples' rows: a reverse, roll or shuffle
    along the axis that holds them (in-batch mixup's ``x + reverse(x, [0])``,
    a shuffle inside the loss: row i then holds another example's data), or
    gathers along it by ids that read no data (``gather(x, perm)``, mixup's
    ``gather(x, shuffle(range(B)))``) other than each example's own rows.
    (Ids computed from the data, as ``boolean_mask``'s, filter the rows in
    order: a ragged bag's values.)"""
    if d["op"] == "GatherV2":
        return _mixes_rows(g, d, sources, rows) and not ir.reads_values_of(
            g, ir.split_tensor(d["inputs"][1])[0], g.graph["arguments"])
    if d["op"] not in ("ReverseV2", "Roll", "RandomShuffle") or sources[0] not in rows:
        return False
    r = rows[sources[0]]
    if d["op"] == "RandomShuffle":
        return r.axis == 0
    axes = ir.const_value(g, d["inputs"][1 if d["op"] == "ReverseV2" else 2])
    rank = len(_read_shape(g, d, 0))
    return axes is None or _read_axis(g, d, 0, r.axis) in {
        int(a) % max(rank, 1) for a in np.atleast_1d(axes)}


def _read_shape(g, d, slot) -> tuple:
    """Input ``slot`` of ``d``'s shape as the op reads it, which its constant
    axes index: unit axes the IR saw through kept (``passes.canonicalize``)."""
    return ir.shape_of(g, d["raw_inputs"][slot]) or ()


def _read_axis(g, d, slot, axis) -> int:
    """``axis`` of input ``slot`` (the IR's) in that input as the op reads it."""
    return row_axes.axis_as_read(g, d["inputs"][slot], d["raw_inputs"][slot], axis)


def _own_rows(g, ids, r) -> bool:
    """Whether the ids, known when tracing, pick each example's rows from its
    own: ``n = k B`` ids in order, id ``j`` in example ``j // k``'s block of
    ``r.per_example`` rows (Gemma3's interleaving takes each example's first
    token, ``take(flat, arange(B) * T)``)."""
    value = ir_constants.constant(g, ids)
    if value is None or r.batch is None or not r.per_example or value.size % r.batch:
        return False
    flat = np.ravel(value).astype(np.int64)
    k = flat.size // r.batch
    return bool(np.all(flat // r.per_example == np.arange(flat.size) // k))


def _meets(g, d, sources, rows, data) -> bool:
    held = [s for s in sources if s in rows]  # h @ h^T: one tensor on both sides
    if d["op"] not in _MEETS or len(held) < 2:
        return False
    found = {rows[s] for s in held}
    if len(found) > 1:
        return True
    if d["op"] in ir.ELEMENTWISE:  # the same rows meet row by row (constants broadcast or not)
        return False
    out = d["shapes"][0] if d["shapes"] else None
    (r,) = found
    return row_axes.axis_after(g, d, sources, r, rows, data, len(out or ())) is None
