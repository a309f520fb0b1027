"""kg.KFAC under MultiWorkerMirroredStrategy: two worker processes on
localhost (``TF_CONFIG``, free ports), one replica each, 20 steps on the
whole batches (each replica takes its half) end with the single-device
parameters (float64, rtol 1e-6), lazy and eager syncing, on every worker;
each of the MLP's two blocks has its inverses computed by one worker only.
Modes "exact" and "empirical" (see test_distributed_mirrored.py). The workers
also run ``KFACModel.fit`` and ``DPModel.fit`` against one device."""

import distributed_runner
import distributed_selection
import distributed_support
import numpy as np
import pytest


@pytest.fixture(scope="module")
def workers(request, tmp_path_factory):
    """The workers run what the selected tests read alone."""
    items = distributed_selection.module_items(request)
    parts = [p for p in ("fixed", "poisson") if p in distributed_selection.selected_ids(items)]
    if any(item.originalname == test_keras_fit_on_two_workers_matches_one_device.__name__
           for item in items):
        parts.append("keras")
    configs = distributed_selection.selected(items)
    return distributed_runner.run_workers(tmp_path_factory.mktemp("workers") / "w.npz",
                                          configs=configs, parts=parts)


# all under -m slow: the replicated K-FAC step is in the fast set under MirroredStrategy
# (test_distributed_mirrored.py), the workers' DP-SGD fit here
@pytest.mark.parametrize("config", [pytest.param(c, marks=pytest.mark.slow)
                                    for c in distributed_support.CONFIGS])
def test_two_workers_match_single_device(workers, config):
    params, _, _ = distributed_support.train(config)
    reference = np.concatenate([p.ravel() for p in params])
    for result in workers:
        assert int(result["replicas"]) == 2
        for sync in ("lazy", "eager"):
            np.testing.assert_allclose(result[f"{config}/{sync}"], reference, rtol=1e-6, atol=1e-10)
    for sync in ("lazy", "eager"):  # block i on worker i mod 2, nowhere else
        assert [list(r[f"{config}/{sync}_blocks"]) for r in workers] == [[0], [1]]


@pytest.mark.slow  # KFACModel.fit under a strategy: test_distributed_keras.py in the fast set
def test_keras_fit_on_two_workers_matches_one_device(workers):
    """``KFACModel.fit`` under the two-worker strategy (each worker feeds the
    same arrays; Keras splits every batch over the replicas) ends with the
    one-device weights after the same number of steps."""
    for result in workers:  # the one-device fit ran in the worker's process too
        assert int(result["keras_iterations"]) == int(result["keras_reference_iterations"]) == 8
        np.testing.assert_allclose(result["keras"], result["keras_reference"], rtol=1e-6,
                                   atol=1e-10)


# padded Poisson batches (split unevenly) in the fast set, fixed-size under -m slow
@pytest.mark.parametrize("sampling", [pytest.param("fixed", marks=pytest.mark.slow), "poisson"])
def test_dp_fit_on_two_workers_matches_one_device(workers, sampling):
    """``DPModel.fit`` under the two-worker strategy, float64, three steps with
    noise (fixed-size batches of 16, and padded Poisson batches of 15, 15
    and 16 rows, every fifth masked out, which the workers split unevenly):
    the one-device weights, losses, accuracies and epsilon on every worker.
    Worker ``i`` seeds its noise with ``3 + i`` and the reference with 3: the
    chief's key is the one drawn. Before, ``compile`` refused the strategy."""
    for result in workers:  # the one-device fit ran in the worker's process too
        ref, dist = f"dp_{sampling}/reference", f"dp_{sampling}/distributed"
        assert int(result[f"{ref}_iterations"]) == int(result[f"{dist}_iterations"]) == 3
        np.testing.assert_allclose(result[dist], result[ref], rtol=1e-6, atol=1e-10)
        for key in ("loss", "accuracy", "epsilon"):
            np.testing.assert_allclose(result[f"{dist}_{key}"], result[f"{ref}_{key}"], rtol=1e-6)


def test_dp_workers_agree_on_the_sampler(workers):
    """The seed ``fit`` samples arrays with is the chief's on every worker, and
    ``poisson_batches`` draws the same batches from it on each; samplers of
    one seed and data pass the check, per-worker seeds or examples are
    refused on every worker (none is left waiting for the others); so is
    validation in ``fit`` (Keras's ``evaluate`` fails under the strategy)."""
    first, second = workers
    assert int(first["dp_sampler_seed"]) == int(second["dp_sampler_seed"])
    np.testing.assert_array_equal(first["dp_sampler_batches"], second["dp_sampler_batches"])
    for result in workers:
        assert str(result["dp_sampler_same"]) == ""
        for name in ("other_seed", "other_examples"):
            assert "the workers' DP samplers differ" in str(result[f"dp_sampler_{name}"])
        assert "takes no validation_split" in str(result["dp_validation"])
