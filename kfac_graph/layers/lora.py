"""The operands of a low-rank adapter's A and B, each a dense layer.

An adapter's kernel (``passes/lora.py``) is ``K = W0 + s A B``, with
``A [*lead, r]``, ``B [r, n]`` and ``K [*lead, n]`` contracted with the
activation on its first k axes: ``d_in = prod(lead[:k])`` and
``L = prod(lead[k:])`` output axes before the last. With the kernel's
operands ``x [B, P, d_in]`` and ``g [B, P, L n]`` (P positions) the use is

    y[p, l, :] = x[p] W0[:, l, :] + s (x[p] A[:, l, :]) B,

two dense layers in a row, exactly:

- A (``role "a"``): input ``x [B, P, d_in]``, output gradient
  ``s g[p, l] B^T`` laid out ``[B, P, L r]`` (A's own multi-axis form);
- B (``role "b"``): input ``s x[p] A[:, l, :]``, ``[B, P L, r]``, and output
  gradient ``g [B, P L, n]``: every (position, output axis) a position.

So ``dA_i = s sum_p x_ip^T (g_ip B^T)`` and ``dB_i = s sum_{p,l} (x_ip A_l)^T
g_ipl``: the dense rule gives them without forming ``K``'s per-example
gradient. An op that permutes the kernel before applying it, keeping its
last axis last (``info["perm"]``), applies ``A`` permuted the same way: A's
layer has that ``kernel_perm``, and B's input reads A permuted. A table
looked up by ids (``K[ids] = W0[ids] + s A[ids] B``): A is an embedding
layer on the ids whose output gradient is ``s g B^T``, B a dense layer on
``s A[ids]`` (``lookup_operands``).
"""
import math

import tensorflow as tf

from kfac_graph.layers import uses as uses_lib
from kfac_graph.layers.scalars import as_dtype


def lookup_operands(info, ids, grads, other):
    """A looked-up table's adapter (``info["lookup"]``): for A (an
    embedding layer) the ids and ``s g B^T``; for B (a dense layer) the
    rows ``s A[ids]`` and ``g``, each ``[B, T, ..]`` with every looked-up
    position a position; ``other`` the read of B (for A) or of A (for B)."""
    scale, r, n = info["scale"], info["rank"], info["kernel_shape"][-1]
    if info["role"] == "a":
        b = tf.reshape(other, [r, n])
        return ids, [scale * tf.einsum("...n,rn->...r", g, b) for g in grads]
    rows = tf.gather(tf.reshape(other, [-1, r]), ids)
    batch = uses_lib.batch_size(rows)
    return (scale * tf.reshape(rows, [batch, -1, r]),
            [tf.reshape(g, [batch, -1, n]) for g in grads])


def operands(info, a, grads, other):
    """``(a, [g, ...])`` of A or B (``info["role"]``) from the kernel's
    operands ``a [B, P, d_in]``, ``grads`` (each ``[B, P, L n]``) and
    ``other``, the read of B (for A) or of A (for B)."""
    shape, k, r = info["kernel_shape"], info["kernel_in_axes"], info["rank"]
    d_in, outputs, n = math.prod(shape[:k]), math.prod(shape[k:-1]), shape[-1]
    batch = uses_lib.batch_size(a)
    a = tf.reshape(a, [batch, -1, d_in])
    grads = [tf.reshape(g, [batch, -1, outputs, n]) for g in grads]
    scale = as_dtype(info["scale"], a.dtype)
    if info["role"] == "a":
        b = tf.reshape(other, [r, n])
        return a, [tf.reshape(scale * tf.einsum("bpln,rn->bplr", g, b), [batch, -1, outputs * r])
                   for g in grads]
    other = tf.reshape(other, info["a_shape"])
    if info.get("perm"):  # the op permutes the kernel, and so A (its last axis kept)
        other = tf.transpose(other, info["perm"])
    a_mat = tf.reshape(other, [d_in, outputs * r])
    xa = scale * tf.reshape(tf.einsum("bpd,dm->bpm", a, a_mat), [batch, -1, r])
    return xa, [tf.reshape(g, [batch, -1, n]) for g in grads]
