"""The examples run end to end with a tiny step count."""
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("sklearn")

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


# both with -m slow: CI's `python -m kfac_graph` trains the same kind of model as
# keras_cnn.py (tests/test_readme.py), and the DP example below runs a script in the fast set
@pytest.mark.parametrize("script", [pytest.param("keras_cnn.py", marks=pytest.mark.slow),
                                    pytest.param("custom_loop.py", marks=pytest.mark.slow)])
def test_example_runs(script):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--steps=4", "--log_every=2"
         if script == "custom_loop.py" else "--steps_per_epoch=2", "--batch_size=32"],
        capture_output=True, text=True, timeout=300, env=env, cwd=EXAMPLES.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test accuracy" in result.stdout
    assert "(K-FAC steps 4)" in result.stdout


def test_dp_example_reports_accuracy_and_its_privacy():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "dp_digits.py"), "--epochs=1", "--epsilon=3",
         "--verbose=0"], capture_output=True, text=True, timeout=300, env=env,
        cwd=EXAMPLES.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test accuracy" in result.stdout
    assert "epsilon by RDP accounting" in result.stdout and "11 steps" in result.stdout
