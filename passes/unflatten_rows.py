"""Layer uses on the examples' rows (``passes.example_rows``), recorded so
that their kinds read them batch first.

``unflatten_rows(groups, rows, g)`` rewrites each matched use whose input holds
rows: a dense or scale-and-shift layer on ``[k B, ..]`` rows (first axis)
reads them as ``[B, k, ..]``; a grouped dense layer on ``[G, k B, d]`` as
``[G, B, k, d]``.
"""
from __future__ import annotations

import dataclasses

from passes import batch_flow, ir, row_axes


def unflatten_rows(groups, rows, g) -> dict:
    """``groups`` (``(kind, keys) -> [(pattern, roles, Use)]``) with each use
    recorded as its input's rows are laid out (``rows``, from
    ``example_rows``; a use whose input is not followed, or leads with the
    batch, is left as it is):

    - rows ``[k B, ..]`` on the first axis: a dense use reads them as
      ``[B, k, ..]`` (its ``input_shape``, which the dense kind's operands
      lay ``a`` and ``g`` out by); a scale-and-shift use (a layer or group
      norm on rows, a shift alone on them) each recorded shape that leads
      with ``k B`` (its rule sums over the ``k`` rows as over any axis its
      scale broadcasts along);
    - the examples on a later axis (a time-major ``[T, B, d]``): a dense use
      on it moves that axis first (``batch_axis``) before reading it so;
    - a lookup added over the batch to ``[k B, ..]`` rows: its gradient
      summed over each example's ``k`` rows (``row_groups``);
    - a grouped dense use: ``[G, k B, d]`` read as ``[G, B, k, d]``;
    - where ``k`` is known at run time only (a sequence of any length), a
      dense, scale-and-shift or grouped dense use records the rows' axis
      (``run_time_rows``) and ``None`` for ``B`` and ``k``; other kinds on
      such rows are unsupported;
    - a dense or scale-and-shift use on data that leads with another size
      than the batch's, on rows not followed (``tf.map_fn`` over the
      batch: ``[1, d]`` per example; a tower run once on ``concat([x1,
      x2], 0)``), is unsupported too (``g``: the graph, whose static batch
      it reads);
    - any other use on rows is unsupported (the variable is generic, with
      the reason): its kind would read the first axis as the examples. With
      ``T = B`` the shapes alone would pass, and its per-example gradients
      would be wrong."""
    out = {}
    for key, items in groups.items():
        out[key] = []
        for pattern, roles, use in items:
            # a lookup added over the batch (ids without an example axis): its sum
            tensor = use.output if use.attrs.get("ids_broadcast") or not use.inputs else \
                use.inputs[0]
            source, r = _rows_as_read(g, rows, tensor)
            attrs = _recorded(key[0], use.attrs, r)
            if r is None and "unsupported" not in attrs:
                attrs = _other_rows(g, key[0], attrs, source)
            if attrs is not use.attrs:
                use = dataclasses.replace(use, attrs=attrs)
            out[key].append((pattern, roles, use))
    return out


def _rows_as_read(g, rows, tensor):
    """``(node, rows)`` of the use's input ``tensor`` as the layer reads it:
    one a pass saw through (a unit-axis reshape, ``passes.canonicalize``)
    holds the rows of the node that stands for it, on the axis where the
    layer's input (its shapes, its ``batch_axis``) has them."""
    now = ir.resolve(g, tensor)
    source = ir.split_tensor(now)[0]
    r = rows.get(source)
    if r is not None and now != tensor:
        r = r._replace(axis=row_axes.axis_as_read(g, now, tensor, r.axis))
    return source, r


def _recorded(kind, attrs, r):
    if kind == "grouped_dense":
        return _grouped_attrs(attrs, r)
    if r is None or (r.axis == 0 and r.per_example == 1):
        return attrs
    if r.per_example is None and kind not in ("dense", "scale_and_shift"):
        return _unsupported(attrs, r)
    if r.axis == 0 and kind in _UNFLATTEN:
        return _UNFLATTEN[kind](attrs, r)
    if kind == "dense" and r.per_example is not None:
        return _dense_batch_moved(attrs, r)
    return _unsupported(attrs, r)


def _other_rows(g, kind, attrs, source):
    """A dense or scale-and-shift use whose input leads with another size
    than the batch's (static) and holds no rows the tracker followed: one
    example per use (``tf.map_fn`` over the batch), or the examples of
    several tensors concatenated along the first axis (a siamese tower run
    once on ``concat([x1, x2], 0)``)."""
    shape, batch = attrs.get("input_shape"), batch_flow.static_batch(g)
    if (kind not in ("dense", "scale_and_shift") or not batch or not shape
            or shape[0] is None or shape[0] == batch
            or not ir.reads_values_of(g, source, g.graph["arguments"])):
        return attrs
    return {**attrs, "unsupported": (
        f"its input's first axis is {shape[0]}, not the batch's {batch}, and holds no "
        "examples' rows the pass follows (a loop over the examples, as tf.map_fn, or "
        "examples concatenated along it): call the layer on the batch, once per input")}


def _unsupported(attrs, r):
    k = "a run-time number of" if r.per_example is None else r.per_example
    where = (f"holds each example's {k} rows on its first axis ([k B, ..])"
             if r.axis == 0 else f"holds the examples on axis {r.axis}, not the first "
             "(a transposed, time-major tensor)")
    return {**attrs, "unsupported": f"its input {where}, which its kind does not read"}


def _split(shape, r):
    """``shape`` read as ``[B, k, ..]`` where it leads with ``k B`` (k > 1;
    both unknown where the rows per example are known at run time only)."""
    if r.per_example is None:
        return (None, None, *shape[1:]) if shape and shape[0] is None else shape
    size = None if r.batch is None else r.batch * r.per_example
    if shape and r.per_example > 1 and shape[0] == size:
        return (r.batch, r.per_example, *shape[1:])
    return shape


def _dynamic(attrs, r, axis=0):
    """``attrs`` marked, where the rows per example are known at run time
    only, with the axis that holds them (``run_time_rows``): the runtime
    reads them as ``[B, -1]`` there, from its batch."""
    return attrs if r.per_example is not None else {**attrs, "run_time_rows": axis}


def _dense_batch_moved(attrs, r):
    """A dense use whose input holds the examples on a later axis (one of its
    positions, never a contracted one): the axis moved first, then read as
    rows on the first axis."""
    shape = attrs.get("input_shape")
    contracted = attrs.get("lora", {}).get("kernel_in_axes") or attrs.get("kernel_in_axes") or 1
    if (not shape or "stacked_rows" in attrs or "parts" in attrs
            or r.axis >= len(shape) - contracted):
        return _unsupported(attrs, r)
    moved = (shape[r.axis], *shape[:r.axis], *shape[r.axis + 1:])
    return {**_dense_attrs({**attrs, "input_shape": moved}, r._replace(axis=0)),
            "batch_axis": r.axis}


def _dense_attrs(attrs, r):
    if r.per_example is None and ("stacked_rows" in attrs or "lora" in attrs):
        return _unsupported(attrs, r)
    if not attrs.get("input_shape") or "stacked_rows" in attrs:
        return attrs
    return _dynamic({**attrs, "input_shape": _split(attrs["input_shape"], r)}, r)


def _scale_shift_attrs(attrs, r):
    out = {**attrs, **{k: _split(attrs.get(k), r) for k in ("input_shape", "output_shape")}}
    out["operand_shapes"] = tuple(_split(s, r) for s in attrs.get("operand_shapes") or ())
    return _dynamic(out, r)


def _grouped_attrs(attrs, r):
    """A grouped dense use (``passes.patterns_grouped``) reads its input and
    output ``[G, k B, d]`` as ``[G, B, k, d]``; without the examples' rows
    on that axis it is unsupported."""
    shapes = [attrs.get("input_shape"), attrs.get("output_shape")]
    if r is None or r.axis != 1 or any(not s or len(s) != 3 for s in shapes):
        return {**attrs, "unsupported": "a grouped dense input [G, N, d] whose rows N do "
                "not hold the examples' rows in groups"}
    split = lambda s: (s[0], r.batch, r.per_example, s[2])  # noqa: E731
    return _dynamic({**attrs, "input_shape": split(shapes[0]), "output_shape": split(shapes[1])},
                    r, axis=1)


def _embedding_attrs(attrs, r):
    """A lookup added over the batch (``ids_broadcast``: position or
    relative-position rows) to ``[k B, ..]`` rows (a video's frames, Swin's
    windows): every row of an example reads the same ids, so its gradient
    is summed over its ``k`` rows first (``row_groups``)."""
    if not attrs.get("ids_broadcast"):
        return _unsupported(attrs, r)
    return {**attrs, "row_groups": r.per_example}


_UNFLATTEN = {"dense": _dense_attrs, "scale_and_shift": _scale_shift_attrs,
              "embedding": _embedding_attrs}
