"""Static values: evaluate the small integer subgraphs a loop's trip count
comes from (counters, limits, shapes), in numpy, while tracing.

Contract: ``StaticEvaluator(known).value(tensor)`` is the numpy value of a
``tf.Tensor`` of an imported graph (or a function body's ``FuncGraph``), or
None when it depends on anything not known when tracing: a placeholder
absent from ``known`` (a dict tensor name -> value), a variable, an op not
in the table below. The table is data: op type -> a numpy function of the
op and its inputs' values. ``Shape`` of a partly known shape gives an object
array with ``None`` for the unknown axes, which only ``StridedSlice``,
``GatherV2``, ``Pack``, ``ConcatV2`` and the identities pass on
(``tf.shape(x)[1]`` is static when axis 1 is); ``partial(tensor)`` returns
such a value (a reshape's target whose batch is unknown). Values are
memoised per evaluator.

``strided_slice_index`` turns a ``StridedSlice``'s constant operands into a
numpy index (also used for slices of variables, ``passes.variable_parts``).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import tensorflow as tf

_MAX_ELEMENTS = 1024  # larger values are never needed for a trip count


def strided_slice_index(begin, end, strides, begin_mask=0, end_mask=0, shrink_axis_mask=0,
                        ellipsis_mask=0, new_axis_mask=0) -> tuple | None:
    """The numpy index a ``StridedSlice`` applies, or None for the forms
    not needed here (an ellipsis or a new axis)."""
    if ellipsis_mask or new_axis_mask:
        return None
    index = []
    for i, (b, e, s) in enumerate(zip(begin, end, strides)):
        bit = 1 << i
        if shrink_axis_mask & bit:
            index.append(int(b))
        else:
            index.append(slice(None if begin_mask & bit else int(b),
                               None if end_mask & bit else int(e), int(s)))
    return tuple(index)


def _cast(op, x):
    return np.asarray(x).astype(op.get_attr("DstT").as_numpy_dtype)


def _shape(op, x):
    dims = op.inputs[0].shape
    if dims.rank is None:
        return None
    if dims.is_fully_defined():
        return np.array(dims.as_list(), op.get_attr("out_type").as_numpy_dtype)
    return np.array(dims.as_list(), dtype=object)


def _strided_slice(op, x, begin, end, strides):
    index = strided_slice_index(
        begin, end, strides, *(op.get_attr(k) for k in (
            "begin_mask", "end_mask", "shrink_axis_mask", "ellipsis_mask", "new_axis_mask")))
    return None if index is None else np.asarray(x)[index]


def _reduce(fn):
    def reduce(op, x, axes):
        axes = tuple(int(a) for a in np.atleast_1d(axes))
        return fn(x, axis=axes, keepdims=op.get_attr("keep_dims"))
    return reduce


def _binary(fn):
    return lambda op, x, y: fn(x, y)


def _unary(fn):
    return lambda op, x: fn(x)


def _first(op, x, *rest):
    return x


# op type -> numpy function of (op, *input values) (and Const, Shape, Size,
# Rank, read from the graph); partial shapes (object arrays holding None)
# reach only the ops in _PARTIAL. Control inputs never change a value.
TABLE: Mapping[str, Callable[..., Any]] = {
    "Identity": _first, "Snapshot": _first, "StopGradient": _first,
    "Cast": _cast,
    "StridedSlice": _strided_slice,
    "Pack": lambda op, *xs: np.stack(xs, axis=op.get_attr("axis")),
    "Reshape": lambda op, x, shape: np.reshape(x, shape),
    "Squeeze": lambda op, x: np.squeeze(x, axis=tuple(op.get_attr("squeeze_dims")) or None),
    "SelectV2": lambda op, c, x, y: np.where(c, x, y),
    "Select": lambda op, c, x, y: np.where(c, x, y),
    "Range": lambda op, start, limit, delta: np.arange(start, limit, delta),
    "GatherV2": lambda op, x, indices, axis: np.take(x, indices, axis=int(axis)),
    "ConcatV2": lambda op, *xs: np.concatenate(xs[:-1], axis=int(xs[-1])),
    **{k: _binary(f) for k, f in {
        "AddV2": np.add, "Add": np.add, "Sub": np.subtract, "Mul": np.multiply,
        "FloorDiv": np.floor_divide, "FloorMod": np.mod, "Maximum": np.maximum,
        "Minimum": np.minimum, "Less": np.less, "LessEqual": np.less_equal,
        "Greater": np.greater, "GreaterEqual": np.greater_equal, "Equal": np.equal,
        "NotEqual": np.not_equal, "LogicalAnd": np.logical_and,
        "LogicalOr": np.logical_or}.items()},
    **{k: _unary(f) for k, f in {"Neg": np.negative, "Abs": np.abs,
                                 "LogicalNot": np.logical_not}.items()},
    **{k: _reduce(f) for k, f in {"Max": np.max, "Min": np.min, "Sum": np.sum,
                                  "Prod": np.prod, "All": np.all, "Any": np.any}.items()},
}
_PARTIAL = frozenset({"Identity", "Snapshot", "StopGradient", "StridedSlice", "Pack",
                      "GatherV2", "ConcatV2"})


class StaticEvaluator:
    """Numpy values of tensors known when tracing (module docstring)."""

    def __init__(self, known: Mapping[str, Any] | None = None, shapes: bool = True):
        """``shapes``: whether ``Shape``, ``Size`` and ``Rank`` read static
        shapes (False: constants alone fold)."""
        self._memo: dict[str, Any] = {k: np.asarray(v) for k, v in (known or {}).items()}
        self._shapes = shapes

    def value(self, tensor: tf.Tensor):
        """``tensor``'s numpy value, or None when it is not static."""
        out = self._partial(tensor)
        return None if out is None or _has_unknown(out) else out

    def partial(self, tensor: tf.Tensor):
        """``tensor``'s value where only some of its elements are static (an
        object array, None for the others: ``concat([shape(x)[:2], [n]])``
        of an ``x`` whose batch is unknown), its value when all are, or None."""
        return self._partial(tensor)

    def _partial(self, tensor):
        name = tensor.name
        if name not in self._memo:
            self._memo[name] = None  # (a cycle, which a graph has not, reads as unknown)
            self._memo[name] = self._evaluate(tensor)
        return self._memo[name]

    def _evaluate(self, tensor):
        op = tensor.op
        if op.type == "Const":
            value = tf.make_ndarray(op.get_attr("value"))
            return value if value.size <= _MAX_ELEMENTS else None
        if op.type in ("Shape", "Size", "Rank"):
            return _shape_op(op) if self._shapes else None
        fn = TABLE.get(op.type)
        if fn is None or len(op.outputs) != 1:
            return None
        inputs = [self._partial(t) for t in op.inputs]
        if op.type == "Pack" and all(t.shape.rank == 0 for t in op.inputs):
            # a scalar not known: one unknown element (a batch-dependent size)
            inputs = [np.array(None, dtype=object) if x is None else x for x in inputs]
        if any(x is None for x in inputs):
            return None
        if op.type not in _PARTIAL and any(_has_unknown(x) for x in inputs):
            return None
        try:
            out = np.asarray(fn(op, *inputs))
        except (ValueError, TypeError, IndexError, ZeroDivisionError, tf.errors.OpError):
            return None
        if out.size > _MAX_ELEMENTS:
            return None
        if out.dtype == object:
            return out if _has_unknown(out) else out.astype(np.int64)
        dtype = tensor.dtype
        return out.astype(dtype.as_numpy_dtype) if dtype.is_numpy_compatible else out


def _shape_op(op):
    shape = op.inputs[0].shape
    if op.type == "Shape":
        return _shape(op, None)
    if shape.rank is None:
        return None
    if op.type == "Rank":
        return np.int32(shape.rank)
    return (np.array(shape.num_elements(), op.get_attr("out_type").as_numpy_dtype)
            if shape.is_fully_defined() else None)


def _has_unknown(x) -> bool:
    x = np.asarray(x)
    return x.dtype == object and any(v is None for v in x.reshape(-1))
