"""Arithmetic on parameter vectors: lists of tensors aligned with the
registration's variables."""
from __future__ import annotations

import tensorflow as tf


def dot(xs, ys) -> tf.Tensor:
    """``sum_k <x_k, y_k>`` (in the first tensor's dtype)."""
    dtype = xs[0].dtype
    return tf.add_n([tf.reduce_sum(tf.cast(x, dtype) * tf.cast(y, dtype)) for x, y in zip(xs, ys)])


def scale(c, xs) -> list:
    return [tf.cast(c, x.dtype) * x for x in xs]


def axpy(a, xs, ys) -> list:
    """``a * xs + ys``."""
    return [tf.cast(a, x.dtype) * x + y for x, y in zip(xs, ys)]


def combine(a, xs, b, ys) -> list:
    """``a * xs + b * ys``."""
    return [tf.cast(a, x.dtype) * x + tf.cast(b, y.dtype) * y for x, y in zip(xs, ys)]


def all_finite(tensors) -> tf.Tensor:
    """True when every entry of every tensor is finite (True for none).

    One check per dtype over the tensors flattened and concatenated (a
    per-tensor check costs two graph ops each)."""
    by_dtype = {}
    for t in tensors:
        t = tf.convert_to_tensor(t)
        if t.dtype.is_floating or t.dtype.is_complex:
            by_dtype.setdefault(t.dtype, []).append(tf.reshape(t, [-1]))
    flags = [tf.reduce_all(tf.math.is_finite(ts[0] if len(ts) == 1 else tf.concat(ts, 0)))
             for ts in by_dtype.values()]
    if not flags:
        return tf.constant(True)
    return flags[0] if len(flags) == 1 else tf.reduce_all(tf.stack(flags))
