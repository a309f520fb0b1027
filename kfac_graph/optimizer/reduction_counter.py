"""Counting the bytes a ``tf.distribute`` strategy reduces across replicas.

``ReductionCounter(strategy)`` wraps the two entry points every cross-replica
reduction of the strategy goes through (``extended.reduce_to`` and
``extended.batch_reduce_to``: ``strategy.reduce``, replica-context
``all_reduce``, and the implicit reduction of reading an ``ON_READ``
variable in cross-replica context all end there). Each reduction adds, when
it runs (in or out of a ``tf.function``, in whichever ``tf.cond`` branch it
sits), its payload to ``bytes`` (an ``int64`` variable):

    payload = sum over the reduced values of (elements x bytes per element)

of one replica's copy: what each replica contributes (the traffic on the
wire is a multiple that depends on the algorithm and the replica count).
Values that need no communication (a mean of mirrored values, a value that
is not per-replica, anything with one replica in sync) count nothing.

    strategy = tf.distribute.MirroredStrategy(devices)
    counter = ReductionCounter(strategy)     # before the first step is traced
    ...
    counter.bytes.numpy()

Instrumentation for tests and benchmarks: it replaces the two methods on
this strategy's ``extended`` object (``uninstall()`` puts them back).
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.distribute import distribute_utils


def payload_bytes(values) -> int:
    """The bytes of one replica's copy of each value (static shapes)."""
    total = 0
    for value in values:
        one = value.values[0] if isinstance(value, tf.distribute.DistributedValues) else value
        total += int(one.shape.num_elements()) * tf.as_dtype(one.dtype).size
    return total


def _communicates(reduce_op, value) -> bool:
    if not isinstance(value, tf.distribute.DistributedValues):
        return False
    return not (distribute_utils.is_mirrored(value) and reduce_op == tf.distribute.ReduceOp.MEAN)


class ReductionCounter:
    """Counts the payload of every reduction ``strategy`` runs (module docstring)."""

    def __init__(self, strategy):
        self.strategy = strategy
        with tf.init_scope():
            self.bytes = tf.Variable(tf.zeros([], tf.int64), trainable=False, name="reduced_bytes")
        extended = strategy.extended
        self._originals = (extended._reduce_to, extended._batch_reduce_to)
        reduce_to, batch_reduce_to = self._originals

        def counted_reduce_to(reduce_op, value, destinations, options):
            self._count(reduce_op, [value])
            return reduce_to(reduce_op, value, destinations, options)

        def counted_batch_reduce_to(reduce_op, value_destination_pairs, options):
            self._count(reduce_op, [v for v, _ in value_destination_pairs])
            return batch_reduce_to(reduce_op, value_destination_pairs, options)

        extended._reduce_to = counted_reduce_to
        extended._batch_reduce_to = counted_batch_reduce_to

    def _count(self, reduce_op, values):
        if self.strategy.num_replicas_in_sync < 2:
            return  # one replica: nothing crosses devices
        n = payload_bytes([v for v in values if _communicates(reduce_op, v)])
        if n:
            self.bytes.assign_add(n)

    def uninstall(self):
        extended = self.strategy.extended
        extended._reduce_to, extended._batch_reduce_to = self._originals
