"""Debiased exponential moving averages held in `tf.Variable`s.

With decay `d_t` applied at update `t` and batch estimate `x_t`:

    m_t = d_t m_{t-1} + (1 - d_t) x_t,      m_0 = 0
    w_t = d_t w_{t-1} + (1 - d_t),          w_0 = 0
    value_t = m_t / w_t

`w_t` is the total weight the zero initialisation failed to provide; for a
constant decay it is `1 - d^t` (the Adam-style bias correction).  So after
the first update the value equals that batch's estimate exactly, and in
general it is the normalised weighted average
`sum_s c_s x_s / sum_s c_s` with `c_s = (1 - d_s) prod_{r>s} d_r`.
Before any update the value is zero.

Under ``tf.distribute`` each replica keeps its own average of its own
batches (``raw`` is ``ON_READ`` with ``MEAN`` aggregation: written
locally, averaged when read in cross-replica context). The update is
linear in ``x`` and ``w_t`` depends on the decays alone (the same on every
replica; ``ONLY_FIRST_REPLICA``), so the mean over replicas of their
averages is exactly the average of the replicas' mean estimates: syncing
may wait until the value is read. Outside a strategy these are plain
variables.
"""

import tensorflow as tf


def replica_local(initial, name):
    """A variable every replica updates alike (so any replica's copy is the
    value): ``ON_READ`` with ``ONLY_FIRST_REPLICA`` aggregation, so that
    updates stay local and reads need no reduction."""
    return tf.Variable(initial, trainable=False, name=name,
                       synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


class DebiasedEMA(tf.Module):
    """A debiased moving average of a tensor of a fixed shape."""

    def __init__(self, shape, dtype=tf.float32, name=None):
        super().__init__(name=name)
        self.raw = tf.Variable(tf.zeros(shape, dtype), trainable=False, name="raw",
                               synchronization=tf.VariableSynchronization.ON_READ,
                               aggregation=tf.VariableAggregation.MEAN)
        self.weight = replica_local(tf.zeros([], dtype), name="weight")

    @property
    def dtype(self):
        return self.raw.dtype

    def update(self, estimate, decay):
        """Folds one batch `estimate` in with decay `decay` (0 keeps only it)."""
        if isinstance(decay, (int, float)):
            decay = tf.constant(decay, self.dtype)
        decay = tf.cast(decay, self.dtype)
        estimate = tf.cast(estimate, self.dtype)
        keep = 1.0 - decay  # the new estimate's share, computed once for both
        self.raw.assign(decay * self.raw + keep * estimate)
        self.weight.assign(decay * self.weight + keep)

    def value(self):
        """The debiased average `m_t / w_t` (zeros before the first update)."""
        return tf.math.divide_no_nan(self.raw, self.weight)
