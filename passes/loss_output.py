"""The model output of a loss that is no likelihood the pass reads: where a
Gauss-Newton curvature can be taken.

A loss that is not a negative log-likelihood of the kinds ``passes.match_loss``
reads (Huber, log-cosh, Poisson, focal, a KL divergence, a cosine
similarity) still has a model output ``z``: the first tensor that every path
from the trainable variables to the per-example terms passes through (a
dominator of the terms in the variables' graph) and that holds the examples
on its first axis, the last layer's output before any activation the loss
applies. Below it the loss head ``l_i(z_i)`` reads no variable, so the
generalised Gauss-Newton matrix ``(1/B) sum_i J_i^T H_i J_i`` with
``H_i = d^2 l_i / dz_i^2`` is the loss's curvature through ``z``
(``kfac_graph.fisher.ggn``); for the likelihood kinds it equals their Fisher.

Contract: ``ggn_output(g, terms, rows) -> (z, "")`` or ``(None, why not)``.
Refused, with the reason the loss stays ``"opaque"`` (empirical Fisher):

- no such tensor (heads that meet only in the loss);
- a head piecewise linear in ``z`` (an L1 or hinge loss: ``H = 0`` almost
  everywhere, a curvature of damping alone);
- a head that mixes positions, or examples: ``H`` is formed per position,
  ``K x K`` over ``z``'s last axis (its classes), so the head may hold only
  elementwise ops (broadcasting against data), transposes that keep the
  examples first (``tf.nn.log_softmax(axis=1)``), and softmax, reductions,
  reshapes, slices and splits of the classes' axis alone;
- ``K`` unknown, or above ``MAX_CLASSES`` (``H`` takes ``K`` backward passes).

A loss that adds terms of several outputs (two heads; a VAE's
reconstruction and KL terms), or a term no one output dominates (a mean and
a log variance from two layers: ``frontier_outputs``), has one output per
term or several: ``joint_outputs(g, heads, params, examples_first, rows)``
gives them all, to be joined (``passes.joined_outputs``), with ``H`` formed
per example over all their values.
"""
from __future__ import annotations

import networkx as nx
import numpy as np
import tensorflow as tf

from passes import ir
from passes.coupling import coupling_ops
from passes.position_heads import LAST_AXIS, REDUCTIONS, SLICES, mixing_op

MAX_CLASSES = 256
_COMPARISONS = frozenset({
    "Less", "LessEqual", "Greater", "GreaterEqual", "Equal", "NotEqual", "LogicalAnd",
    "LogicalOr", "LogicalNot", "IsFinite", "IsNan", "ZerosLike", "OnesLike"})
# ops with no curvature in their varying inputs (piecewise linear)
_PIECEWISE_LINEAR = _COMPARISONS | {
    "Add", "AddV2", "AddN", "Sub", "Neg", "Abs", "Maximum", "Minimum", "Relu", "Relu6",
    "LeakyRelu", "Sum", "Mean", "Max", "Min", "Identity", "Cast", "StopGradient", "Reshape",
    "ExpandDims", "Squeeze", "SelectV2", "Select", "ClipByValue", "Sign", "BiasAdd", "Floor"}
# ops that are linear where one input alone varies (a divisor must not vary)
_BILINEAR = frozenset({"Mul", "RealDiv", "DivNoNan"})
_LINEAR = frozenset({"Sum", "Mean", "Add", "AddV2", "AddN", "Sub", "Neg", "Identity", "Reshape",
                     "ExpandDims", "Squeeze", "Cast", "BiasAdd", "StopGradient"})  # in z
# the head below frontier outputs may mix an example's values (its Hessian is
# formed over all of them) but only with ops TensorFlow differentiates twice
# as written (not a CTC loss, whose gradient the op computes in its forward)
_TWICE_DIFFERENTIABLE = (ir.ELEMENTWISE | LAST_AXIS | REDUCTIONS | SLICES | frozenset({
    "Reshape", "Transpose", "ExpandDims", "Squeeze", "Pack", "ConcatV2", "MatMul",
    "BatchMatMulV2", "Einsum", "Tile", "BroadcastTo", "GatherV2", "Square", "Shape"}))
_SOURCE = "\x00variables"


def ggn_output(g: nx.DiGraph, terms: str, params: set,
               examples_first, curved=True) -> tuple[str | None, str]:
    """``(z, "")``: the model output of the loss whose per-example terms are
    ``terms`` (module docstring), or ``(None, why not)``. ``params``: the
    nodes that depend on a trainable variable; ``examples_first(node)``:
    whether the node's output holds the examples on its first axis. Where the earliest candidate
    fails a check, a later one (a dominator nearer the loss) may pass: its
    Gauss-Newton matrix linearises more of the head. ``curved=False``: a
    head piecewise linear in ``z`` passes too (a term added to a curved one,
    ``joint_outputs``)."""
    end = ir.node_of(g, terms)
    reasons = []
    for z in _dominating_outputs(g, end, params, examples_first):
        why = _refusal(g, z, _head(g, z, end, params), params, curved)
        if not why:
            return z, ""
        reasons.append(why)
    return None, reasons[0] if reasons else "no single model output feeds the loss"


def frontier_outputs(g: nx.DiGraph, terms: str, params: set, examples_first,
                     rows: dict) -> tuple[list | None, str]:
    """``([z_1, ..], "")``: where no one output dominates the terms (a
    heteroscedastic regression's mean and log variance, each from its own
    layer; a VAE's ``z_mean`` and ``z_log_var``), the tensors through which
    the data-dependent values enter the loss head, the ops below every op
    that reads a variable's value directly; or ``(None, why not)``. They
    must hold the examples first, with static sizes, and the head must not
    couple the examples (``passes.coupling``): its Hessian is formed per
    example over all of them, joined (``joint_outputs``), so it must hold
    only ops TensorFlow differentiates twice as written."""
    end = ir.node_of(g, terms)
    above = nx.ancestors(g, end) & params
    data = ir.reachable_from(g, g.graph["arguments"])
    weights = params - data
    entries = {n for n in above | {end}
               if n in data and any(p in weights for p in g.predecessors(n))}
    below_entries = set().union(*(nx.ancestors(g, e) | {e} for e in entries))
    head = (above | {end}) - below_entries
    if end not in head:
        return None, "no single model output feeds the loss"
    outputs = []
    for node in sorted(above - head):
        slots = {i for succ in g.successors(node) if succ in head
                 for i, _ in g.edges[node, succ]["slots"]}
        if not slots:
            continue
        if node in weights or len(slots) > 1 or not examples_first(node):
            return None, "no single model output feeds the loss"
        outputs.append(ir.tensor_name(node, slots.pop()))
    unknown = sorted(n for n in head if g.nodes[n]["op"] not in _TWICE_DIFFERENTIABLE)
    if unknown:
        return None, (f"op {unknown[0]!r} ({g.nodes[unknown[0]]['op']}) below the outputs "
                      "is none whose second derivative the pass knows")
    coupled = set(coupling_ops(g, rows, terms)) & head
    if coupled:
        return None, f"op {sorted(coupled)[0]!r} mixes the examples below the outputs"
    return outputs, ""


def per_position(g, z, terms, params, row_cross_entropy: bool = False) -> bool:
    """Whether the head from ``z`` to ``terms`` is per position of ``z``
    (``position_heads.mixing_op``), so that its Hessian may be formed over ``z``'s last
    axis alone; else it is formed per example, over ``z`` joined."""
    return mixing_op(g, z, _head(g, z, ir.node_of(g, terms), params),
                     row_cross_entropy) is None


def _through_gradients(g, params) -> set:
    """The nodes of ``params`` a gradient reaches: not those behind a
    ``StopGradient`` on every path from the variables."""
    kept = g.subgraph(n for n in params if g.nodes[n]["op"] not in ir.GRADIENT_STOPS)
    return ir.reachable_from(kept, (n for n in kept if g.nodes[n]["op"] == "Variable"))


def _refusal(g, z, head, params, curved=True) -> str:
    shape = ir.shape_of(g, z)
    if not shape or shape[-1] is None:
        return f"the model output {z}'s class axis has no static size"
    if shape[-1] > MAX_CLASSES:
        return (f"the model output {z} has {shape[-1]} classes, beyond the {MAX_CLASSES} "
                "whose loss Hessian is formed")
    mixing = mixing_op(g, z, head)
    if mixing:
        return f"op {mixing!r} mixes the positions or examples of the model output {z}"
    if curved and not any(_curved(g, node, params) for node in head):
        return _piecewise_linear(z)
    return ""


def _piecewise_linear(z) -> str:
    return f"the loss is piecewise linear in the model output {z} (no curvature)"


def _dominating_outputs(g, end, params, examples_first):
    """The tensors on every path from the variables to ``end`` that hold the
    examples on their first axis (not ``end`` itself), earliest first."""
    ancestors = nx.ancestors(g, end) | {end}
    sub = nx.DiGraph(g.subgraph(ancestors & params).edges)
    sub.add_node(end)
    sub.add_edges_from((_SOURCE, n) for n in ancestors & params
                       if g.nodes[n]["op"] == "Variable")
    if _SOURCE not in sub or end not in nx.descendants(sub, _SOURCE):
        return
    idom = nx.immediate_dominators(sub, _SOURCE)
    chain, node = [], idom[end]
    while node != _SOURCE:
        chain.append(node)
        node = idom[node]
    for node in reversed(chain):
        if g.nodes[node]["op"] == "Variable" or not examples_first(node):
            continue
        indices = {i for succ in sub.successors(node)
                   for i, _ in g.edges[node, succ]["slots"]}
        if len(indices) == 1:
            yield ir.tensor_name(node, indices.pop())


def _head(g, z, end, params):
    """The varying nodes from ``z``'s node (excluded) down to ``end`` (included)."""
    start = ir.split_tensor(z)[0]
    return (nx.descendants(g, start) & (nx.ancestors(g, end) | {end})) & params


def _curved(g, node, params) -> bool:
    op = g.nodes[node]["op"]
    if op in _PIECEWISE_LINEAR:
        return False
    if op in _BILINEAR:
        varying = [t for t in g.nodes[node]["inputs"] if ir.split_tensor(t)[0] in params]
        return len(varying) > 1 or (op != "Mul" and g.nodes[node]["inputs"][1] in varying)
    return True


def joint_outputs(g, heads, params, examples_first, rows) -> tuple:
    """``([z_1, ..], "", blocks, likelihood_blocks)``: one model output per
    term of a loss that adds several (``heads``: per term, its terms and its
    likelihood's output and kind, or None and ``""``; a term with none takes
    ``ggn_output``'s), distinct, or ``(None, why not, (), ())``. Together
    they must cut every path from the variables to the terms, one may feed
    another (a VAE's encoder output, read by its KL term,
    feeds the decoder's) but no term may read its output through another's,
    and they must hold floating point: the curvature is the Hessian of the
    examples' summed loss over all of them (``passes.joined_outputs`` joins
    them into one), formed whole where they hold at most ``MAX_CLASSES``
    values per example, static (``blocks`` empty), else block by block
    (``hessian_blocks``; so at a length read at run time), a categorical
    head's block its likelihood's Fisher (``likelihood_blocks``).
    A term piecewise linear in its output adds no output (its Hessian is
    zero), but the others' must cut it from the variables too
    (``tf.nn.weighted_cross_entropy_with_logits`` adds ``(1 - y) z`` to a
    curved term of the same ``z``; an L1 activity penalty on a hidden layer
    is cut by no output, and stays in no curvature)."""
    outputs, pairs, ends, categorical = [], [], set(), {}
    live = _through_gradients(g, params)
    for terms, output, kind in heads:
        end = ir.node_of(g, terms)
        if end not in live:  # under a stop_gradient (a log-sum-exp's maximum): a constant
            continue
        ends.add(end)
        if kind == "categorical":
            categorical[end] = terms
        found = [output]  # a likelihood's: curved
        if output is None:
            output, why = ggn_output(g, terms, params, examples_first)
            found = [output] if output else frontier_outputs(
                g, terms, params, examples_first, rows)[0]
            if found and not any(_curved(g, node, params) for node in set().union(
                    *(_head(g, z, end, params) for z in found))):
                found = None
            if found is None:  # no curvature: the term adds no output
                if ggn_output(g, terms, params, examples_first, curved=False)[0] is None:
                    return None, why, (), ()
                found = []
        pairs += [(z, end) for z in found]
        outputs += [z for z in found if z not in outputs]
    if not outputs:
        return None, "the loss is piecewise linear in its outputs (no curvature)", (), ()
    nodes = {ir.node_of(g, z) for z in outputs}
    for z, end in pairs:
        through = _head(g, z, end, params) & (nodes - {ir.node_of(g, z)})
        if through:
            return None, (f"the loss term {end} reads its output {z} through another output, "
                          f"{', '.join(sorted(through))}"), (), ()
    cut = g.subgraph(params - nodes)
    variables = [n for n in cut if g.nodes[n]["op"] == "Variable"]
    if ir.reachable_from(cut, variables) & ends:
        return (None, f"the outputs {', '.join(outputs)} do not cut the variables from the "
                "loss", (), ())
    shapes = [ir.shape_of(g, ir.resolve(g, z)) for z in outputs]
    if any(not s for s in shapes):
        return None, f"the outputs {', '.join(outputs)} have no static rank", (), ()
    if any(not tf.as_dtype(ir.dtype_of(g, z)).is_floating for z in outputs):
        return None, f"the outputs {', '.join(outputs)} are not all floating point", (), ()
    known = all(None not in s[1:] for s in shapes)
    total = sum(int(np.prod(s[1:])) for s in shapes) if known else None
    if known and total <= MAX_CLASSES:
        return outputs, "", (), ()
    blocks = hessian_blocks(g, outputs, shapes, pairs, params, categorical)
    if blocks is None:
        held = (f"hold {total} values per example, beyond the {MAX_CLASSES} whose loss "
                "Hessian is formed," if known else "have sizes not known statically")
        return None, (f"the outputs {', '.join(outputs)} {held} and it has no blocks "
                      f"within {MAX_CLASSES} classes"), (), ()
    return outputs, "", *blocks


def hessian_blocks(g, outputs, shapes, pairs, params, categorical=None) -> tuple | None:
    """``(((n_1, K_1), ..), likelihoods)``, in the joined output's order: its
    loss Hessian is block-diagonal, one block per group of outputs read by
    the same terms (``pairs``: (output, term)), the terms of different
    groups reading no output in common. A block holds ``n`` values per example, ``K`` classes
    at each of its ``n / K`` positions: where the group is one output whose
    every head is ``elementwise_head``, ``K = 1`` (a Bernoulli
    reconstruction's pixels), else where every head is ``per_position``,
    ``K x K`` per position, else ``K = n``. Forming it takes
    ``sum K`` backward passes, at most ``MAX_CLASSES``; None where it would
    take more, or a group's outputs are not adjacent. A group that is one
    output read only by heads of the likelihood kind ``"categorical"``
    (``categorical``: their terms by their node; a cross-entropy, or one
    beside a distillation's on the same logits) needs no pass: its block,
    ``K x K`` per position, is that likelihood's Fisher, weighted per
    position as the heads' terms are, summed
    (``kfac_graph.fisher.ggn_blocks``), where ``likelihoods`` names the
    terms (``()`` for a Hessian's block). ``n`` is None where an output's
    positions are not known statically (a length read at run time, in one
    block at most, its ``K`` static: a head per position, or elementwise)."""
    group = {z: {z} for z in outputs}
    for end in {end for _, end in pairs}:
        readers = [z for z, e in pairs if e == end]
        merged = set().union(*(group[z] for z in readers))
        for z in merged:
            group[z] = merged
    blocks, likelihoods, categorical, i = [], [], categorical or {}, 0
    while i < len(outputs):
        members = group[outputs[i]]
        if set(outputs[i:i + len(members)]) != members:
            return None
        sizes = [shapes[i + j][1:] for j in range(len(members))]
        n = (sum(int(np.prod(s)) for s in sizes) if all(None not in s for s in sizes)
             else None)
        heads = [(z, end) for z, end in pairs if z == outputs[i]] if len(members) == 1 else []
        k, likelihood = n, ()
        if heads and all(end in categorical for _, end in heads) and shapes[i][-1]:
            k, likelihood = shapes[i][-1], tuple(categorical[end] for _, end in heads)
        elif heads and all(elementwise_head(g, z, end, params) for z, end in heads):
            k = 1  # a Bernoulli reconstruction's pixels
        elif heads and all(per_position(g, z, end, params, row_cross_entropy=True)
                           for z, end in heads):
            k = shapes[i][-1]
        if k is None:
            return None
        blocks.append((n, k))
        likelihoods.append(likelihood)
        i += len(members)
    if sum(n is None for n, _ in blocks) > 1:  # (the runtime reads one from the joined width)
        return None
    passes = sum(k for (_, k), head in zip(blocks, likelihoods) if not head)
    return (tuple(blocks), tuple(likelihoods)) if passes <= MAX_CLASSES else None


def elementwise_head(g, z, end, params) -> bool:
    """Whether the head from ``z`` to ``end`` is a sum of functions of one value
    of ``z`` each, plus terms linear in ``z`` (a diagonal Hessian): elementwise
    ops, then sums or means, then ops linear in ``z`` alone (``_LINEAR``)."""
    head = _head(g, z, end, params)
    varying, reduced = head | {ir.split_tensor(z)[0]}, set()
    for node in nx.topological_sort(g.subgraph(head)):
        op, inputs = g.nodes[node]["op"], g.nodes[node]["inputs"]
        moving = [t for t in inputs if ir.split_tensor(t)[0] in varying]
        if not any(ir.split_tensor(t)[0] in reduced for t in moving):
            if op in ("Sum", "Mean"):
                reduced.add(node)
            elif op not in ir.ELEMENTWISE:
                return False
            continue
        linear = op in _LINEAR or (op in _BILINEAR and len(moving) == 1 and (
            op == "Mul" or inputs[0] in moving))
        if not linear:
            return False
        reduced.add(node)
    return True
