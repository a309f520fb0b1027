"""Uses that read a part of a variable: a static slice of it (a box, which
the pass records per variable as ``use_attrs[u]["parts"]``, see
``passes/variable_parts.py``).

Math: a use that applies the box ``V[b:e]`` of a variable ``V`` is exactly
a use of the whole ``V`` whose operands are zero outside the box. For a
dense kernel, ``s = a V[r0:r1, c0:c1]`` gives ``a^T g`` in rows ``r0:r1``,
columns ``c0:c1`` of ``dV`` and zeros elsewhere, which is
``pad(a)^T pad(g)`` with ``a`` zero-padded to ``d_in`` and ``g`` to
``d_out``; for a scale or shift, ``xhat * V[b:e] (+ ...)`` gives
``pad(xhat * g)`` over the whole variable. So the kinds' ``operands`` pad
their tensors here, and their rules, factors and blocks see uses of the
whole variable. The cross terms are right too: two uses of disjoint boxes
have orthogonal padded operands.
"""
from __future__ import annotations

import tensorflow as tf


def part(layer, use: int, variable: int):
    """The box (``{"begin", "end"}``) of ``layer.variables[variable]`` that
    use ``use`` reads, or None when it reads the whole variable."""
    parts = layer.use_attrs[use].get("parts") or ()
    return parts[variable] if variable < len(parts) else None


def pad_axis(t: tf.Tensor, box, axis: int, variable_axis: int, size: int) -> tf.Tensor:
    """``t`` zero-padded along ``axis`` from the box's extent on the
    variable's axis ``variable_axis`` to the whole ``size``."""
    if box is None:
        return t
    begin, end = box["begin"][variable_axis], box["end"][variable_axis]
    paddings = [[0, 0]] * t.shape.rank
    paddings[axis % t.shape.rank] = [begin, size - end]
    return tf.pad(t, paddings)


def box_shape(box) -> tuple:
    """The shape of the box (the variable's rank, 1 on an axis it takes one
    entry of)."""
    return tuple(e - b for b, e in zip(box["begin"], box["end"]))


def pad_box(t: tf.Tensor, box, shape) -> tf.Tensor:
    """``t [..., *box shape]`` as ``[..., *shape]``, zeros outside the box."""
    if box is None:
        return t
    lead = t.shape.rank - len(shape)
    return tf.pad(t, [[0, 0]] * lead + [[b, int(d) - e] for b, e, d in
                                        zip(box["begin"], box["end"], shape)])
