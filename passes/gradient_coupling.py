"""Replayed custom gradients whose gradient function reads across the examples.

A surrogate ``tf.custom_gradient`` has its own gradient function replayed in
the graph kfac_graph re-runs (``passes.custom_gradients``,
``passes.gradient_replay``). Where that function reads the cotangent, or a
forward tensor it holds, across the examples' rows (``tf.clip_by_norm(dy,
c)`` over the whole ``[B, H]``, ``dy / tf.norm(dy)``, ``dy -
reduce_mean(dy, 0)``), each example's gradient upstream depends on the
other examples: the forward couples nothing, the backward does.

``replayed_coupling(graph_def, g, rows)``: the names of the replayed
``IdentityN`` ops of ``graph_def`` (marked ``gradient_replay.PREFIX``; ``g``
its IR, ``rows`` the examples' rows there) whose gradient function couples
the examples. The function is built in a scratch graph on placeholders
shaped as what it reads (``gradient_replay.rebuilt``): each tensor it holds
as that tensor is in ``g``, the cotangent of each output as the output. The
rows start where ``rows`` holds them (a cotangent's where its result holds
the examples; where the tracker lost them, as at a ``Round``, a data tensor
leading with the batch holds them first, as ``coupling.lenient_rows`` reads
it) and are followed as ``passes.example_rows`` follows them; the op
couples where ``coupling.coupling_among`` finds, on the way to the gradient
of an input that holds the examples (one computed from the data), a
reduction along the rows, a product, gather or segment op that mixes them,
a reorder of them, or two tensors whose rows differ meeting, whatever it
depends on (the cotangent depends on the variables). The gradients of
inputs that hold no examples (a weight passed in, whose gradient sums over
the batch) are not read. Per-row functions (``clip_by_norm(dy, c,
axes=[1])``, ``clip_by_value``, ``-dy``, a straight-through ``dy``) couple
nothing. Ops the row tracker does not follow (a cumulative sum along the
batch) go unseen, as they do in the forward graph, and so does a function
that cannot be built on those placeholders. Sizes known at run time only
are pinned (to the batch, or ``shape_probe.BATCH_PROBE`` where that is
unknown too).
"""
from __future__ import annotations

import networkx as nx
import tensorflow as tf

from passes import gradient_replay, ir
from passes.coupling import coupling_among, lenient_rows
from passes.example_rows import example_rows
from passes.shape_probe import BATCH_PROBE

_MARK = "_gradient_op_type"


def replayed_coupling(graph_def, g: nx.DiGraph, rows: dict) -> tuple[str, ...]:
    """The replayed custom gradients whose function couples the examples
    (module docstring), in ``graph_def``'s order."""
    out, lenient = [], None
    for node in graph_def.node:
        kind = node.attr[_MARK].s.decode() if _MARK in node.attr else ""
        if node.op != "IdentityN" or not kind.startswith(gradient_replay.PREFIX):
            continue
        if lenient is None:  # (the rows for a tensor the row tracker lost: Round's)
            data = ir.reachable_from(g, g.graph["arguments"])
            lenient = lenient_rows(g, data)
        if _couples(g, rows, lenient, data, node, kind[len(gradient_replay.PREFIX):]):
            out.append(node.name)
    return tuple(out)


def _couples(g, rows, lenient, data, node, marker) -> bool:
    inputs = [ir.tensor_name(*ir.split_tensor(t)) for t in node.input if not t.startswith("^")]
    types = [tf.as_dtype(t) for t in node.attr["T"].list.type]
    held = gradient_replay.held(marker)
    if held is None:
        return False
    held = [t for t in held if t.name not in inputs]
    names = inputs + [t.name for t in held]
    dtypes = types + [t.dtype for t in held]
    found = [_rows(g, rows, t) or _rows(g, lenient, t) for t in names]
    reads = [ir.node_of(g, t) in data for t in names]  # whether it holds the data
    batch = next((r.batch for r in found if r), None) or BATCH_PROBE
    shapes = [_pinned(ir.shape_of(g, t), r, batch) for t, r in zip(names, found)]
    floating = [k for k, dtype in enumerate(types) if dtype.is_floating]
    specs = ([tf.TensorSpec(s, d) for s, d in zip(shapes, dtypes)]
             + [tf.TensorSpec(shapes[k], types[k]) for k in floating])
    wanted = [k for k in floating if reads[k]]  # the inputs holding the examples

    def scratch(*flat):
        value = dict(zip(names, flat))
        cotangents = dict(zip(floating, flat[len(names):]))
        fn = gradient_replay.rebuilt(marker, lambda t: value[t.name])
        grads = fn(None, *(cotangents.get(k) for k in range(len(inputs))))
        return [grads[k] for k in wanted if k < len(grads) and grads[k] is not None]

    if not wanted:
        return False
    try:
        graph = tf.function(scratch, autograph=False).get_concrete_function(*specs).graph
    except (TypeError, ValueError, KeyError, tf.errors.OpError):
        return False  # built on these shapes it fails: nothing read, as before
    if not graph.outputs:
        return False
    arguments = [t.op.name for t in graph.inputs[:len(specs)]]
    s = ir.from_tf_graph(graph, arguments, graph.outputs[0].name, {}, {})
    sources = ([(p, found[k], reads[k]) for k, p in enumerate(arguments[:len(names)])]
               + [(p, found[k], reads[k]) for k, p in zip(floating, arguments[len(names):])])
    seeds = {p: r._replace(batch=batch, per_example=r.per_example or 1)
             for p, r, _ in sources if r}
    held_data = ir.reachable_from(s, [p for p, _, reads_data in sources if reads_data])
    strict = example_rows(s, held_data, held_data, seeds=seeds)
    lenient = example_rows(s, held_data, held_data, lenient=True, seeds=seeds)
    before = set().union(*(nx.ancestors(s, t.op.name) | {t.op.name} for t in graph.outputs))
    return bool(coupling_among(s, strict, lenient, before, held_data, set(s)))


def _rows(g, rows, tensor):
    """The rows ``tensor`` holds in ``g`` (its node's, where a pass that
    removed it left one of the same shape standing for it), or None."""
    r = rows.get(ir.node_of(g, tensor))
    if r is None or ir.shape_of(g, ir.resolve(g, tensor)) != ir.shape_of(g, tensor):
        return None
    return r


def _pinned(shape, r, batch):
    """``shape`` with sizes known at run time only pinned: the rows' axis to
    ``batch`` examples of their ``k`` rows (1 where ``k`` is unknown too), any
    other to ``batch``."""
    if shape is None:
        return None
    k = (r.per_example or 1) if r else 1
    return [(batch * k if r and a == r.axis else batch) if size is None else size
            for a, size in enumerate(shape)]
