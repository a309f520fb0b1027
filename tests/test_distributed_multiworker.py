"""kg.KFAC under MultiWorkerMirroredStrategy: two worker processes on
localhost (``TF_CONFIG``, free ports), one replica each, 20 steps on the
whole batches (each replica takes its half) end with the single-device
parameters (float64, rtol 1e-6), lazy and eager syncing, on every worker;
each of the MLP's two blocks has its inverses computed by one worker only.
Modes "exact" and "empirical" (see test_distributed_mirrored.py)."""

import distributed_runner
import distributed_support
import numpy as np
import pytest


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    return distributed_runner.run_workers(tmp_path_factory.mktemp("workers") / "w.npz")


@pytest.mark.parametrize("config", list(distributed_support.CONFIGS))
def test_two_workers_match_single_device(workers, config):
    params, _, _ = distributed_support.train(config)
    reference = np.concatenate([p.ravel() for p in params])
    for result in workers:
        assert int(result["replicas"]) == 2
        for sync in ("lazy", "eager"):
            np.testing.assert_allclose(result[f"{config}/{sync}"], reference, rtol=1e-6, atol=1e-10)
    for sync in ("lazy", "eager"):  # block i on worker i mod 2, nowhere else
        assert [list(r[f"{config}/{sync}_blocks"]) for r in workers] == [[0], [1]]


def test_keras_fit_on_two_workers_matches_one_device(workers):
    """``KFACModel.fit`` under the two-worker strategy (each worker feeds the
    same arrays; Keras splits every batch over the replicas) ends with the
    one-device weights after the same number of steps."""
    for result in workers:  # the one-device fit ran in the worker's process too
        assert int(result["keras_iterations"]) == int(result["keras_reference_iterations"]) == 8
        np.testing.assert_allclose(result["keras"], result["keras_reference"], rtol=1e-6,
                                   atol=1e-10)
