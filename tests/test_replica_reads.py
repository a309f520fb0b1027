"""Where a loss reads across replicas (``passes.one_device``'s probe).

A registration is the loss as one device computes it; a function that asks
the replica context for a read across replicas (``all_reduce``,
``all_gather``, ``merge_call``) gets its own values back there, and the
registration records the name scope of each such read
(``Registration.replica_reads``). ``kg.KFAC`` refuses such a loss under
more than one replica (``optimizer/replica_reads.py``; the 2-replica run is
in ``test_damping_rule_state.py``), and runs it on one.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph.optimizer import replica_reads


def _data():
    rng = np.random.default_rng(0)
    return tf.constant(rng.normal(size=(8, 5)), tf.float32), tf.constant(rng.integers(0, 3, 8))


def _bn_loss(synchronized):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4),
                              keras.layers.BatchNormalization(synchronized=synchronized,
                                                              name="norm"),
                              keras.layers.Dense(3)])
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, kg.auto_register(lambda x, y: ce(y, model(x, training=True)))


def test_synchronized_batch_norm_records_its_reads_and_a_plain_one_none():
    args = _data()
    _, synced = _bn_loss(True)
    reads = synced.registration(*args).replica_reads
    assert reads and all("/norm" in r for r in reads), reads
    _, plain = _bn_loss(False)
    assert plain.registration(*args).replica_reads == ()


def test_a_gathered_contrastive_loss_records_its_read():
    """Each example against the gathered batch's embeddings (SimCLR's
    cross-replica negatives)."""
    keras.utils.set_random_seed(0)
    encoder = keras.layers.Dense(4)

    @kg.auto_register
    def loss_fn(x, y):
        z = tf.math.l2_normalize(encoder(x), axis=1)
        everyone = tf.distribute.get_replica_context().all_gather(z, axis=0)
        logits = tf.matmul(z, everyone, transpose_b=True) / 0.1
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            tf.range(tf.shape(z)[0]), logits))

    assert loss_fn.registration(*_data()).replica_reads


def test_a_trace_found_in_the_cache_keeps_its_record():
    """``concrete_function`` traces first; the registration then finds that
    trace in ``tf.function``'s cache, where the record was kept."""
    args = _data()
    _, synced = _bn_loss(True)
    synced.concrete_function(*args)
    assert synced.registration(*args).replica_reads


def test_kfac_refuses_reads_across_several_replicas_and_runs_on_one():
    args = _data()
    _, synced = _bn_loss(True)
    reg = synced.registration(*args)
    with pytest.raises(kg.KfacGraphError, match="reads across replicas at .*norm"):
        replica_reads.refuse(reg, 2)
    replica_reads.refuse(reg, 1)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model, fn = _bn_loss(True)
        opt = kg.KFAC(fn, momentum_type="regular")
    before = [v.numpy().copy() for v in model.trainable_variables]
    for _ in range(2):
        assert np.isfinite(float(opt.step(*args)))
    assert int(opt.skipped_steps.numpy()) == 0
    assert any(not np.array_equal(b, v.numpy()) for b, v in zip(before,
                                                                 model.trainable_variables))


def test_a_users_function_traced_before_its_registration():
    """A ``tf.function`` the user traced (called) before registering it: the
    registration finds that trace in the cache, made outside the probe with
    no record, and traces the function again inside it."""
    args = _data()
    model, _ = _bn_loss(True)
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    traced = tf.function(lambda x, y: ce(y, model(x, training=True)))
    traced(*args)
    reads = kg.auto_register(traced).registration(*args).replica_reads
    assert reads and all("/norm" in r for r in reads), reads
