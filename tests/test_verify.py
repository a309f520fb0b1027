"""``kg.verify`` and ``kfac-graph verify``: it passes on correct rules, it
catches a broken one and names its layers, and it skips (visibly) what
cannot be compared."""
import dataclasses
import time
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import builtin_example
from kfac_graph.per_example import DenseRule, default_registry
from tools import kfac_register


@dataclasses.dataclass(frozen=True)
class ScaledRule:
    """A deliberately wrong rule: ``inner``'s per-example gradients and norms
    times ``factor``."""

    inner: Any
    factor: float

    def per_example_grads(self, uses, spec):
        return [self.factor * g for g in self.inner.per_example_grads(uses, spec)]

    def squared_norms(self, uses, spec):
        return self.factor ** 2 * self.inner.squared_norms(uses, spec)


BROKEN = default_registry().with_rule("dense", ScaledRule(DenseRule(), 2.0))


@pytest.fixture(scope="module")
def cnn():
    _, loss_fn, args = builtin_example.small_cnn()
    return loss_fn, args


def _sequence_model(dtype="float64"):
    """Embedding, layer norm, a dense layer at every position, mean over
    positions, dense logits; no batch statistics, a [B, K] output."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((5,), dtype="int32"),
        keras.layers.Embedding(12, 6, dtype=dtype),
        keras.layers.LayerNormalization(dtype=dtype),
        keras.layers.Dense(8, activation="tanh", dtype=dtype),
        keras.layers.GlobalAveragePooling1D(dtype=dtype),
        keras.layers.Dense(3, dtype=dtype),
    ])

    @kg.auto_register
    def loss_fn(ids, labels):
        logits = model(ids, training=False)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))

    rng = np.random.default_rng(2)
    ids = tf.constant(rng.integers(0, 12, (6, 5)), tf.int32)
    labels = tf.constant(rng.integers(0, 3, 6), tf.int32)
    return loss_fn, (ids, labels)


def _sum_mlp():
    """Raw variables, tanh MLP, a summed squared error (normal, sum)."""
    rng = np.random.default_rng(3)
    w1 = tf.Variable(rng.normal(size=(4, 5)), name="w1")
    b1 = tf.Variable(rng.normal(size=(5,)), name="b1")
    w2 = tf.Variable(rng.normal(size=(5, 2)), name="w2")

    def loss_fn(x, y):
        z = tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2)
        return tf.reduce_sum(tf.square(y - z))

    return loss_fn, (tf.constant(rng.normal(size=(7, 4))), tf.constant(rng.normal(size=(7, 2))))


def test_builtin_cnn_passes_and_skips_one_example_visibly(cnn):
    report = kg.verify(*([cnn[0]] + list(cnn[1])))
    assert report.passed, report.table()
    assert [row.kind for row in report.rows] == [
        "conv2d", "scale_and_shift", "depthwise_conv2d", "conv2d", "dense"]
    assert report.reduction == "mean" and report.dtype == "float32"
    for row in report.rows:
        assert row.check("mean").status == "pass"
        assert row.check("norms").status == "pass"
        # training-mode batch norm couples the examples: skipped, never passed
        one = row.check("one-example")
        assert one.status == "skipped" and one.note == "couples examples"
    assert report.model.check("norms").status == "pass"
    table = report.table()
    assert "skipped: couples examples" in table and table.splitlines()[-1].startswith("PASSED")
    assert report.rows[4].rule == "DenseRule(outer)"


@pytest.mark.parametrize("mode", ["exact", "empirical"])
def test_sequence_model_passes_every_check(mode):
    loss_fn, args = _sequence_model()
    report = kg.verify(loss_fn, *args, estimation_mode=mode, examples=3)
    assert report.passed, report.table()
    assert report.dtype == "float64" and report.rtol == 1e-8
    assert [row.kind for row in report.rows] == [
        "embedding", "scale_and_shift", "dense", "dense"]
    assert len(report.examples) == 3
    for row in report.rows:
        assert [c.status for c in row.checks] == ["pass"] * 4, row
        assert row.worst_error < 1e-8
    assert report.counts == {"pass": 17, "fail": 0, "skipped": 0}


def test_verify_restores_the_variables_and_is_seeded():
    loss_fn, args = _sequence_model()
    reg = loss_fn.registration(*args)
    before = [v.numpy().copy() for v in reg.variables]
    first = kg.verify(loss_fn, *args, seed=5)
    again = kg.verify(loss_fn, *args, seed=5)
    assert first.examples == again.examples
    for v, b in zip(reg.variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


def test_a_loss_that_assigns_a_variable_it_reads_is_checked_from_one_state():
    """Keras's SpectralNormalization in training mode divides its kernel by
    its spectral norm and advances its power vector on every call, so each
    run of the loss sees another kernel. Every check runs from the state
    ``verify`` was called with (it failed its mean check by 1.6e-2 when the
    runs followed one another), and the state is restored after."""
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(6, dtype="float64")
    model = keras.Sequential([keras.Input((5,), dtype="float64"),
                              keras.layers.SpectralNormalization(dense, dtype="float64"),
                              keras.layers.Activation("tanh", dtype="float64"),
                              keras.layers.Dense(4, dtype="float64")])

    @kg.auto_register
    def loss_fn(x, y):
        logits = model(x, training=True)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    rng = np.random.default_rng(0)
    args = (tf.constant(rng.normal(size=(6, 5))), tf.constant([0, 1, 2, 3, 0, 1]))
    before = [v.numpy().copy() for v in model.variables]
    loss_fn(*args)
    assert np.abs(dense.kernel.numpy() - before[0]).max() > 1e-2  # each run changes it
    for v, b in zip(model.variables, before):
        v.assign(b)
    report = kg.verify(loss_fn, *args, estimation_mode="exact", examples=3)
    assert report.passed, report.table()
    assert report.counts == {"pass": 9, "fail": 0, "skipped": 0}
    for v, b in zip(model.variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


def test_sum_loss_raw_variables():
    loss_fn, args = _sum_mlp()
    report = kg.verify(loss_fn, *args, estimation_mode="exact", examples=7)
    assert report.passed, report.table()
    assert report.reduction == "sum" and report.examples == tuple(range(7))
    assert [row.check("sum").status for row in report.rows] == ["pass"] * 2


@pytest.mark.parametrize("batch", [7, 5])
def test_a_sum_over_a_constant_the_batch_size_divides(batch):
    """``sum(l) / 7.0`` on a batch of 7 reads as a mean over the batch (the
    constant taken for its size, as ``/ BATCH_SIZE`` is written), and on a
    batch of one as ``l / 7``: the one-example check failed by 7 on correct
    gradients. Its reference is scaled by the two readings' ratio now, with
    a note. On a batch of 5 the loss is a sum scaled by 1/7 either way."""
    sum_fn, (x, y) = _sum_mlp()
    x, y = x[:batch], y[:batch]
    report = kg.verify(lambda x, y: sum_fn(x, y) / 7.0, x, y, examples=batch)
    assert report.passed, report.table()
    assert [row.check("one-example").status for row in report.rows] == ["pass"] * 2
    assert any("each one-example reference is scaled by 7" in n
               for n in report.notes) == (batch == 7), report.notes


def test_broken_rule_fails_and_the_table_names_the_dense_layers():
    loss_fn, args = _sequence_model()
    report = kg.verify(loss_fn, *args, rules=BROKEN)
    assert not report.passed
    dense = [row for row in report.rows if row.kind == "dense"]
    assert len(dense) == 2
    assert {row.name for row in report.failures} == {row.name for row in dense}
    for row in dense:
        assert row.rule == "ScaledRule"
        assert row.check("mean").status == "fail"
        assert row.check("one-example").status == "fail"
        # |2 m - m| relative to max(|m|, mean_i |g_i|): well above any tolerance
        assert 0.05 < row.check("mean").error <= 1.0
    for row in report.rows:
        if row.kind != "dense":
            assert row.passed, row
    table = report.table()
    last = table.splitlines()[-1]
    assert last.startswith("FAILED")
    for row in dense:
        assert row.name in last
        line = next(line for line in table.splitlines() if row.name in line and "FAIL" in line)
        assert line.rstrip().endswith("FAIL")


def test_broken_rule_on_the_cnn_and_a_sum_loss(cnn):
    report = kg.verify(cnn[0], *cnn[1], rules=BROKEN)
    assert [row.kind for row in report.failures] == ["dense"]
    loss_fn, args = _sum_mlp()
    report = kg.verify(loss_fn, *args, rules=BROKEN)
    assert len(report.failures) == 2 and all(not r.check("sum").passed for r in report.failures)


@dataclasses.dataclass(frozen=True)
class WrongNormRule:
    """Right gradients, squared norms off by 10%."""

    inner: Any

    def per_example_grads(self, uses, spec):
        return self.inner.per_example_grads(uses, spec)

    def squared_norms(self, uses, spec):
        return 1.1 * self.inner.squared_norms(uses, spec)


def test_a_wrong_norm_rule_fails_only_the_norms():
    loss_fn, args = _sum_mlp()
    rules = default_registry().with_rule("dense", WrongNormRule(DenseRule()))
    report = kg.verify(loss_fn, *args, rules=rules)
    assert len(report.failures) == 3  # both layers and the whole model
    for row in report.rows:
        assert [c.status for c in row.checks] == ["pass", "pass", "fail"]
        assert row.check("norms").error == pytest.approx(np.sqrt(1.1) - 1, rel=1e-6)
    assert not report.model.passed


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_couples_examples_only_in_training(training):
    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((4, 4, 2)), keras.layers.Conv2D(3, 2),
                              keras.layers.BatchNormalization(), keras.layers.Flatten(),
                              keras.layers.Dense(2)])

    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, model(x, training=training)))

    args = (tf.random.stateless_normal([5, 4, 4, 2], seed=[1, 2]), tf.constant([0, 1, 1, 0, 1]))
    report = kg.verify(loss_fn, *args)
    assert report.passed, report.table()
    statuses = {row.check("one-example").status for row in report.rows}
    assert statuses == ({"skipped"} if training else {"pass"})
    assert any("couples the examples" in note for note in report.notes) == training


def test_arguments_without_a_batch_axis_pass_through_and_a_batch_of_one_may_fail():
    rng = np.random.default_rng(7)
    w = tf.Variable(rng.normal(size=(3, 2)), name="w")
    x = tf.constant(rng.normal(size=(4, 3)))
    y = tf.constant([0, 1, 1, 0])

    def scaled(x, y, temperature):
        logits = tf.matmul(x, w) / temperature
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    report = kg.verify(scaled, x, y, tf.constant(1.5, tf.float64))
    assert report.passed and report.rows[0].check("one-example").status == "pass"

    def fixed_batch(x, y):
        logits = tf.reshape(tf.matmul(x, w), [4, 2])
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    report = kg.verify(fixed_batch, x, y)
    one = report.rows[0].check("one-example")
    assert one.status == "skipped" and one.note == "fn fails on a batch of one"
    assert report.passed and any("batch of one" in note for note in report.notes)


def test_bad_estimation_mode():
    loss_fn, args = _sum_mlp()
    with pytest.raises(ValueError, match="estimation_mode"):
        kg.verify(loss_fn, *args, estimation_mode="sampled")


def test_kfac_graph_verify_exits_0_and_prints_the_table(capsys):
    status = kfac_register.main(["kfac-graph", "verify", "--batch_size", "8"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.startswith("verify: built-in example")
    assert "small_cnn_1/logits_1" in out and "PASSED" in out


def test_kfac_graph_verify_of_a_saved_model(tmp_path, capsys):
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(2)])

    class Saved(tf.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        @tf.function(input_signature=[tf.TensorSpec([None, 3]), tf.TensorSpec([None], tf.int32)])
        def loss(self, x, y):
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                y, self.model(x)))

        @tf.function(input_signature=[tf.TensorSpec([None, None])])
        def ragged(self, x):
            return tf.reduce_sum(self.model(x[:, :3]))

    tf.saved_model.save(Saved(), str(tmp_path / "m"))
    argv = ["kfac-graph", "verify", "--saved_model", str(tmp_path / "m"), "--function", "loss",
            "--batch_size", "5", "--estimation_mode", "exact"]
    assert kfac_register.main(argv) == 0
    out = capsys.readouterr().out
    assert "batch 5, mean loss" in out and "PASSED" in out and "fisher" in out
    argv[5] = "ragged"
    assert kfac_register.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kfac-graph: error: cannot make inputs") and err.count("\n") == 1


def test_kfac_graph_verify_exits_1_on_a_failure(capsys, monkeypatch):
    real = kg.verify
    monkeypatch.setattr(kg, "verify", lambda fn, *a, **k: real(fn, *a, rules=BROKEN, **k))
    assert kfac_register.main(["kfac-graph", "verify", "--batch_size", "4"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "small_cnn_1/logits_1 (mean" in out


def test_exact_fisher_of_convolutions_joined_by_a_concat():
    """DeepLabV3's pyramid pooling and SegFormer's fusion: convolutions side
    by side, concatenated, then a 1x1 convolution. TensorFlow's oneDNN
    rewrites (on by default on the CPU) fail the double backward pass pruned
    to one branch's kernel ("input depth must be evenly divisible by filter
    depth"), so the Fisher check raised; it now takes such a layer's
    products through every variable."""
    keras.utils.set_random_seed(0)
    layers = keras.layers
    a, b = layers.Conv2D(4, 1, use_bias=False), layers.Conv2D(4, 1, use_bias=False)
    fuse, head = layers.Conv2D(2, 1, use_bias=False), layers.Dense(3)

    @kg.auto_register
    def loss_fn(x, y):
        h = fuse(tf.concat([a(x), b(x)], -1))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, head(tf.reduce_mean(h, [1, 2]))))

    x = tf.random.stateless_normal([3, 4, 4, 3], seed=[0, 2])
    report = kg.verify(loss_fn, x, tf.constant([0, 1, 2]), estimation_mode="exact",
                       examples=2, directions=1)
    assert report.passed and all(row.check("fisher").status == "pass" for row in report.rows), (
        report.table())


@pytest.mark.slow
def test_resnet50():
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)

    @kg.auto_register
    def loss_fn(x, y):
        logits = model(x, training=False)
        return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, logits))

    x = tf.random.stateless_normal([4, 64, 64, 3], seed=[0, 1])
    y = tf.constant([0, 3, 5, 9])
    loss_fn.registration(x, y)
    start = time.perf_counter()
    report = kg.verify(loss_fn, x, y)
    print(f"\nverify on ResNet50 64x64, batch 4: {time.perf_counter() - start:.1f} s "
          "(after registration)")
    print(report.table())
    assert report.passed, report.table()
    assert len(report.rows) == 107
