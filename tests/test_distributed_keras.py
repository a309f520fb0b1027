"""kg.KFACModel (and kg.DPModel, below) under MirroredStrategy (2 logical CPU devices, a fresh
process): ``fit`` for 2 epochs of 4 batches ends with the weights, losses
and accuracies of the same ``fit`` on one device (float64, "exact" mode)."""

import distributed_runner
import numpy as np
import pytest


# under -m slow: kg.KFAC's replicated step stays in the fast set
# (test_distributed_mirrored.py)
@pytest.mark.slow
def test_fit_under_mirrored_strategy_matches_one_device(tmp_path):
    r = distributed_runner.run("keras", tmp_path / "keras.npz", devices=2)
    assert int(r["iterations"]) == 8
    np.testing.assert_allclose(r["distributed"], r["reference"], rtol=1e-6, atol=1e-10)
    np.testing.assert_allclose(r["loss"], r["reference_loss"], rtol=1e-6)
    np.testing.assert_allclose(r["accuracy"], r["reference_accuracy"])
    assert r["loss"][-1] < 0.7 * r["loss"][0]


# under -m slow: kg.DPModel.fit under a strategy stays in the fast set on two workers
# (test_distributed_multiworker.py, Poisson sampling)
@pytest.mark.slow
def test_dp_model_under_mirrored_strategy_matches_one_device(tmp_path):
    """``kg.DPModel`` under MirroredStrategy: each replica clips its share of
    the batch, adds 1/R of one noise (replica 0's key) and of the penalty's
    gradient, divides a mean by all replicas' examples, and Keras's
    optimizer sums the replicas: three steps, with noise, end where one
    device ends (before, ``compile`` refused the strategy)."""
    r = distributed_runner.run("dp_keras", tmp_path / "dp.npz", devices=2)
    for sampling in ("fixed", "poisson"):
        assert int(r[f"{sampling}/iterations"]) == 3
        np.testing.assert_allclose(r[f"{sampling}/distributed"], r[f"{sampling}/reference"],
                                   rtol=1e-5, atol=1e-7)
        for key in ("loss", "accuracy", "epsilon"):
            np.testing.assert_allclose(r[f"{sampling}/{key}"], r[f"{sampling}/reference_{key}"],
                                       rtol=1e-5)
