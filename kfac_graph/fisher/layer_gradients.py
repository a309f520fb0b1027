"""Per-example parameter gradients rebuilt from layer inputs and output grads.

Each function returns `[B, n]`: example i's gradient of its own loss term,
flattened in the canonical order (each variable row-major, kernel/scale
first, then bias/shift), summed over positions / locations.  Multi-use
layers sum the per-use results (the weights' gradient is the sum over uses).

  dense:      dW_i = sum_t a_{i,t} g_{i,t}^T,   db_i = sum_t g_{i,t}
  conv:       dW_i = sum_t P_{i,t} g_{i,t}^T with P the input patches
  depthwise:  dW_i[k, c, m] = sum_t P_{i,t}[k, c] g_{i,t}[c, m]
  scale/shift: d scale_i = sum over broadcast axes of xhat_i * g_i,
               d shift_i = same of g_i
"""

import numpy as np
import tensorflow as tf


def _positions(x):
    """Reshapes `[B, ..., d]` to `[B, T, d]`."""
    shape = tf.shape(x)
    return tf.reshape(x, [shape[0], -1, x.shape[-1]])


def _flat(b, *parts):
    return tf.concat([tf.reshape(p, [b, -1]) for p in parts], axis=1)


def dense_example_grads(a, g, has_bias):
    """a `[B, ..., d_in]`, g `[B, ..., d_out]` -> `[B, n]`."""
    a3, g3 = _positions(a), _positions(g)
    b = tf.shape(a3)[0]
    parts = [tf.einsum("bti,bto->bio", a3, g3)]
    if has_bias:
        parts.append(tf.reduce_sum(g3, axis=1))
    return _flat(b, *parts)


def conv_example_grads(patches, g_loc, has_bias):
    """patches `[B, T, K]`, g_loc `[B, T, Cout]` -> `[B, n]`."""
    b = tf.shape(patches)[0]
    parts = [tf.einsum("btk,bto->bko", patches, g_loc)]
    if has_bias:
        parts.append(tf.reduce_sum(g_loc, axis=1))
    return _flat(b, *parts)


def depthwise_example_grads(patches, g_loc, channels, multiplier, has_bias):
    """patches `[B, T, k*C]` ((kh, kw, C) order), g_loc `[B, T, C*M]`."""
    shape = tf.shape(patches)
    p4 = tf.reshape(patches, [shape[0], shape[1], -1, channels])
    g4 = tf.reshape(g_loc, [shape[0], shape[1], channels, multiplier])
    parts = [tf.einsum("btkc,btcm->bkcm", p4, g4)]
    if has_bias:
        parts.append(tf.reduce_sum(g_loc, axis=1))
    return _flat(shape[0], *parts)


def broadcast_reduce_axes(x_rank, scale_shape):
    """Axes of a `[B, ...]` input summed to reach `scale_shape`, and its
    right-aligned shape.  `scale_shape` may include a leading batch 1."""
    s = list(scale_shape)
    if len(s) == x_rank:
        if s[0] != 1:
            raise ValueError(
                "scale_and_shift: a full-rank scale must have a leading 1 for the batch axis"
            )
        s = s[1:]
    if len(s) > x_rank - 1:
        raise ValueError("scale_and_shift: scale has more axes than the input")
    aligned = [1] * (x_rank - 1 - len(s)) + s
    return aligned


def scale_shift_example_grads(xhat, g, scale_shape, has_shift):
    """xhat, g `[B, ...]`; returns `[B, n]` for scale (then shift)."""
    aligned = broadcast_reduce_axes(len(xhat.shape), scale_shape)
    axes = [i + 1 for i, s in enumerate(aligned) if s == 1]
    b = tf.shape(xhat)[0]
    size = int(np.prod(scale_shape))

    def reduce(t):
        t = tf.reduce_sum(t, axis=axes, keepdims=True) if axes else t
        return tf.reshape(t, [b, size])

    parts = [reduce(xhat * g)]
    if has_shift:
        parts.append(reduce(g))
    return tf.concat(parts, axis=1)


def variable_example_grads(grads):
    """A list of per-example gradients `[B, *var.shape]` -> `[B, n]`."""
    b = tf.shape(grads[0])[0]
    return _flat(b, *grads)
