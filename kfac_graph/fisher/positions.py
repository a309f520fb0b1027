"""Expand and reduce: two Kronecker factors for a layer applied at several
positions per example (Eschenhagen et al., NeurIPS 2023, "Kronecker-Factored
Approximate Curvature for Modern Neural Network Architectures").

A layer whose weights example b applies at R_b = sum_u T_u positions (the
middle axes of a dense layer's input `[B, ..., d_in]`, a convolution's
output locations, and every use of the weights) has, per example, the
gradient sum_r a_{b,r} g_{b,r}^T.  With `a` the input rows (plus the
homogeneous 1 when there is a bias) and `g` the output-gradient rows:

- "expand" treats every position as another example:

      A = (1/(B R)) sum_{b,r} a_{b,r} a_{b,r}^T,
      G = (1/(B R)) sum_{b,r} g_{b,r} g_{b,r}^T,    F ~= R (A (x) G),

  the paper's K-FAC-expand, `[1/(N R) sum a a^T] (x) [sum g g^T]`, divided
  by N (its Fisher is a sum over the N = B examples, ours their mean), and
  the KFC of Grosse & Martens for convolutions;

- "reduce" averages the inputs and sums the output gradients over the
  positions of one example before the outer products:

      abar_b = (1/R) sum_r a_{b,r},      gsum_b = sum_r g_{b,r},
      A = (1/B) sum_b abar_b abar_b^T,   G = (1/B) sum_b gsum_b gsum_b^T,
      F ~= A (x) G   (replica count R = 1, so the damping is not divided by R),

  the paper's K-FAC-reduce, `[1/(N R^2) sum_n ahat_n ahat_n^T] (x)
  [sum_n ghat_n ghat_n^T]` with `ahat, ghat` the sums over positions,
  divided by N.  The homogeneous coordinate averages to 1.

With one position (R = 1) the two are the same.  For one example whose
inputs do not vary over its positions (a_{b,r} = a_b) its gradient is
abar_b gsum_b^T and "reduce" is its exact Fisher.  "expand" drops the
cross terms between positions, which suits positions that act as examples
of their own (a per-token loss, the paper's "expand setting"); "reduce"
keeps them summed, which suits a model that pools over positions (its
"reduce setting").  Output-gradient sources (samples, Fisher-square-root
columns) are reduced one by one and then add up, as in expand.

The rows of every kind (`kfac_graph.layers`: `input_rows`, `output_rows`)
are batch-major, `[B * T, (G,) d]`, so a use's rows are `[B, T, (G,) d]`
after a reshape.
"""

import tensorflow as tf

EXPAND = "expand"
REDUCE = "reduce"
MODES = (EXPAND, REDUCE)


def check_mode(positions, owner):
    """``positions`` if it is one of ``MODES``, else a one-line ValueError."""
    if positions not in MODES:
        raise ValueError(f"{owner}: positions must be one of {MODES}, got {positions!r}")
    return positions


def batch_size(tensor):
    """The leading (batch) axis of a layer operand, as a scalar tensor."""
    return tf.shape(tensor)[0]


def per_example_sums(rows, batch):
    """``(sum_t rows[b, t], T)``: rows `[B*T, (G,) d]` summed over each
    example's positions, `[B, (G,) d]`, and the position count T."""
    per_example = tf.reshape(rows, tf.concat([[batch, -1], tf.shape(rows)[1:]], 0))
    per_example = tf.ensure_shape(per_example, [None, None] + rows.shape[1:].as_list())
    return tf.reduce_sum(per_example, axis=1), tf.shape(per_example)[1]


def reduce_uses(rows_per_use, batches, mean):
    """One row per example from the rows of every use: the sum over all
    positions of all uses, divided by their count R when ``mean`` (inputs)
    and not (output gradients)."""
    sums, counts = zip(*[per_example_sums(r, b) for r, b in zip(rows_per_use, batches)])
    total = tf.add_n(list(sums))
    if not mean:
        return total
    return total / tf.cast(tf.add_n(list(counts)), total.dtype)
