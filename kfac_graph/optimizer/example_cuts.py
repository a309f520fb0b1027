"""A loss's arguments cut to some of their examples (the quadratic model's
leading examples, a spread covariance update's slice).

The batch axis is the leading axis of the first tensor argument: every
tensor argument whose leading axis has that size (known when tracing, or
unknown alike) is cut; other arguments are kept as they are.
"""
from __future__ import annotations

import tensorflow as tf

from passes.errors import KfacGraphError


def batch_tensor(args, owner: str):
    """The first tensor argument with a leading axis (the batch axis's owner);
    none: a one-line ``KfacGraphError`` naming ``owner``."""
    flat = [tf.convert_to_tensor(a) if isinstance(a, (tf.Tensor, tf.Variable)) else a
            for a in tf.nest.flatten(args)]
    tensors = [a for a in flat if isinstance(a, tf.Tensor) and a.shape.rank]
    if not tensors:
        raise KfacGraphError(f"{owner}: the loss's arguments have no batch axis")
    return tensors[0]


def cut_examples(args, owner: str, make_cut):
    """``args`` with each batch tensor ``a`` replaced by ``cut(a)``, where
    ``cut = make_cut(batch, first)``: ``batch`` the static batch size (None
    if unknown when tracing) and ``first`` the first tensor argument. No
    tensor with a leading axis: a one-line ``KfacGraphError`` naming ``owner``."""
    first = batch_tensor(args, owner)
    flat = [tf.convert_to_tensor(a) if isinstance(a, (tf.Tensor, tf.Variable)) else a
            for a in tf.nest.flatten(args)]
    batch = first.shape[0]
    cut = make_cut(batch, first)

    def maybe_cut(a):
        if isinstance(a, tf.Tensor) and a.shape.rank and a.shape[0] == batch:
            return cut(a)
        return a

    return tf.nest.pack_sequence_as(args, [maybe_cut(a) for a in flat])
