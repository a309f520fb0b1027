"""Layer uses on the examples' rows (``passes.example_rows``), recorded so
that their kinds read them batch first.

``unflatten_rows(groups, rows)`` rewrites each matched use whose input holds
rows: a dense or scale-and-shift layer on ``[k B, ..]`` rows (first axis)
reads them as ``[B, k, ..]``; a grouped dense layer on ``[G, k B, d]`` as
``[G, B, k, d]``.
"""
from __future__ import annotations

import dataclasses

from passes import ir


def unflatten_rows(groups, rows) -> dict:
    """``groups`` (``(kind, keys) -> [(pattern, roles, Use)]``) with each use
    whose input ``[k B, ..]`` holds the examples' rows on its first axis
    (``rows``, from ``example_rows``) reading them as ``[B, k, ..]``: a dense
    use its ``input_shape`` (the dense kind's operands lay ``a`` and ``g``
    out by it); a scale-and-shift use (a layer or group norm on rows, a
    shift alone on them) each recorded shape that leads with ``k B``, its
    input, output and operand shapes (its rule sums over the ``k`` rows as
    over any axis its scale broadcasts along)."""
    out = {}
    for key, items in groups.items():
        out[key] = []
        for pattern, roles, use in items:
            source = ir.split_tensor(use.inputs[0] if use.inputs else use.output)[0]
            r = rows.get(source)
            if key[0] == "grouped_dense":
                use = dataclasses.replace(use, attrs=_grouped_attrs(use.attrs, r))
            elif r is not None and r.axis == 0 and key[0] in _UNFLATTEN:
                use = dataclasses.replace(use, attrs=_UNFLATTEN[key[0]](use.attrs, r))
            out[key].append((pattern, roles, use))
    return out


def _split(shape, r):
    """``shape`` read as ``[B, k, ..]`` where it leads with ``k B``."""
    if shape and shape[0] == r.batch * r.per_example:
        return (r.batch, r.per_example, *shape[1:])
    return shape


def _dense_attrs(attrs, r):
    if not attrs.get("input_shape") or "stacked_rows" in attrs:
        return attrs
    return {**attrs, "input_shape": _split(attrs["input_shape"], r)}


def _scale_shift_attrs(attrs, r):
    out = {**attrs, **{k: _split(attrs.get(k), r) for k in ("input_shape", "output_shape")}}
    out["operand_shapes"] = tuple(_split(s, r) for s in attrs.get("operand_shapes") or ())
    return out


def _grouped_attrs(attrs, r):
    """A grouped dense use (``passes.patterns_grouped``) reads its input and
    output ``[G, k B, d]`` as ``[G, B, k, d]``; without the examples' rows
    on that axis it is unsupported."""
    shapes = [attrs.get("input_shape"), attrs.get("output_shape")]
    if r is None or r.axis != 1 or any(not s or len(s) != 3 for s in shapes):
        return {**attrs, "unsupported": "a grouped dense input [G, N, d] whose rows N do "
                "not hold the examples' rows in groups"}
    split = lambda s: (s[0], r.batch, r.per_example, s[2])  # noqa: E731
    return {**attrs, "input_shape": split(shapes[0]), "output_shape": split(shapes[1])}


_UNFLATTEN = {"dense": _dense_attrs, "scale_and_shift": _scale_shift_attrs}
