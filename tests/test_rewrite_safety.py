"""``kfac-rewrite``'s safety: a loss function that touches the host (writes a
file, calls Python) is listed and refused unless ``--allow_host_ops``; every
output path and K-FAC flag is checked before any work; a failed write (a
full disk) leaves nothing behind. Each bad input: exit status 2, its exact
one line, nothing written."""
import errno
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from kfac_graph import emit
from passes import host_ops
from tools import kfac_rewrite

SIGNATURE = [tf.TensorSpec([None, 8]), tf.TensorSpec([None], tf.int32)]
PREFIX = "kfac-rewrite: error: "


class Clean(tf.Module):
    def __init__(self):
        super().__init__()
        self.w = tf.Variable(tf.random.stateless_normal([8, 3], seed=[1, 2]))

    @tf.function(input_signature=SIGNATURE)
    def loss(self, x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, x @ self.w))


class Leaky(Clean):
    """The loss writes a file; ``predict`` prints to one."""

    def __init__(self, leak):
        super().__init__()
        self.leak = leak

    @tf.function(input_signature=SIGNATURE)
    def loss(self, x, y):
        tf.io.write_file(self.leak, tf.strings.as_string(tf.reduce_sum(x)))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, x @ self.w))

    @tf.function(input_signature=SIGNATURE[:1])
    def predict(self, x):
        tf.print(x, output_stream="file://" + self.leak + ".print")
        return x @ self.w


class Callback(Clean):
    """The loss calls Python from a nested tf.function."""

    @tf.function(input_signature=SIGNATURE)
    def loss(self, x, y):
        logits = _with_callback(x @ self.w)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))


@tf.function
def _with_callback(z):
    return z + tf.numpy_function(lambda a: np.zeros_like(a), [z], tf.float32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    leak = str(root / "leak.txt")
    for name, module in (("clean", Clean()), ("leaky", Leaky(leak)), ("callback", Callback())):
        tf.saved_model.save(module, str(root / name))
    return root


def rewrite(*argv) -> int:
    return kfac_rewrite.main(["kfac-rewrite", *map(str, argv)])


def check_fails(argv, capsys, message, parent):
    """Exit status 2, the one line ``PREFIX + message``, ``parent`` unchanged."""
    before = {p: (p.read_bytes() if p.is_file() else None) for p in parent.rglob("*")}
    assert rewrite(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [PREFIX + message]
    assert {p: (p.read_bytes() if p.is_file() else None) for p in parent.rglob("*")} == before


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if the model is scanned or loaded."""
    def forbidden(*args, **kwargs):
        pytest.fail("the tool started work before checking its flags and outputs")

    monkeypatch.setattr(emit, "host_op_scan", forbidden)
    monkeypatch.setattr(emit, "load_loss_function", forbidden)


# -- ops that touch the host ---------------------------------------------------------------

def test_a_loss_that_writes_a_file_is_refused(models, tmp_path, capsys):
    check_fails(["--input", models / "leaky", "--function", "loss", "--output", tmp_path / "out",
                 "--report", tmp_path / "r.json"], capsys,
                "the loss function 'loss' holds ops that touch the host: WriteFile (writes a "
                "file); rewrite it anyway with --allow_host_ops", tmp_path)
    assert not (models / "leak.txt").exists()


def test_dry_run_lists_the_host_ops(models, tmp_path, capsys):
    assert rewrite("--input", models / "leaky", "--function", "loss", "--dry_run") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3].startswith("ops that touch the host, in the loss function: WriteFile "
                                "(writes a file) at __inference_loss_")
    assert lines[-2].startswith("ops that touch the host, elsewhere: PrintV2 (prints to a "
                                "file) at __inference_predict_")
    assert lines[-1] == "kfac-rewrite rewrites it only with --allow_host_ops"
    assert os.listdir(tmp_path) == [] and not (models / "leak.txt").exists()


def test_allow_host_ops_lets_it_through_and_reports_them(models, tmp_path, capsys):
    out, report = tmp_path / "out", tmp_path / "report.json"
    assert rewrite("--input", models / "leaky", "--function", "loss", "--output", out,
                   "--report", report, "--allow_host_ops") == 0
    found = json.loads(report.read_text())["host_ops"]
    assert [(op["op"], op["node"], op["what"]) for op in found["loss"]] == [
        ("WriteFile", "WriteFile", "writes a file")]
    assert found["loss"][0]["function"].startswith("__inference_loss_")
    assert [op["op"] for op in found["elsewhere"]] == ["PrintV2"]
    assert json.loads((out / emit.REPORT_PATH).read_text()) == json.loads(report.read_text())
    assert not (models / "leak.txt").exists()  # rewriting traces the loss, never runs it


def test_a_clean_model_lists_none(models, capsys):
    assert rewrite("--input", models / "clean", "--function", "loss", "--dry_run") == 0
    assert capsys.readouterr().out.strip().splitlines()[-2:] == [
        "ops that touch the host, in the loss function: none",
        "ops that touch the host, elsewhere: none"]
    # every SavedModel holds checkpoint ops (its save and restore functions): not counted
    assert host_ops.scan_saved_model(str(models / "clean"), "loss") == host_ops.HostOpScan()


def test_a_python_callback_is_refused_before_loading(models, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(emit, "load_loss_function", lambda *a: pytest.fail("loaded"))
    check_fails(["--input", models / "callback", "--function", "loss", "--output",
                 tmp_path / "out"], capsys, "the loss function 'loss' holds ops that touch the "
                "host: PyFunc (calls Python); rewrite it anyway with --allow_host_ops", tmp_path)


def test_checkpoint_ops_count_in_the_loss_only(tmp_path):
    module = Clean()

    @tf.function(input_signature=SIGNATURE)
    def loss(x, y):
        tf.raw_ops.SaveV2(prefix=str(tmp_path / "ckpt"), tensor_names=["w"],
                          shape_and_slices=[""], tensors=[module.w])
        return module.loss(x, y)

    module.saving_loss = loss
    tf.saved_model.save(module, str(tmp_path / "m"))
    assert [op.op for op in host_ops.scan_saved_model(str(tmp_path / "m"), "saving_loss").loss
            ] == ["SaveV2"]
    assert host_ops.scan_saved_model(str(tmp_path / "m"), "loss") == host_ops.HostOpScan()
    assert host_ops.scan_saved_model(str(tmp_path / "m"), "nope") is None


def test_graph_def_scan_follows_the_loss_tensor():
    w = tf.Variable(tf.ones([8, 3]))

    @tf.function
    def loss(x, y):
        tf.io.write_file("/nonexistent/leak", tf.strings.as_string(tf.reduce_sum(x)))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, x @ w))

    concrete = loss.get_concrete_function(*SIGNATURE)
    graph_def = concrete.graph.as_graph_def()
    scan = host_ops.scan_graph_def(graph_def, concrete.outputs[0].name)
    assert [op.op for op in scan.loss] == ["WriteFile"] and scan.elsewhere == ()
    assert host_ops.scan_graph_def(graph_def, "x").loss == ()  # the input needs nothing


# -- output paths and flags: checked before any work ------------------------------------------

def _path_cases(tmp):
    (tmp / "full").mkdir()
    (tmp / "full" / "keep.txt").write_text("mine")
    (tmp / "empty").mkdir()
    (tmp / "file").write_text("")
    (tmp / "ro").mkdir()
    (tmp / "adir").mkdir()
    out = tmp / "out"
    return {
        "output exists": ([tmp / "full"], f"the output {tmp / 'full'} already exists; choose a "
                          "new directory"),
        "output exists, empty": ([tmp / "empty"], f"the output {tmp / 'empty'} already exists; "
                                 "choose a new directory"),
        "parent missing": ([tmp / "missing" / "out"], f"cannot write {tmp / 'missing' / 'out'}: "
                           f"its parent directory {tmp / 'missing'} does not exist"),
        "parent is a file": ([tmp / "file" / "out"], f"cannot write {tmp / 'file' / 'out'}: "
                             f"{tmp / 'file'} is not a directory"),
        "parent not writable": ([tmp / "ro" / "out"], f"cannot write {tmp / 'ro' / 'out'}: "
                                f"no write permission in {tmp / 'ro'}"),
        "report parent missing": ([out, "--report", tmp / "missing" / "r.json"],
                                  f"cannot write {tmp / 'missing' / 'r.json'}: its parent "
                                  f"directory {tmp / 'missing'} does not exist"),
        "dot parent not writable": ([out, "--dot", tmp / "ro" / "g.dot"],
                                    f"cannot write {tmp / 'ro' / 'g.dot'}: no write permission "
                                    f"in {tmp / 'ro'}"),
        "report is a directory": ([out, "--report", tmp / "adir"],
                                  f"cannot write {tmp / 'adir'}: it is a directory"),
        "report is the output": ([out, "--report", out],
                                 f"cannot write {out}: it is also the output directory"),
        "report is the dot": ([out, "--report", tmp / "same", "--dot", tmp / "same"],
                              f"cannot write {tmp / 'same'} twice; give each output its own "
                              "path"),
    }


PATH_CASES = ["output exists", "output exists, empty", "parent missing", "parent is a file",
              "parent not writable", "report parent missing", "dot parent not writable",
              "report is a directory", "report is the output", "report is the dot"]


@pytest.mark.parametrize("case", PATH_CASES)
def test_output_path_problems_come_before_any_work(models, tmp_path, capsys, monkeypatch,
                                                   no_work, case):
    argv, message = _path_cases(tmp_path)[case]
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: (
        False if os.fspath(p) == str(tmp_path / "ro") else real_access(p, mode, **kw)))
    check_fails(["--input", models / "clean", "--function", "loss", "--output", *argv], capsys,
                message, tmp_path)


FLAG_CASES = [
    (["--damping", "-1"], "--damping must be a finite number >= 0, got -1.0"),
    (["--learning_rate", "abc"], "--learning_rate must be a finite number > 0, got 'abc'"),
    (["--learning_rate", "0"], "--learning_rate must be a finite number > 0, got 0.0"),
    (["--momentum", "1"], "--momentum must be a finite number in [0, 1), got 1.0"),
    (["--cov_ema_decay", "nan"], "--cov_ema_decay must be a finite number in [0, 1), got nan"),
    (["--inverse_update_period", "0"],
     "--inverse_update_period must be an integer >= 1, or None, got 0"),
    (["--inverse_update_period", "2.5"],
     "--inverse_update_period must be an integer >= 1, or None, got 2.5"),
    (["--num_samples", "two"], "--num_samples must be an integer >= 1, got 'two'"),
    (["--num_burnin_steps", "-3"], "--num_burnin_steps must be an integer >= 0, got -3"),
    (["--norm_constraint", "-1"], "--norm_constraint must be a finite number >= 0, got -1.0"),
    (["--min_damping", "0.5"], "--min_damping must be at most --damping (0.1), got 0.5"),
    (["--damping", "1e-3", "--min_damping", "1e-2"],
     "--min_damping must be at most --damping (0.001), got 0.01"),
    (["--seed", "x"], "--seed must be an integer, got 'x'"),
    (["--max_factor_size", "-2"], "--max_factor_size must be an integer >= 1, or None, got -2"),
    (["--factor_block_size", "0"], "--factor_block_size must be an integer >= 1, or None, got 0"),
]


@pytest.mark.parametrize("flags,message", FLAG_CASES, ids=[" ".join(c[0]) for c in FLAG_CASES])
def test_bad_kfac_flags(models, tmp_path, capsys, no_work, flags, message):
    check_fails(["--input", models / "clean", "--function", "loss", "--output",
                 tmp_path / "out", *flags], capsys, message, tmp_path)
    check_fails(["--input", models / "clean", "--function", "loss", "--dry_run", *flags],
                capsys, message, tmp_path)


def test_good_flags_reach_the_optimizer(models, tmp_path):
    assert rewrite("--input", models / "clean", "--function", "loss", "--output",
                   tmp_path / "out", "--damping", "0", "--norm_constraint", "0",
                   "--momentum_type", "regular", "--inverse_update_period", "3",
                   "--max_factor_size", "0") == 0
    trained = tf.saved_model.load(str(tmp_path / "out"))
    assert float(trained.kfac.damping.numpy()) == 0.0


def test_factor_blocks_reach_the_exported_step(models, tmp_path):
    assert rewrite("--input", models / "clean", "--function", "loss", "--output",
                   tmp_path / "out", "--momentum_type", "regular", "--factor_block_size", "2") == 0
    trained = tf.saved_model.load(str(tmp_path / "out"))
    # the weight's 8 x 3 factors in blocks of at most 2 (A: 4 of 2, G: 2 of 2, one
    # padded), each a moving average and a cached inverse; the exported step runs with them
    saved = tf.train.list_variables(str(tmp_path / "out" / "variables" / "variables"))
    assert sorted(shape for _, shape in saved if len(shape) == 3) == [[2, 2, 2]] * 2 + [
        [4, 2, 2]] * 2
    x = tf.random.stateless_normal([5, 8], seed=[3, 4])
    y = tf.constant([0, 1, 2, 0, 1])
    losses = [float(trained.kfac_step(x, y)) for _ in range(3)]
    assert np.all(np.isfinite(losses)) and int(trained.kfac.skipped_steps.numpy()) == 0


# -- a full disk: nothing left behind ----------------------------------------------------------

def _enospc(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def test_full_disk_while_saving_the_model(models, tmp_path, capsys, monkeypatch):
    def save(module, path, **kwargs):
        os.makedirs(os.path.join(path, "variables"))
        open(os.path.join(path, "saved_model.pb"), "wb").close()
        raise _enospc(path)

    monkeypatch.setattr(tf.saved_model, "save", save)
    (tmp_path / "report.json").write_text("old")
    check_fails(["--input", models / "clean", "--function", "loss", "--output", tmp_path / "out",
                 "--report", tmp_path / "report.json", "--dot", tmp_path / "g.dot"], capsys,
                f"cannot write {tmp_path / 'out'}: No space left on device", tmp_path)


@pytest.mark.parametrize("failing", ["report.json", "g.dot", "kfac_registration.json"])
def test_full_disk_while_writing_a_report(models, tmp_path, capsys, monkeypatch, failing):
    real = emit.write_text

    def write_text(path, text):
        if os.path.basename(path).startswith((failing, "." + failing)):
            with open(path, "w") as f:
                f.write(text[:10])
            raise _enospc(path)
        real(path, text)

    monkeypatch.setattr(emit, "write_text", write_text)
    (tmp_path / "report.json").write_text("old")
    target = tmp_path / ("out" if failing == "kfac_registration.json" else failing)
    check_fails(["--input", models / "clean", "--function", "loss", "--output", tmp_path / "out",
                 "--report", tmp_path / "report.json", "--dot", tmp_path / "g.dot"], capsys,
                f"cannot write {target}: No space left on device", tmp_path)
