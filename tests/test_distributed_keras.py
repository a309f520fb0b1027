"""kg.KFACModel under MirroredStrategy (2 logical CPU devices, a fresh
process): ``fit`` for 2 epochs of 4 batches ends with the weights, losses
and accuracies of the same ``fit`` on one device (float64, "exact" mode)."""

import distributed_runner
import numpy as np


def test_fit_under_mirrored_strategy_matches_one_device(tmp_path):
    r = distributed_runner.run("keras", tmp_path / "keras.npz", devices=2)
    assert int(r["iterations"]) == 8
    np.testing.assert_allclose(r["distributed"], r["reference"], rtol=1e-6, atol=1e-10)
    np.testing.assert_allclose(r["loss"], r["reference_loss"], rtol=1e-6)
    np.testing.assert_allclose(r["accuracy"], r["reference_accuracy"])
    assert r["loss"][-1] < 0.7 * r["loss"][0]
