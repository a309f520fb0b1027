"""``kg.DPModel``'s step on several replicas (``tf.distribute``): which
strategies, each replica's share of one device's step, and what the workers
of a ``MultiWorkerMirroredStrategy`` must agree on.

One device's step on a batch ``S`` is ``g~ = (sum_{i in S} clip(g_i) + z) / d
+ grad P``, with ``z ~ N(0, sigma^2 C^2 I)`` drawn from one key, ``d`` (for a
mean loss; 1 for a sum) the expected batch size ``qN`` of padded Poisson
batches, else ``|S|``, and ``P`` a weight penalty. Replica ``r`` of ``R`` holds ``S_r``
(the ``S_r`` partition ``S``) and computes ``g_r = (sum_{i in S_r} clip(g_i)
+ z / R) / d + grad P / R`` with the same ``z`` (replica 0's key, summed to
every replica by one all-reduce with the others' keys zeroed) and the same
``d`` (``|S|`` is the all-reduced sum of the ``|S_r|``); Keras's optimizer
sums the replicas' gradients, and ``sum_r g_r = g~`` (``replica_terms``).

Under ``MultiWorkerMirroredStrategy`` the replicas sit in separate worker
processes, and then:

- the all-reduces above run across the workers (replica 0 is the chief's),
  so the chief's key reaches every worker: one draw, whatever each worker's
  own ``NoiseSource`` holds (made in the scope, as the DPModel's is, its
  generator's state is a mirrored variable, the chief's on every worker
  already; the all-reduce does not rely on that);
- every worker's input pipeline draws the whole batch and Keras keeps the
  worker's share (its ``DATA`` auto-sharding), so ``S`` is one sample only if
  every worker draws the same one: ``fit`` on arrays samples with the chief's
  fresh secret seed, sent to every worker by one all-reduce
  (``sampler_seed``); a dataset from ``kg.privacy.poisson_batches`` or
  ``fixed_size_batches`` (which ``fit`` makes from arrays) has its seed
  pair, examples (a digest) and rate compared across the workers, and
  differing ones are refused in one line on every worker (``check_sampler``).
  Any other dataset must yield the same batches on every worker (the same
  data, no unseeded shuffle): ``fit`` cannot see its sampler;
- the accounting reads the sampler (``N``, ``q``) and
  ``optimizer.iterations`` (mirrored), so epsilon is one device's on every
  worker;
- each worker traces the step for its own shares' shapes, which may differ
  from the others' (an odd padded batch splits ``k + 1`` and ``k``): the
  collectives take their instance keys when called, not when traced
  (TensorFlow's collective ops V2), so the workers' traces need not match.

Other strategies (``TPUStrategy``, ``ParameterServerStrategy``, ...) are
refused in one line (``check_strategy``), as is validation in ``fit`` under
``MultiWorkerMirroredStrategy`` (``check_validation``).
"""
from __future__ import annotations

import secrets

import numpy as np
import tensorflow as tf

MULTI_WORKER = tf.distribute.MultiWorkerMirroredStrategy
STRATEGIES = (tf.distribute.MirroredStrategy, MULTI_WORKER, tf.distribute.OneDeviceStrategy)
SUM = tf.distribute.ReduceOp.SUM


def check_strategy(strategy, model) -> None:
    """One-line ``ValueError`` unless ``strategy`` (the DPModel's, or None) is
    one the step supports and ``model``'s variables were made under it."""
    if strategy is not None and not isinstance(strategy, STRATEGIES):
        raise ValueError(f"kg.DPModel trains on one device or under MirroredStrategy or "
                         f"MultiWorkerMirroredStrategy, not under {type(strategy).__name__}")
    if strategy is None and any(isinstance(getattr(v, "value", v), tf.distribute.DistributedValues)
                                for v in model.variables):
        raise ValueError("kg.DPModel: its model is under a tf.distribute strategy: make "
                         "the DPModel under the same strategy.scope()")


def check_validation(strategy, validation_split, validation_data) -> None:
    """One-line ``ValueError`` for validation in ``fit`` under
    ``MultiWorkerMirroredStrategy``: it runs Keras's ``evaluate``, which
    Keras 3.15 breaks there for any model (it reduces the scalar logs along
    axis 0), after the first epoch's training."""
    if isinstance(strategy, MULTI_WORKER) and (validation_split or validation_data is not None):
        raise ValueError("kg.DPModel.fit under MultiWorkerMirroredStrategy takes no "
                         "validation_split or validation_data: Keras's evaluate fails under "
                         "that strategy (Keras 3.15 reduces its scalar logs along axis 0); "
                         "evaluate the trained model without the strategy")


def replica_terms(key, x):
    """``(key, share, batch_total)`` for ``privatize`` on this replica (module
    docstring): replica 0's key, ``1 / R``, and the number of examples of all
    replicas (float64); ``(key, 1.0, None)`` outside a replica context of
    more than one replica."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return key, 1.0, None
    first = tf.cast(tf.equal(context.replica_id_in_sync_group, 0), key.dtype)
    key = context.all_reduce(SUM, key * first)
    total = context.all_reduce(SUM, tf.cast(tf.shape(tf.nest.flatten(x)[0])[0], tf.float64))
    return key, 1.0 / context.num_replicas_in_sync, total


def sampler_seed(strategy):
    """The seed ``fit`` samples arrays with: None (a fresh one from the OS)
    except under ``MultiWorkerMirroredStrategy``, where it is the chief's
    fresh one from the OS, the same on every worker."""
    if not isinstance(strategy, MULTI_WORKER):
        return None
    return int(_all_reduce(strategy, tf.constant(secrets.randbits(62), tf.int64), True))


def check_sampler(strategy, dataset) -> None:
    """Under ``MultiWorkerMirroredStrategy``, a one-line ``ValueError`` on
    every worker where the workers' DP samplers differ
    (``dataset.privacy_fingerprint()``: seeds and examples; and
    ``.privacy_sampling``'s size, kind and rate); nothing for other datasets
    and strategies."""
    fingerprint = getattr(dataset, "privacy_fingerprint", None)
    sampling = getattr(dataset, "privacy_sampling", None)
    if not isinstance(strategy, MULTI_WORKER) or fingerprint is None or sampling is None:
        return
    mine = tf.constant([*fingerprint(), sampling.num_examples, int(sampling.kind == "poisson"),
                        int(np.float64(sampling.rate).view(np.int64))], tf.int64)
    chief = _all_reduce(strategy, mine, True)
    if int(_all_reduce(strategy, tf.cast(tf.reduce_any(mine != chief), tf.int64), False)):
        raise ValueError("kg.DPModel.fit under MultiWorkerMirroredStrategy: the workers' DP "
                         "samplers differ (seed, global tf.random seed, examples or sampling), so "
                         "each worker's share would come from another batch; give every worker "
                         "the same examples, and make the dataset with one seed= and the same "
                         "tf.random seed on each, or give fit the arrays (it then samples with "
                         "one secret seed)")


def _all_reduce(strategy, value, chief_only):
    """The sum over all replicas of ``value`` (replica 0's alone where
    ``chief_only``), eagerly; every worker must call it alike."""
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: value * int(not chief_only or ctx.replica_id_in_sync_group == 0))
    return strategy.reduce(SUM, per_replica, axis=None)
