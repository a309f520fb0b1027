"""Tracing a function as one device computes it, and what it asks of other replicas.

``one_device()``: functions traced within see no ``tf.distribute``
strategy (the one in scope, or the replica's, is hidden from
``tf.distribute.get_strategy()``; a function graph copies the strategy
stack of the graph it is traced from). Keras's losses divide the loss by
the number of replicas under a strategy (``scale_loss_for_distribution``),
for a sum of the replicas' gradients; a registration is the batch's loss
as one device computes it (the distributed step reduces the replicas
itself, and per-example gradients are of that loss). Traced so, under 2
replicas, a Keras loss's per-example gradients were half the true ones.

The replica context seen within is a ``ReplicaProbe``: TensorFlow's
default one-replica context (``all_reduce`` and ``all_gather`` return the
value itself), which records where the function asked for a read across
replicas: ``all_reduce``, ``all_gather`` and ``merge_call`` all go through
its ``_merge_call``. ``BatchNormalization(synchronized=True)`` all-reduces
its moments this way; so does a contrastive loss gathering the other
replicas' embeddings. One device's trace answers each with its own values:
under several replicas that is another function than the one the user
runs, which the K-FAC step refuses (``kfac_graph.optimizer.distributed``).
"""
from __future__ import annotations

import contextlib

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib


class ReplicaProbe(distribute_lib._DefaultReplicaContext):  # pylint: disable=protected-access
    """The default replica context, recording ``reads``: the name scope of
    each read across replicas made in it."""

    def __init__(self):
        super().__init__(distribute_lib._get_default_strategy(),  # pylint: disable=protected-access
                         replica_id_in_sync_group=0)
        self.reads = []

    def _merge_call(self, merge_fn, args, kwargs):
        self.reads.append(tf.compat.v1.get_default_graph().get_name_scope() or "(top level)")
        return super()._merge_call(merge_fn, args, kwargs)


@contextlib.contextmanager
def one_device():
    """Yields the ``ReplicaProbe`` the functions traced within see (module docstring)."""
    graph = tf.compat.v1.get_default_graph()
    stack = graph._distribution_strategy_stack  # pylint: disable=protected-access
    probe = ReplicaProbe()
    graph._distribution_strategy_stack = [probe._thread_context]  # pylint: disable=protected-access
    try:
        yield probe
    finally:
        graph._distribution_strategy_stack = stack  # pylint: disable=protected-access
