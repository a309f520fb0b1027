"""A script run by a fresh interpreter (its own logical devices, its own
TensorFlow state), its result the JSON object on its last line of output."""
import json
import os
import subprocess
import sys


def run(script: str, timeout: int) -> dict:
    """The JSON object ``script`` prints last; fails the test with the tail of
    its error output where it exits non-zero."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
