"""Per-token weights of a loss, read at run time from the graph.

The loss pass (``passes/match_loss.py``) checks that the loss is linear in
its terms, ``L = sum_k c_k * terms_k``, where ``c_k`` holds only constants
and data: per-token weights (a padding mask, Keras's ``sample_weight`` or
``ignore_class``), the batch reduction and a data divisor such as the
``sum(w)`` of a masked mean. So ``c_k = dL/dterms_k``, one backward pass
from the loss to its terms with the data held fixed; a divisor computed
from the whole batch is a batch statistic, treated as the constant it is
for the batch.

With ``LossSpec``'s convention ``L = scale * (1/B) * sum_i l_i`` (drop
``1/B`` for a sum) and the pass's ``terms_coefficient`` ``k`` (``L = k *
(1/B) * sum(terms)`` unweighted), token ``t`` of example ``i`` weighs

    w_it = c_it * (B for a mean, else 1) / k,

so that ``l_i = sum_t w_it * -log p(y_it | z_it)``: ``w = 1`` for an
unweighted mean, ``mask / sum(mask)`` for the masked mean (whose reduction
is a sum: the per-example terms, each divided by the batch's ``sum(w)``,
sum to the loss exactly, and so do the per-example gradients). The Fisher
of the weighted loss is ``(1/B) sum_i sum_t w_it J_it^T F_it J_it``: a
token's cotangent is scaled by ``sqrt(w_it)`` (weights must not be
negative), so a masked token contributes nothing.
"""
from __future__ import annotations

import tensorflow as tf
from kfac_graph.layers.scalars import as_dtype


def read(reg, loss, terms, model_output, batch):
    """``(w, per-example terms)`` of a weighted loss: ``w`` laid out like the
    Fisher's tokens (``z``'s shape without its class axis for a categorical
    loss, ``z``'s shape for the elementwise kinds; None without a model
    output), and the loss terms weighted by ``w * k`` (still shaped like
    ``terms``), whose per-example sums are the examples' own loss terms."""
    c, weighted_terms = _derivative(reg, loss, terms, batch)
    if model_output is None or reg.loss.kind == "ggn":  # (its Hessian holds the weights)
        return None, weighted_terms
    w = c / as_dtype(reg.per_example_coefficient, c.dtype)
    return fisher_layout(w, reg.loss.kind, model_output), weighted_terms


def size_scale(sizes, tensors, batch, dtype):
    """``s``, the product over ``sizes`` (``passes.loss_sizes.SizeDivisor``)
    of ``1 / size``, each size read from ``tensors`` (names to the imported
    graph's tensors) and divided by the batch ``B`` where it is what makes
    the reduction a mean (``B T / B``): the ``1/T`` of a mean over positions
    known at run time only, which the tokens' weights ``w_it = s m_it`` hold."""
    s = tf.ones([], dtype)
    for size in sizes:
        t = tensors[size.tensor]
        value = (tf.cast(t, dtype) if size.axes is None else
                 tf.cast(tf.reduce_prod(tf.gather(tf.shape(t), list(size.axes))), dtype))
        if size.over_batch:
            value = value / tf.cast(batch, dtype)
        s = s / tf.reshape(value, [])
    return s


def own_terms(reg, loss, terms, batch):
    """A loss's terms weighted by ``k dL/dterms`` (``k``: the batch for a mean
    loss, else 1), whose per-example sums are the examples' own shares: the
    loss is linear in its terms, so the derivative holds every weight,
    divisor and coefficient above them (an extra term's, ``taps``)."""
    return _derivative(reg, loss, terms, batch)[1]


def head_weights(reg, loss, terms, batch):
    """``k dL/dterms`` (``k`` as for ``own_terms``), held constant: each of a
    head's terms' weight in its example's own loss ``l_i`` (a joined
    categorical head's block is its Fisher so weighted, ``fisher.ggn_blocks``)."""
    return _derivative(reg, loss, terms, batch)[0]


def _derivative(reg, loss, terms, batch):
    """``(k dL/dterms, terms * k dL/dterms)``, held constant."""
    c = tf.gradients(loss, terms)[0]
    if c is None:
        c = tf.zeros_like(terms)
    c = tf.stop_gradient(tf.convert_to_tensor(c))
    per_batch = tf.cast(batch, c.dtype) if reg.loss.reduction == "mean" else tf.ones([], c.dtype)
    return c * per_batch, terms * (c * per_batch)


def fisher_layout(w, kind, z):
    """``w`` (shaped like the loss terms, maybe flattened ``[B*T]``) as
    ``z``'s tokens: ``[B, T]`` for categorical (terms that keep the class
    axis, ``y * log_softmax(z)``, carry one weight per token along it: the
    pass refuses weights that differ across classes), ``z``'s shape else."""
    shape = tf.shape(z)
    if kind != "categorical":
        return tf.reshape(w, shape)
    if w.shape.rank is not None and w.shape.rank == z.shape.rank and w.shape.rank > 1 \
            and w.shape[-1] == z.shape[-1]:
        return tf.reshape(w, shape)[..., 0]
    return tf.reshape(w, shape[:-1])


def per_output(w, kind, t):
    """``w`` broadcast against a tensor ``t`` shaped like ``z``."""
    w = tf.cast(w, t.dtype)
    return w[..., None] if kind == "categorical" else w


def scaled(w, kind, t):
    """``sqrt(w) * t``: a cotangent at ``z`` (``[..., K]``) weighted so that its
    outer products weigh each token by ``w``."""
    return t if w is None else tf.sqrt(per_output(w, kind, t)) * t
