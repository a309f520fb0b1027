"""Squared-norm helpers shared by the rules, and the Gram-versus-materialise
cost rule.

For a layer whose per-example gradient is `G_i = sum_t a_{i,t} g_{i,t}^T`
(`t` runs over positions, and over uses, which is how cross terms between uses
are counted), the squared Frobenius norm has the Gram ("ghost norm") form

    ||G_i||^2 = sum_{t,t'} (a_{i,t} . a_{i,t'}) (g_{i,t} . g_{i,t'}).

Cost per example with `T` positions, `K` = d_in, `N` = d_out:
  Gram:          T^2 (K + N) multiply-adds, T^2 floats of memory;
  materialise:   T K N multiply-adds, K N floats of memory.
`gram_is_cheaper` picks Gram iff `T (K + N) < K N`. That flop rule also implies
the memory rule: it forces `T < K N / (K + N) <= min(K, N)`, so `T^2 < K N`.

A layer of G independent groups (a grouped or depthwise convolution: group j
maps `a_{t,j}` to `g_{t,j}`) has `||G_i||^2 = sum_j ||G_{i,j}||^2`, each term
in the form above; both costs scale by G, so the same rule holds with the
per-group widths.
"""

import tensorflow as tf


def gram_is_cheaper(positions, d_in, d_out):
    """True iff the Gram form costs fewer flops (hence less memory) than
    materialising `[d_in, d_out]` per example. Unknown `positions` -> False."""
    if positions is None:
        return False
    return positions * (d_in + d_out) < d_in * d_out


def gram_squared_norms(a, g):
    """`[B]`: `sum_{t,t'} (a_t . a_t')(g_t . g_t')` for `a [B,T,K]`, `g [B,T,N]`.

    With `T == 1` this is `|a|^2 |g|^2`, computed without matmuls.
    """
    if a.shape[1] == 1:
        return tf.reduce_sum(tf.square(a), axis=[1, 2]) * tf.reduce_sum(tf.square(g), axis=[1, 2])
    gram_a = tf.matmul(a, a, transpose_b=True)
    gram_g = tf.matmul(g, g, transpose_b=True)
    return tf.reduce_sum(gram_a * gram_g, axis=[1, 2])


def grouped_gram_squared_norms(a, g):
    """`[B]`: `sum_j sum_{t,t'} (a_{t,j} . a_{t',j})(g_{t,j} . g_{t',j})` for
    `a [B,T,G,K]`, `g [B,T,G,N]`."""
    gram_a = tf.einsum("btjk,bsjk->bjts", a, a)
    gram_g = tf.einsum("btjn,bsjn->bjts", g, g)
    return tf.reduce_sum(gram_a * gram_g, axis=[1, 2, 3])


def sum_of_squares(t):
    """`[B]`: the squared norm of each example's slice `t[i]`."""
    return tf.reduce_sum(tf.reshape(tf.square(t), [tf.shape(t)[0], -1]), axis=1)


def total_squared_norms(tensors):
    """`[B]`: squared norm of each example's gradient over several tensors."""
    parts = [sum_of_squares(t) for t in tensors]
    return parts[0] if len(parts) == 1 else tf.add_n(parts)
