"""Trace-time invariants of the runtime's results: a shape no rule promised
is a one-line ``KfacGraphError``, never a wrong tensor.

- every per-example gradient is ``[B, *variable.shape]`` in the variable's
  dtype (``to_variable_shape``: a rule may give the op's kernel shape, which
  differs from the variable's only by unit axes, as Conv1D's
  ``[1, k, cin, cout]`` vs ``[k, cin, cout]``; under mixed precision the
  operands are cast to the variables' dtype first, ``taps.in_variable_dtype``);
- every per-example norm is ``[B]`` (``batch_vector``);
- every tensor a layer's Fisher block reads has the batch first
  (``batch_leading``), and every factor's rows the factor's width
  (``check_rows``, from ``fisher.factors_base``).

``B`` is the registration's batch, ``LayerTaps.batch_size``. A rule that
meets a layer form it does not know (a convolution applied to a
space-to-batch view whose phases are put back without BatchToSpaceND, whose
batch axis is ``block * B``; a grouped convolution; an embedding table read
without a batch axis) gives other shapes, and these checks say so, naming
the layer, its kind and its op.

Static shapes are compared while tracing. A batch known only at run time is
checked in the graph: an assertion whose failure is an
``InvalidArgumentError`` with the same line (XLA drops assertions), and a
reshape to ``[B, ...]``, which fails when the element counts differ (under
XLA at compile time, where every shape is static).
"""
from __future__ import annotations

import tensorflow as tf

from passes.errors import KfacGraphError

UNSUPPORTED = "this layer form is not supported"


class FactorShapeError(KfacGraphError):
    """A factor was given rows of another width than its own (the estimator
    adds the layer to the message)."""


def where(layer, use: int = 0) -> str:
    """``layer NAME (KIND, op OP)`` for messages."""
    ops = layer.ops[use] if use < len(layer.ops) else ()
    op = ops[0] if ops else (layer.outputs[use] if use < len(layer.outputs) else "?")
    return f"layer {layer.name} ({layer.kind}, op {op})"


def variable_name(variable) -> str:
    name = getattr(variable, "path", None) or getattr(variable, "name", "?")
    return str(name).removesuffix(":0")


def static_batch(batch) -> int | None:
    """``batch`` as a Python int when known while tracing, else None."""
    if isinstance(batch, int):
        return batch
    value = tf.get_static_value(batch)
    return None if value is None else int(value)


def _axis(n: int, b: int | None) -> str:
    if b and n != b and n % b == 0:
        return f"{n // b}B={n}"
    return str(n)


def _dims(shape) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def batch_leading(t: tf.Tensor, batch, context: str, what: str) -> tf.Tensor:
    """``t``, checked to have the batch as its leading axis."""
    t = tf.convert_to_tensor(t)
    b = static_batch(batch)
    if t.shape.rank == 0:
        raise KfacGraphError(f"{context}: {what} has no batch axis (a scalar), expected "
                             f"the batch {b if b is not None else 'B'} first; {UNSUPPORTED}")
    n = t.shape[0] if t.shape.rank is not None else None
    if n is not None and b is not None:
        if n != b:
            raise KfacGraphError(f"{context}: {what} has leading axis {_axis(n, b)}, "
                                 f"expected the batch {b}; {UNSUPPORTED}")
        return t
    message = f"{context}: {what} does not have the batch as its leading axis; {UNSUPPORTED}"
    check = tf.debugging.Assert(
        tf.equal(tf.shape(t, out_type=tf.int64)[0], tf.cast(batch, tf.int64)), [message])
    with tf.control_dependencies([check]):
        return tf.identity(t)


def _without_units(shape) -> tuple:
    return tuple(d for d in shape if d != 1)


def to_variable_shape(g: tf.Tensor, variable, batch, context: str) -> tf.Tensor:
    """A rule's per-example gradient ``[B, *op_shape]`` as ``[B, *variable.shape]``:
    only unit axes may differ between the op's shape and the variable's; the
    leading axis must be the batch; the dtype must be the variable's."""
    target = tuple(int(d) for d in variable.shape)
    what = f"per-example gradient of {variable_name(variable)}"
    g = tf.convert_to_tensor(g)
    if g.dtype != tf.as_dtype(variable.dtype):
        raise KfacGraphError(f"{context}: {what} has dtype {g.dtype.name}, expected the "
                             f"variable's {tf.as_dtype(variable.dtype).name}; {UNSUPPORTED}")
    if g.shape.rank is not None:
        if g.shape.rank == 0:
            raise KfacGraphError(f"{context}: {what} is a scalar, expected [B, *{list(target)}]; "
                                 f"{UNSUPPORTED}")
        got = tuple(g.shape.as_list()[1:])
        if None not in got and _without_units(got) != _without_units(target):
            raise KfacGraphError(f"{context}: {what} has shape [B, {', '.join(map(str, got))}]"
                                 f", expected [B, {', '.join(map(str, target))}]; {UNSUPPORTED}")
    g = batch_leading(g, batch, context, what)
    b = static_batch(batch)
    if b is not None and g.shape.as_list() == [b, *target]:
        return g
    return tf.reshape(g, [b if b is not None else batch, *target])


def batch_vector(n: tf.Tensor, batch, context: str, what: str = "per-example norm") -> tf.Tensor:
    """``n`` checked to be ``[B]``."""
    n = tf.convert_to_tensor(n)
    if n.shape.rank is not None and n.shape.rank != 1:
        raise KfacGraphError(f"{context}: {what} has shape {_dims(n.shape.as_list())}, "
                             f"expected [B]; {UNSUPPORTED}")
    n = batch_leading(n, batch, context, what)
    b = static_batch(batch)
    if b is not None and n.shape.as_list() == [b]:
        return n
    return tf.reshape(n, [b if b is not None else batch])


def check_rows(rows: tf.Tensor, width: int, groups, name: str) -> None:
    """Raises ``FactorShapeError`` unless ``rows`` are ``[N, width]`` (or
    ``[N, groups, width]`` for a grouped factor)."""
    shape = rows.shape
    rank = 2 if groups is None else 3
    if shape.rank is None:
        return
    expected = [None, width] if groups is None else [None, int(groups), width]
    ok = shape.rank == rank and all(e is None or d is None or d == e
                                     for d, e in zip(shape.as_list(), expected))
    if not ok:
        want = f"[N, {width}]" if groups is None else f"[N, {groups}, {width}]"
        raise FactorShapeError(f"factor {name} got rows {_dims(shape.as_list())}, expected {want}")
