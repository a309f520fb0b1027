"""What a TPU needs of the distributed step, checked on the CPU: with
``jit_compile=True`` under MirroredStrategy (2 logical devices, a fresh
process) every per-replica function of the step is compiled by XLA (the
step then still matches one device), and none of them holds a host
callback (print, py_function)."""

import distributed_runner
import numpy as np
import pytest

HOST_CALLBACKS = {
    "PrintV2",
    "Print",
    "PyFunc",
    "PyFuncStateless",
    "EagerPyFunc",
    "WriteScalarSummary",
    "WriteSummary",
}


def test_replica_functions_compile_with_xla(tmp_path):
    r = distributed_runner.run("xla", tmp_path / "xla.npz", devices=2)
    assert bool(r["whole_step_jit"])
    # gradients + statistics, restore, Fisher forms, damping-rule loss: per replica
    assert int(r["compiled"]) >= 8
    assert not HOST_CALLBACKS & set(r["op_types"].tolist())
    assert {"MatMul", "AssignVariableOp"} <= set(r["op_types"].tolist())
    np.testing.assert_allclose(r["xla"], r["reference"], rtol=1e-6, atol=1e-10)


@pytest.mark.slow  # 28 s; test_replica_functions_compile_with_xla is the fast set's
def test_replicas_xla_step_with_embeddings_and_a_covariance_period(tmp_path):
    """Token and sliced position embeddings, steps without statistics: the
    replicas' XLA-compiled step equals one device's (it failed to build: the
    plain pass's gradient through a nested call had no static shape, and the
    quadratic model's second backward pass met a slice gradient without one)."""
    r = distributed_runner.run("xla_embedding", tmp_path / "emb.npz", devices=2)
    for rule in ("regular", "qmodel"):
        assert int(r[f"{rule}/skipped"]) == 0
        np.testing.assert_allclose(r[f"{rule}/xla"], r[f"{rule}/reference"], rtol=1e-6,
                                   atol=1e-10, err_msg=rule)
