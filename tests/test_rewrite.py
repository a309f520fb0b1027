"""``kfac-rewrite``: a Keras model's SavedModel rewritten into one that trains
itself with K-FAC, run by stock TensorFlow in a fresh process that cannot
import kfac_graph, against ``kg.KFAC`` in this process; and every bad input
named by the tool's contract (exit status 2, one line, nothing written)."""
import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

import kfac_graph as kg
from kfac_graph import emit
from tools import kfac_rewrite
from fresh_process import NO_LIBRARY

STEPS, SAVE_AT, BATCH = 20, 10, 32
SIGNATURE = [tf.TensorSpec([None, 8, 8, 1], tf.float64), tf.TensorSpec([None], tf.int32)]

# Run by a fresh interpreter: kfac_graph is neither importable nor imported.
RUNNER = NO_LIBRARY + textwrap.dedent("""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    here = sys.argv[1]
    import numpy as np
    import tensorflow as tf

    data = np.load(os.path.join(here, "data.npz"))
    model = tf.saved_model.load(os.path.join(here, "rewritten"))
    out = {"pxg": [g.numpy() for g in model.per_example_gradients(data["x0"], data["y0"])],
           "start": model.kfac.iterations.numpy()}
    losses = []
    for i in range(%(steps)d):
        if i == %(save_at)d:
            tf.saved_model.save(model, os.path.join(here, "resaved"))
        losses.append(model.kfac_step(data[f"x{i}"], data[f"y{i}"]).numpy())
    out.update(losses=np.array(losses), predict=model.predict(data["x0"]).numpy(),
               iterations=model.kfac.iterations.numpy(), damping=model.kfac.damping.numpy(),
               refreshed=model.update_inverses().numpy())
    resumed = tf.saved_model.load(os.path.join(here, "resaved"))
    out["resumed_start"] = resumed.kfac.iterations.numpy()
    out["resumed_losses"] = np.array([resumed.kfac_step(data[f"x{i}"], data[f"y{i}"]).numpy()
                                      for i in range(%(save_at)d, %(steps)d)])
    out["resumed_predict"] = resumed.predict(data["x0"]).numpy()
    assert not any(m.split(".")[0] == "kfac_graph" for m in sys.modules)
    np.savez(os.path.join(here, "result.npz"), **{k: v for k, v in out.items() if k != "pxg"},
             **{f"pxg{i}": g for i, g in enumerate(out["pxg"])})
""") % {"steps": STEPS, "save_at": SAVE_AT}


def small_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((8, 8, 1), dtype="float64"),
                             keras.layers.Conv2D(4, 3, activation="relu", dtype="float64"),
                             keras.layers.Flatten(dtype="float64"),
                             keras.layers.Dense(3, dtype="float64")])


class Trainable(tf.Module):
    """What a user saves: the model, a loss and a prediction function."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    @tf.function(input_signature=SIGNATURE)
    def loss(self, x, y):
        logits = self.model(x)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    @tf.function(input_signature=SIGNATURE[:1])
    def predict(self, x):
        return self.model(x)


def batches():
    """A learnable task: the class is the argmax of a fixed projection of x."""
    rng = np.random.default_rng(0)
    projection = rng.normal(size=(64, 3))
    out = {}
    for i in range(STEPS):
        x = rng.normal(size=(BATCH, 8, 8, 1))
        out[f"x{i}"], out[f"y{i}"] = x, np.argmax(x.reshape(BATCH, 64) @ projection, 1).astype(
            np.int32)
    return out


def rewrite(argv) -> int:
    return kfac_rewrite.main(["kfac-rewrite", *argv])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("rewrite")
    module = Trainable(small_model())
    tf.saved_model.save(module, str(root / "input"))
    return root, module


@pytest.fixture(scope="module")
def run_result(saved):
    """Rewrites the SavedModel, then trains it in a fresh interpreter."""
    root, _ = saved
    rc = rewrite(["--input", str(root / "input"), "--function", "loss",
                  "--output", str(root / "rewritten"), "--report", str(root / "report.json")])
    assert rc == 0
    np.savez(root / "data.npz", **batches())
    (root / "runner.py").write_text(RUNNER)
    done = subprocess.run([sys.executable, str(root / "runner.py"), str(root)], cwd=str(root),
                          capture_output=True, text=True, timeout=300, check=False,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(root / "result.npz"))


def test_stock_tensorflow_trains_like_kfac_in_process(saved, run_result):
    """20 steps of the rewritten model's ``kfac_step`` in a process without
    kfac_graph equal 20 ``kg.KFAC`` steps on the same model and data."""
    _, module = saved
    data = batches()
    loss_fn = kg.auto_register(lambda x, y: module.loss(x, y))
    pxg = kg.per_example_gradients(loss_fn, data["x0"], data["y0"])
    optimizer = kg.KFAC(loss_fn)
    losses = [optimizer.step(data[f"x{i}"], data[f"y{i}"]).numpy() for i in range(STEPS)]
    got = run_result
    for i, want in enumerate(pxg):
        np.testing.assert_allclose(got[f"pxg{i}"], want.numpy(), rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
    assert np.mean(got["losses"][-5:]) < 0.7 * got["losses"][0], got["losses"]
    np.testing.assert_allclose(got["predict"], module.predict(data["x0"]).numpy(), rtol=1e-5)
    assert int(got["start"]) == 0 and int(got["iterations"]) == STEPS == int(got["refreshed"])
    np.testing.assert_allclose(got["damping"], optimizer.damping.numpy(), rtol=1e-5)


def test_resaved_output_resumes_with_the_same_state(run_result):
    got = run_result
    assert int(got["resumed_start"]) == SAVE_AT
    np.testing.assert_array_equal(got["resumed_losses"], got["losses"][SAVE_AT:])
    np.testing.assert_array_equal(got["resumed_predict"], got["predict"])


def test_output_keeps_functions_report_and_xla_attribute(saved, run_result):
    root, _ = saved
    out = root / "rewritten"
    report = json.loads((root / "report.json").read_text())
    assert report == json.loads((out / emit.REPORT_PATH).read_text())
    assert [layer["kind"] for layer in report["layers"]] == ["conv2d", "dense"]
    assert report["loss"]["kind"] == "categorical"
    assert [v["shape"] for v in report["layers"][0]["variables"]] == [[3, 3, 1, 4], [4]]
    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((out / "saved_model.pb").read_bytes())
    library = proto.meta_graphs[0].graph_def.library.function
    compiled = [f for f in library if f.attr["_XlaMustCompile"].b]
    assert compiled, "no function carries the XLA compile attribute"
    names = {c.local_name for c in proto.meta_graphs[0].object_graph_def.nodes[0].children}
    assert {"kfac_step", "per_example_gradients", "update_inverses", "loss", "predict",
            "model", "kfac"} <= names


# -- bad input: status 2, one line, nothing written ---------------------------------------

def check_fails(argv, capsys, match, parent):
    before = sorted(os.listdir(parent))
    assert rewrite(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kfac-rewrite: error: "), err
    assert match in err[0], err[0]
    assert sorted(os.listdir(parent)) == before


def test_missing_input_directory(tmp_path, capsys):
    check_fails(["--input", str(tmp_path / "nope"), "--function", "loss",
                 "--output", str(tmp_path / "out")], capsys, "no SavedModel directory", tmp_path)


def test_input_that_is_not_a_saved_model(tmp_path, capsys):
    (tmp_path / "plain").mkdir()
    check_fails(["--input", str(tmp_path / "plain"), "--function", "loss",
                 "--output", str(tmp_path / "out")], capsys, "is not a SavedModel", tmp_path)


def test_unknown_function(saved, tmp_path, capsys):
    check_fails(["--input", str(saved[0] / "input"), "--function", "train",
                 "--output", str(tmp_path / "out")], capsys,
                "no tf.function 'train'; it has: loss, predict", tmp_path)


def test_function_without_input_signature(tmp_path, capsys):
    module = tf.Module()
    module.w = tf.Variable(tf.ones([8, 3]))
    module.loss = tf.function(lambda x: tf.reduce_mean(tf.square(x @ module.w)))
    module.loss(tf.ones([2, 8]))
    tf.saved_model.save(module, str(tmp_path / "input"))
    check_fails(["--input", str(tmp_path / "input"), "--function", "loss",
                 "--output", str(tmp_path / "out")], capsys, "without an input signature",
                tmp_path)


def test_loss_the_pass_cannot_read(tmp_path, capsys):
    module = tf.Module()
    module.w = tf.Variable(tf.ones([8, 3]))
    module.loss = tf.function(lambda x: tf.reduce_max(tf.sin(x @ module.w)),
                              input_signature=[tf.TensorSpec([None, 8])])
    tf.saved_model.save(module, str(tmp_path / "input"))
    check_fails(["--input", str(tmp_path / "input"), "--function", "loss",
                 "--output", str(tmp_path / "out")], capsys,
                "cannot read a loss through op 'StatefulPartitionedCall/Max' (Max); name its kind "
                "with --loss", tmp_path)


def test_output_that_exists(saved, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    check_fails(["--input", str(saved[0] / "input"), "--function", "loss",
                 "--output", str(tmp_path / "out")], capsys, "already exists", tmp_path)
    assert os.listdir(tmp_path / "out") == ["keep.txt"]


@pytest.mark.parametrize("where", ["missing parent", "parent is a file"])
def test_output_that_cannot_be_written(saved, tmp_path, capsys, where):
    (tmp_path / "file").write_text("")
    parent = tmp_path / ("missing" if where == "missing parent" else "file")
    check_fails(["--input", str(saved[0] / "input"), "--function", "loss",
                 "--output", str(parent / "out")], capsys, "cannot write", tmp_path)


def test_failure_while_saving_leaves_nothing(saved, tmp_path, capsys, monkeypatch):
    def broken_save(*args, **kwargs):
        os.makedirs(args[1])
        open(os.path.join(args[1], "saved_model.pb"), "w").close()
        raise tf.errors.ResourceExhaustedError(None, None, "disk full")

    monkeypatch.setattr(tf.saved_model, "save", broken_save)
    check_fails(["--input", str(saved[0] / "input"), "--function", "loss",
                 "--output", str(tmp_path / "out")], capsys, "disk full", tmp_path)


def test_bad_flags(saved, tmp_path, capsys):
    check_fails(["--function", "loss", "--output", str(tmp_path / "out")], capsys,
                "--input is required", tmp_path)
    check_fails(["--input", str(saved[0] / "input"), "--function", "loss"], capsys,
                "--output is required", tmp_path)
    check_fails(["--input", str(saved[0] / "input"), "--function", "loss", "--output",
                 str(tmp_path / "out"), "--momentum_type", "nesterov"], capsys,
                "momentum_type", tmp_path)


def test_dry_run_prints_and_writes_nothing(saved, tmp_path, capsys):
    assert rewrite(["--input", str(saved[0] / "input"), "--function", "loss", "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "conv2d" in out and "dense" in out and "categorical" in out
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("suffix", [".pb", ".pbtxt"])
def test_dry_run_of_a_graph_def(tmp_path, capsys, suffix):
    w = tf.Variable(tf.ones([8, 3]))
    fn = tf.function(lambda x, y: tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(y, x @ w)))
    concrete = fn.get_concrete_function(tf.TensorSpec([4, 8]), tf.TensorSpec([4], tf.int32))
    tf.io.write_graph(concrete.graph.as_graph_def(add_shapes=True), str(tmp_path),
                      "g" + suffix, as_text=suffix == ".pbtxt")
    before = sorted(os.listdir(tmp_path))
    loss = concrete.outputs[0].name
    assert rewrite(["--input", str(tmp_path / ("g" + suffix)), "--function", loss,
                    "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "dense" in out and "categorical" in out
    assert sorted(os.listdir(tmp_path)) == before
    check_fails(["--input", str(tmp_path / ("g" + suffix)), "--function", loss, "--output",
                 str(tmp_path / "out")], capsys, "can only be inspected with --dry_run", tmp_path)


def test_console_script_exit_status(tmp_path, monkeypatch, capsys):
    """The console script's entry point (``kfac-rewrite=tools.kfac_rewrite:run``)
    exits with status 2, in process: CI runs the installed script itself."""
    monkeypatch.setattr(sys, "argv", ["kfac-rewrite", "--input", str(tmp_path / "nope"),
                                      "--function", "loss", "--output", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as done:
        kfac_rewrite.run()
    assert done.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"kfac-rewrite: error: no SavedModel directory at {tmp_path / 'nope'}")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rank", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_keras_grouped_convolution_is_rewritten(tmp_path, rank, capsys):
    """Keras compiles a grouped Conv2D (Conv3D) in a function of its own
    (XLA); the rewritten model trains it and gives its per-example gradients.
    The save that tries custom gradients first prints no traceback."""
    layer = keras.layers.Conv2D if rank == 2 else keras.layers.Conv3D
    shape = (6, 6, 4) if rank == 2 else (4, 4, 4, 4)
    model = keras.Sequential([keras.Input(shape),
                              layer(8, 3, groups=2, padding="same", activation="tanh"),
                              keras.layers.Flatten(), keras.layers.Dense(3)])

    class Grouped(tf.Module):
        def __init__(self):
            self.model = model

        @tf.function(input_signature=[tf.TensorSpec([None, *shape]),
                                      tf.TensorSpec([None], tf.int32)])
        def loss(self, x, y):
            logits = self.model(x)
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    tf.saved_model.save(Grouped(), str(tmp_path / "input"))
    assert rewrite(["--input", str(tmp_path / "input"), "--function", "loss",
                    "--output", str(tmp_path / "out")]) == 0
    assert "Traceback" not in capsys.readouterr().err
    loaded = tf.saved_model.load(str(tmp_path / "out"))
    x = tf.random.stateless_normal([4, *shape], [1, 2])
    y = tf.constant([0, 1, 2, 1])
    assert [g.shape for g in loaded.per_example_gradients(x, y)][:2] == [
        [4, *(3,) * rank, 2, 8], [4, 8]]
    losses = [float(loaded.kfac_step(x, y)) for _ in range(3)]
    assert losses[-1] < losses[0], losses


SWISH_CHECK = textwrap.dedent("""
    import os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np
    import tensorflow as tf
    root = sys.argv[1]
    models = [tf.saved_model.load(os.path.join(root, name)) for name in ("input", "out")]
    x = tf.constant(np.random.default_rng(0).normal(size=(4, 6)), tf.float32)
    y = tf.constant([0, 1, 2, 0])
    grads = []
    for m in models:
        with tf.GradientTape() as tape:
            loss = m.loss(x, y)
        variables = sorted(tape.watched_variables(), key=lambda v: v.name)
        grads.append([g.numpy() for g in tape.gradient(loss, variables)])
    print(max(float(np.max(np.abs(a - b))) for a, b in zip(*grads)))
""")


def test_the_rewritten_loss_keeps_its_custom_gradients(tmp_path):
    """Keras's swish is a ``tf.custom_gradient``. The output was saved
    without custom gradients, so its own ``loss`` (the input's function)
    could not be differentiated once loaded ("No gradient defined for
    operation IdentityN"), and in a process that had loaded the input first
    it took the input's gradient functions, numbered alike. Now, in a fresh
    process that loads the input and then the output, both losses have the
    same gradient."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="swish"),
                              keras.layers.Dense(3)])

    class Trainable(tf.Module):
        def __init__(self, model):
            self.model = model

        @tf.function(input_signature=[tf.TensorSpec([None, 6], tf.float32),
                                      tf.TensorSpec([None], tf.int32)])
        def loss(self, x, y):
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                y, self.model(x)))

    tf.saved_model.save(Trainable(model), str(tmp_path / "input"))
    assert rewrite(["--input", str(tmp_path / "input"), "--function", "loss",
                    "--output", str(tmp_path / "out")]) == 0
    (tmp_path / "check.py").write_text(SWISH_CHECK)
    done = subprocess.run([sys.executable, str(tmp_path / "check.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) < 1e-6
