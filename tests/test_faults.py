"""Fault tolerance: a training run killed by SIGKILL part-way resumes from what
it saved and ends bitwise where an uninterrupted run ends.

Each run is a fresh process (``fault_runner.py``): one uninterrupted, one
that kills itself between two saves, one that resumes from the killed run's
last save. ``kg.KFAC`` saves with ``tf.train.CheckpointManager`` every 3 of
12 steps and is killed after step 7 (resuming from step 6);
``kg.KFACModel.fit`` backs up with ``keras.callbacks.BackupAndRestore`` at
every epoch end (4 epochs of 3 batches) and is killed after step 7, the first
batch of epoch 2 (resuming from the start of epoch 2); that case is marked
slow (``-m slow``).
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_runner.py")
KILL_AFTER = 7


def _start(mode, directory, out, kill_after=None):
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    cmd = [sys.executable, RUNNER, mode, "--dir", str(directory), "--out", str(out)]
    if kill_after is not None:
        cmd += ["--kill_after", str(kill_after)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait(proc, timeout=240):
    try:
        _, proc.stderr_text = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return proc


def _run(*args, **kwargs):
    return _wait(_start(*args, **kwargs))


def _alongside(other, *args, **kwargs):
    """Runs one process to its end while ``other`` runs; waits for both."""
    try:
        return _run(*args, **kwargs)
    finally:
        _wait(other)


def _finished(proc, what):
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{proc.stderr_text[-4000:]}"
    assert "not restored" not in proc.stderr_text, f"{what}:\n{proc.stderr_text[-4000:]}"


def _killed(proc, what):
    assert proc.returncode == -signal.SIGKILL, (
        f"{what}: expected SIGKILL, got {proc.returncode}:\n{proc.stderr_text[-4000:]}")


def _assert_same_end(reference, resumed):
    ref, res = np.load(reference), np.load(resumed)
    weights = sorted(k for k in ref.files if k.startswith("arr_"))
    assert weights and weights == sorted(k for k in res.files if k.startswith("arr_"))
    for key in weights + ["iterations", "damping", "learning_rate", "momentum", "state"]:
        np.testing.assert_array_equal(res[key], ref[key], err_msg=key)
    return ref, res


@pytest.mark.slow  # 23 s; test_optimizer's checkpoint resume is the fast set's
def test_kfac_checkpoint_manager_resumes_bitwise(tmp_path):
    # the uninterrupted run alongside the one that is killed
    ref = _start("kfac", tmp_path / "ref_ckpt", tmp_path / "ref.npz")

    ckpt = tmp_path / "ckpt"
    killed = _alongside(ref, "kfac", ckpt, tmp_path / "unused.npz", kill_after=KILL_AFTER)
    _finished(ref, "uninterrupted run")
    _killed(killed, "run killed after step 7")
    assert not (tmp_path / "unused.npz").exists()
    saved = sorted(int(f.split("-")[1].split(".")[0]) for f in os.listdir(ckpt)
                   if f.startswith("ckpt-") and f.endswith(".index"))
    assert saved == [3, 6], saved  # the kill came between two saves

    resumed = _run("kfac", ckpt, tmp_path / "resumed.npz")
    _finished(resumed, "resumed run")
    ref, res = _assert_same_end(tmp_path / "ref.npz", tmp_path / "resumed.npz")
    assert int(ref["resumed_from"]) == 0 and int(res["resumed_from"]) == 6
    assert int(res["iterations"]) == 12


@pytest.mark.slow  # ~45 s on 2 busy cores (three TensorFlow processes)
def test_keras_backup_and_restore_resumes_bitwise(tmp_path):
    # the uninterrupted run alongside the one that is killed
    ref = _start("keras", tmp_path / "ref_backup", tmp_path / "ref.npz")

    backup = tmp_path / "backup"
    killed = _alongside(ref, "keras", backup, tmp_path / "unused.npz", kill_after=KILL_AFTER)
    _finished(ref, "uninterrupted fit")
    _killed(killed, "fit killed after step 7")
    assert not (tmp_path / "unused.npz").exists()
    with open(backup / "training_metadata.json") as f:
        assert json.load(f)["epoch"] == 2  # backed up at the end of epoch 1 (step 6)

    resumed = _run("keras", backup, tmp_path / "resumed.npz")
    _finished(resumed, "resumed fit")
    ref, res = _assert_same_end(tmp_path / "ref.npz", tmp_path / "resumed.npz")
    np.testing.assert_array_equal(res["keras_iterations"], ref["keras_iterations"])
    assert int(ref["resumed_from"]) == 0 and int(res["resumed_from"]) == 2
    assert int(res["iterations"]) == 12


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
