"""Starting ``distributed_support.py`` in fresh processes, time-bounded."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_support.py")


def _env():
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return env


def run(mode, out, devices=2, timeout=240, configs=None, options=None):
    """Runs one mode in a subprocess (on ``configs`` where it trains them, and
    the mirrored runs ``options`` names, ``distributed_selection.selected_options``);
    the npz it wrote."""
    cmd = [sys.executable, SUPPORT, mode, "--devices", str(devices), "--out", str(out)]
    if configs is not None:
        cmd += ["--configs", ",".join(configs)]
    if options is not None:
        cmd += ["--options", options]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{mode} on {devices} devices failed:\n{proc.stderr[-4000:]}"
    return np.load(out)


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def run_workers(out, workers=2, timeout=300, configs=None, parts=None):
    """A ``MultiWorkerMirroredStrategy`` cluster of local worker processes
    (running ``configs`` and ``parts``, default all:
    ``distributed_support.run_worker``); the npz each worker wrote."""
    ports = free_ports(workers)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = []
    try:
        for index in range(workers):
            env = _env()
            env["TF_CONFIG"] = json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": index}}
            )
            cmd = [sys.executable, SUPPORT, "worker", "--out", str(out)]
            if configs is not None:
                cmd += ["--configs", ",".join(configs)]
            if parts is not None:
                cmd += ["--parts", ",".join(parts)]
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
                )
            )
        errors = []
        for index, proc in enumerate(procs):
            _, stderr = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                errors.append(f"worker {index} exited {proc.returncode}:\n{stderr[-3000:]}")
        assert not errors, "\n".join(errors)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    base = str(out)
    return [np.load(base.replace(".npz", f"_{i}.npz")) for i in range(workers)]
