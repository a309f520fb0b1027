"""Static shapes a graph lost to a run-time batch, recovered by probing it.

A function traced with an input signature whose batch is ``None`` (every
SavedModel's, ``tf.function(input_signature=...)``) computes its reshapes'
targets from ``tf.shape`` at run time: Keras's Dense on ``[B, T, d]`` is a
Tensordot, ``reshape(x, [prod(shape(x)[:-1]), d]) @ W`` reshaped back to
``concat([shape(x)[:-1], [n]])``. TensorFlow's shape inference folds such
shape arithmetic only when every size in it is known, so in that graph the
rows are ``[?, ?]`` and everything after them ``[?, ?, n]``: the pass can
match no layer on them, and the logits lose their class count.

``restore_shapes(traced)`` imports the graph again with every unknown size
of its arguments pinned to each of ``PROBES`` in turn (one value for all of
them at a time, so that sizes the graph checks against each other still
agree) and keeps, per tensor, the sizes that are the same under every probe
the graph accepts: those do not depend on the run-time sizes (``T = 6`` in
``[B, T, d]`` does not; ``6 B`` does). It writes them into the GraphDef as the nodes'
``_output_shapes``, which TensorFlow's importer merges into what it infers,
so the pass and the graph the runtime re-imports see them both. A size that
varies between probes stays unknown. A probe the graph rejects (its shape
inference fails: a batch split in halves rejects an odd one) is a batch it
cannot run with, and is left out; with fewer than two probes left (a batch
fixed by a constant reshape) the graph is left as it was. The probes are
spread far enough that a size clipped or divided by the batch
(``min(B, 32)``, ``B // 16``) varies between them, and one is odd, so that
``reshape(x, [B // 2, -1])``'s second size does.

Where the batch stays unknown even under a probe (a recurrent layer's
outputs stacked from a list whose element shape was traced ``[-1, d]``),
the Tensordot after it still has rows ``[?, ?]``: then each Reshape's
target is evaluated element by element (``StaticEvaluator.partial``:
``[prod(shape(x)[:-1]), prod(shape(x)[-1:])]`` is ``[?, d]``), and the
graph imported again with what that adds, until nothing does.

The examples' rows (``passes.example_rows``: ``[k B, d]`` after
``reshape(h, [-1, d])``, a mixture of experts' tokens, Swin's windows) are
read from sizes, so with an unknown batch there are none to follow, and a
dense layer on such rows would take each row for an example.
``probed_rows(traced, rows_of, g)`` computes them on the graph with the
batch pinned to each of ``ROW_PROBES`` and keeps those the probes agree on
(each example's ``k`` rows on one axis), with the batch unknown; where the
probes agree on the axis but not on ``k`` (tokens of sequences of any
length: ``k = T``, pinned with the batch), ``k`` is known at run time only
(``Rows.per_example`` None).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from passes import frontends
from passes.static_eval import StaticEvaluator

PROBES = (8, 24, 64, 13)
ROW_PROBES = (24, 40)
BATCH_PROBE = 29
_ROUNDS = 8


def restore_shapes(traced):
    """``traced`` with its GraphDef's static shapes completed (module
    docstring); ``traced`` itself when no argument has an unknown size or no
    shape gains a size."""
    args = _unknown_arguments(traced)
    if not args:
        return traced
    base = frontends.import_graph(traced)[0]
    gains, values = _probe_gains(traced, args, _shapes(base), _run_time_paddings(base))
    graph = frontends.import_graph(_annotated(traced, gains))[0] if gains else base
    for _ in range(_ROUNDS):
        more = _reshape_gains(graph)
        if not more:
            break
        gains.update(more)
        graph = frontends.import_graph(_annotated(traced, gains))[0]
    restored = _annotated(traced, gains) if gains else traced
    return dataclasses.replace(restored, batch_axes=_batch_axes(restored, args, _shapes(graph)),
                               probed_values=values)


def _run_time_paddings(base) -> list:
    """The ``SpaceToBatchND`` (paddings) and ``BatchToSpaceND`` (crops) ops
    whose operand 2 is computed from a size known at run time only:
    TensorFlow's dilated convolution on an input of any size pads it to a
    multiple of the dilation and crops the excess (``passes.atrous`` reads
    their values under the probes)."""
    evaluator = StaticEvaluator()
    return [op.name for op in base.get_operations()
            if op.type in ("SpaceToBatchND", "BatchToSpaceND")
            and evaluator.value(op.inputs[2]) is None]


def _batch_axes(traced, args, shapes) -> dict:
    """``{op name: axes}``: the unknown sizes of ``shapes`` that are the
    batch's, found by pinning the arguments' first axes to ``BATCH_PROBE``
    and their other unknown sizes to ``PROBES[0]``: a size that is then
    ``BATCH_PROBE`` (a prime no product of the others makes) is the batch.
    ``{}`` when the graph rejects that probe (an argument without the batch
    first)."""
    graph = _imported(traced, args, PROBES[0], first=BATCH_PROBE)
    if graph is None:
        return {}
    probed = _shapes(graph)
    out = {}
    for name, base in shapes.items():  # (each op's first output)
        pinned = probed.get(name)
        if not base or not pinned or base[0].rank is None or pinned[0].rank != base[0].rank:
            continue
        axes = tuple(i for i, (d, p) in enumerate(zip(base[0].as_list(), pinned[0].as_list()))
                     if d is None and p == BATCH_PROBE)
        if axes:
            out[name] = axes
    return out


def _probe_gains(traced, args, base, read=()) -> tuple[dict, dict]:
    """``({op name: [TensorShape per output]}, {op name: (value per
    probe)})``: where the probes the graph accepts (at least two) agree on
    sizes ``base`` does not know, and the value of operand 2 of each op
    named in ``read`` under those probes (where at least two evaluate it)."""
    probed, values = [], {name: [] for name in read}
    for p in PROBES:
        graph = _imported(traced, args, p)
        if graph is None:
            continue
        probed.append(_shapes(graph))
        evaluator = StaticEvaluator()
        for name in read:
            value = evaluator.value(graph.get_operation_by_name(name).inputs[2])
            if value is not None:
                values[name].append(tuple(map(tuple, np.asarray(value).tolist())))
    values = {name: tuple(v) for name, v in values.items() if len(v) >= 2}
    if len(probed) < 2:
        return {}, values
    gains = {}
    for name, shapes in base.items():
        found = [_agreed(s, [p.get(name, (None,) * len(shapes))[k] for p in probed])
                 for k, s in enumerate(shapes)]
        if [f.as_list() if f.rank is not None else None for f in found] != [
                s.as_list() if s.rank is not None else None for s in shapes]:
            gains[name] = found
    return gains, values


def _reshape_gains(graph) -> dict:
    """``{op name: [TensorShape]}``: Reshapes whose target has static
    elements TensorShape inference did not fold (``[prod(shape(x)[:2]),
    prod(shape(x)[2:])]`` with the batch unknown: the second is static)."""
    evaluator = StaticEvaluator()
    gains = {}
    for op in graph.get_operations():
        shape = op.outputs[0].shape if op.type == "Reshape" else None
        if shape is None or shape.is_fully_defined():
            continue
        target = evaluator.partial(op.inputs[1])
        if target is None or np.ndim(target) != 1:
            continue
        sizes = [None if v is None or int(v) < 0 else int(v) for v in np.asarray(target).tolist()]
        try:
            merged = shape.merge_with(tf.TensorShape(sizes))
        except ValueError:
            continue
        if merged.as_list() != (shape.as_list() if shape.rank is not None else None):
            gains[op.name] = [merged]
    return gains


def _annotated(traced, gains):
    """``traced`` with ``gains`` written as its nodes' ``_output_shapes``."""
    def write(node):
        node.attr["_output_shapes"].list.Clear()
        for shape in gains[node.name]:
            node.attr["_output_shapes"].list.shape.add().CopyFrom(shape.as_proto())
    return _edited(traced, gains, write)


def probed_rows(traced, rows_of, g) -> dict:
    """``{node: Rows}`` of ``g`` (the IR of ``traced``, some of whose sizes
    are unknown), from ``rows_of`` (a traced graph -> its IR's rows) on
    ``traced`` pinned to each of ``ROW_PROBES``: the rows every probe finds
    with the same ``k`` and axis, ``Rows.batch`` None unless the batch is
    known (a length left unknown: ``[B, None]``). ``{}`` when no argument
    has an unknown size or a probe cannot be imported."""
    args = _unknown_arguments(traced)
    if not args:
        return {}
    try:
        found = [rows_of(_pinned(traced, args, p)) for p in ROW_PROBES]
    except Exception:  # noqa: BLE001 - a probe the graph rejects: no rows, as before
        return {}
    first, *rest = found
    out = {}
    for node, r in first.items():
        others = [o.get(node) for o in rest]
        if node not in g or any(o is None or o.axis != r.axis for o in others):
            continue
        batch = r.batch if all(o.batch == r.batch for o in others) else None
        if all(o.per_example == r.per_example for o in others):
            out[node] = r._replace(batch=batch)
        elif r.per_example > 1 and all(o.per_example > 1 for o in others):
            out[node] = r._replace(batch=batch, per_example=None)  # k varies with the length
    return out


def _imported(traced, args, probe, first=None):
    """``_pinned(traced, args, probe, first)`` imported (a ``tf.Graph``), or
    None when that import fails: the graph cannot run with such sizes."""
    try:
        return frontends.import_graph(_pinned(traced, args, probe, first))[0]
    except Exception:  # noqa: BLE001 - TensorFlow's shape inference raises many types
        return None


def _unknown_arguments(traced) -> set:
    """The argument placeholders of ``traced`` with an unknown size (empty
    when the graph knows them all: nothing to probe)."""
    arguments = set(traced.arguments)
    shapes = {n.name: n.attr["shape"].shape for n in traced.graph_def.node
              if n.name in arguments and "shape" in n.attr}
    if not any(s.unknown_rank or any(d.size < 0 for d in s.dim) for s in shapes.values()):
        return set()
    return set(shapes)


def _pinned(traced, args, probe, first=None):
    """``traced`` with every unknown size of the arguments ``args`` set to
    ``probe`` (their first axes' to ``first`` where given)."""
    def pin(node):
        for i, d in enumerate(node.attr["shape"].shape.dim):
            if d.size < 0:
                d.size = first if i == 0 and first is not None else probe
    return _edited(traced, args, pin)


def _edited(traced, names, edit):
    """``traced`` with a copy of its GraphDef whose nodes named in ``names``
    ``edit`` changed in place."""
    graph_def = type(traced.graph_def)()
    graph_def.CopyFrom(traced.graph_def)
    for node in graph_def.node:
        if node.name in names:
            edit(node)
    return dataclasses.replace(traced, graph_def=graph_def)


def _shapes(graph) -> dict:
    """``{op name: [TensorShape per output]}`` of an imported graph."""
    return {op.name: [t.shape for t in op.outputs] for op in graph.get_operations()}


def _agreed(shape: tf.TensorShape, probed) -> tf.TensorShape:
    """``shape`` with each unknown size the probes all agree on filled in."""
    if shape.rank is None or any(p is None or p.rank != shape.rank for p in probed):
        return shape
    sizes = []
    for k, size in enumerate(shape.as_list()):
        seen = {p[k] for p in probed}
        sizes.append(size if size is not None or len(seen) != 1 else seen.pop())
    return tf.TensorShape(sizes)
