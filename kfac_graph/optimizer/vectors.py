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
    """True when every entry of every tensor is finite (True for none)."""
    flags = [tf.reduce_all(tf.math.is_finite(t)) for t in tensors
             if t.dtype.is_floating or t.dtype.is_complex]
    if not flags:
        return tf.constant(True)
    return tf.reduce_all(tf.stack(flags))
