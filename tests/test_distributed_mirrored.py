"""kg.KFAC under MirroredStrategy on 2 and 4 logical CPU devices (each in a
fresh process, ``distributed_support.py``): 20 steps on batches split over
the replicas end with the parameters of 20 single-device steps on the whole
batches (float64, rtol 1e-6), with lazy and with eager syncing of the factor
statistics; lazy syncing reduces fewer bytes (counted by
``ReductionCounter``); a batch with a NaN in one replica's share is skipped
on every replica, changing no copy of any variable but the skip counter;
a checkpoint taken mid-run resumes to the uninterrupted result; with
``qmodel_batch_fraction`` each replica's quadratic model reads its own
first examples, and with ``spread_covariances`` each replica's statistics
come from a slice of its own share.

Estimation modes: "exact" (regular momentum, also with its factors in
diagonal blocks) and "empirical" (qmodel); the sampled mode draws other
targets on each replica, so it is not compared.
"""

import distributed_runner
import distributed_selection
import distributed_support
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg

RTOL, ATOL = 1e-6, 1e-10


# 2 devices in the fast set; 4 (two minutes more) under -m slow, as are the
# configs but regular momentum's (distributed_selection.FAST; the quadratic
# model's forms stay in the fast set through qmodel_batch_fraction's run)
CONFIGS = distributed_selection.params()
# the eager sync's runs of the options and the checkpoint under -m slow (its
# equality to one device is in the fast set through test_replicas_match_single_device)
EAGER_SLOW = ["lazy", pytest.param("eager", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)],
                ids=["2_devices", "4_devices"])
def mirrored(request, tmp_path_factory):
    out, n = tmp_path_factory.mktemp("mirrored"), request.param
    items = distributed_selection.module_items(request)
    configs = distributed_selection.selected(items)
    options = distributed_selection.selected_options(items)
    results = dict(distributed_runner.run("mirrored", out / f"r{n}.npz", devices=n,
                                          configs=configs, options=options))
    if set(configs) & set(distributed_support.APART):  # in a process of their own
        results.update(distributed_runner.run("mirrored_apart", out / f"apart{n}.npz",
                                              devices=n, configs=configs, options=options))
    return results


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("sync", ["lazy", "eager"])
def test_replicas_match_single_device(mirrored, config, sync):
    key = f"{config}/{sync}"
    np.testing.assert_allclose(mirrored[key], mirrored[f"{config}/reference"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(
        mirrored[key + "_losses"], mirrored[f"{config}/reference_losses"], rtol=RTOL
    )
    assert float(mirrored[key + "_replica_spread"]) == 0.0, "replicas hold different parameters"
    assert int(mirrored[key + "_skipped"]) == 0
    # the run moved the parameters (the equality is not that of two idle runs)
    assert np.max(np.abs(mirrored[key] - _initial())) > 1e-2


def test_qmodel_batch_fraction_takes_each_replicas_first_examples(mirrored):
    """With ``qmodel_batch_fraction=0.5`` each replica's forms are its own
    first half's: the run equals one device's on batches reordered to put
    those examples first, and differs from one device's on the batches as
    they are (so the fraction was applied)."""
    got = mirrored["qmodel_fraction/lazy"]
    np.testing.assert_allclose(got, mirrored["qmodel_fraction/reference"], rtol=RTOL, atol=ATOL)
    assert np.max(np.abs(got - mirrored["qmodel_fraction/unordered"])) > 1e-6


@pytest.mark.parametrize("sync", EAGER_SLOW)
def test_spread_covariances_take_each_replicas_own_slice(mirrored, sync):
    """With ``spread_covariances`` each replica folds in a slice of its own
    share: the run equals one device's on batches reordered so that its
    slices hold the replicas' (and differs from one device's on the batches
    as they are)."""
    got = mirrored[f"spread/{sync}"]
    np.testing.assert_allclose(got, mirrored["spread/reference"], rtol=RTOL, atol=ATOL)
    assert np.max(np.abs(got - mirrored["spread/unordered"])) > 1e-6


@pytest.mark.parametrize("sync", EAGER_SLOW)
def test_spread_slices_every_other_step_take_each_replicas_own_slice(mirrored, sync):
    """Slices every 2nd step (the stride an overhead budget may pick) fold in
    in a branch on each replica alike: the run equals one device's on
    reordered batches."""
    got = mirrored[f"stride/{sync}"]
    np.testing.assert_allclose(got, mirrored["stride/reference"], rtol=RTOL, atol=ATOL)
    assert np.max(np.abs(got - mirrored["stride/unordered"])) > 1e-6


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("sync", ["lazy", "eager"])
def test_non_finite_batch_is_skipped_on_every_replica(mirrored, config, sync):
    counted, changed, applied_next = mirrored[f"{config}/{sync}_nan_batch"]
    assert counted == 1, "the skip was not counted once"
    assert changed == 0, "a skipped step changed a parameter or statistic on some replica"
    assert applied_next == 1


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("sync", EAGER_SLOW)
def test_checkpoint_resume_matches_uninterrupted(mirrored, config, sync):
    """Saved after 10 steps and restored into fresh variables and a fresh
    optimizer under a new strategy, 10 more steps end where 20 straight do
    (replica-local statistics are saved as their mean, which is all the
    step reads)."""
    straight, resumed = mirrored[f"{config}/{sync}_checkpoint"]
    np.testing.assert_allclose(resumed, straight, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("config", CONFIGS)
def test_lazy_sync_reduces_fewer_bytes(mirrored, config):
    lazy, eager = int(mirrored[f"{config}/lazy_bytes"]), int(mirrored[f"{config}/eager_bytes"])
    assert 0 < lazy < eager


def _initial():
    weights, _ = distributed_support.problem()
    return np.concatenate([w.ravel() for w in weights])


def test_unsupported_strategy_is_one_line_error():
    w = tf.Variable(tf.ones([2, 2]))
    fn = kg.auto_register(lambda x: tf.reduce_mean(tf.square(tf.matmul(x, w))))
    strategy = tf.distribute.experimental.CentralStorageStrategy()
    with strategy.scope(), pytest.raises(ValueError, match="does not support CentralStorage"):
        kg.KFAC(fn)


def test_sync_statistics_is_validated():
    fn = kg.auto_register(lambda x: tf.reduce_mean(x))
    with pytest.raises(ValueError, match="sync_statistics"):
        kg.KFAC(fn, sync_statistics="sometimes")
