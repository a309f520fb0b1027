"""Normalising the `uses` argument of every rule.

A layer whose weights are applied once is given as one pair `(a, g)`; weights
applied several times (tied weights, an unrolled RNN) as a sequence of pairs,
one per application. `g` is always the gradient of the *sum* over examples of
the per-example losses with respect to that application's pre-activation
output, so `g[i]` depends on example `i` only, and the per-example gradient of
the weights is the sum over uses of each use's contribution.
"""

import tensorflow as tf


def as_pairs(uses):
    """A list of `(a, g)` pairs from one pair or a sequence of pairs, leaving
    the elements as they are (`g` may be a list over sources)."""
    uses = list(uses)
    if len(uses) == 2 and not isinstance(uses[0], (tuple, list)):
        uses = [uses]
    out = []
    for use in uses:
        if not isinstance(use, (tuple, list)) or len(use) != 2:
            raise ValueError("expected (a, g) or a list of (a, g) pairs")
        out.append(tuple(use))
    if not out:
        raise ValueError("a layer needs at least one use")
    return out


def as_uses(uses):
    """Returns a tuple of `(a, g)` tensor pairs from one pair or a sequence."""
    return tuple((tf.convert_to_tensor(a), tf.convert_to_tensor(g)) for a, g in as_pairs(uses))


def batch_size(t):
    """The batch size of `t`: a Python int when static, else a scalar tensor."""
    return t.shape[0] if t.shape[0] is not None else tf.shape(t)[0]


def add_all(tensors):
    """Sum of a non-empty list of same-shaped tensors (no op for one)."""
    return tensors[0] if len(tensors) == 1 else tf.add_n(list(tensors))
