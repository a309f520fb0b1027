"""Arithmetic on parameter vectors: lists of tensors aligned with the
registration's variables."""
from __future__ import annotations

import tensorflow as tf


class _Totals:
    """Sums of whole tensors whose axes constants are shared per rank (one
    traced constant per rank instead of one per sum)."""

    def __init__(self):
        self._axes = {}

    def __call__(self, t):
        rank = t.shape.rank
        if rank is None:
            return tf.reduce_sum(t)
        if rank == 0:
            return t
        if rank not in self._axes:
            self._axes[rank] = tf.constant(list(range(rank)), tf.int32)
        return tf.raw_ops.Sum(input=t, axis=self._axes[rank])


def dot(xs, ys) -> tf.Tensor:
    """``sum_k <x_k, y_k>`` (in the first tensor's dtype)."""
    dtype, total = xs[0].dtype, _Totals()
    return tf.add_n([total(tf.cast(x, dtype) * tf.cast(y, dtype)) for x, y in zip(xs, ys)])


def scale(c, xs) -> list:
    return [tf.cast(c, x.dtype) * x for x in xs]


def axpy(a, xs, ys) -> list:
    """``a * xs + ys``."""
    return [tf.cast(a, x.dtype) * x + y for x, y in zip(xs, ys)]


def combine(a, xs, b, ys) -> list:
    """``a * xs + b * ys``."""
    return [tf.cast(a, x.dtype) * x + tf.cast(b, y.dtype) * y for x, y in zip(xs, ys)]


def all_finite(tensors) -> tf.Tensor:
    """True when every entry of every floating tensor is finite (True for none).

    Checked on the tensors' sums, one per tensor and read in place: a
    non-finite entry makes its sum non-finite (concatenating the tensors
    for one elementwise check would copy them all). A sum that overflows,
    possible only with entries near the dtype's largest value, counts as
    non-finite too; narrower floats than 32 bits are summed in float32.
    A tensor passed twice is checked once, and the sums share one axes
    constant per rank, so the check adds about one operation per tensor
    to a traced graph."""
    seen, total, by_dtype = set(), _Totals(), {}
    for t in tensors:
        t = tf.convert_to_tensor(t)
        if not t.dtype.is_floating or t.ref() in seen:
            continue
        seen.add(t.ref())
        if t.dtype.size < 4:
            t = tf.cast(t, tf.float32)
        by_dtype.setdefault(t.dtype, []).append(total(t))
    if not by_dtype:
        return tf.constant(True)
    flags = [tf.reduce_all(tf.math.is_finite(tf.stack(group))) for group in by_dtype.values()]
    return flags[0] if len(flags) == 1 else tf.reduce_all(tf.stack(flags))
