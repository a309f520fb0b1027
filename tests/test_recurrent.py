"""Recurrent layers and layers inside loops: the pass unrolls a functional
``While`` with a static trip count (``passes/unroll.py``), so a Keras LSTM,
GRU or SimpleRNN with its default ``unroll=False``, a raw ``tf.scan`` or
``tf.while_loop`` registers its cell's kernels as dense layers with T uses
and its biases as shifts (GRU's split bias and sliced kernels as parts of
their variables, ``passes/variable_parts.py``). Shown in float64 against
brute force: per-example gradients and norms against one-example tapes,
full Fisher blocks against the Jacobian Fisher, kg.verify; K-FAC lowers the
loss eagerly and under XLA, DP-SGD runs. A loop the pass cannot unroll
keeps its variables generic with a reason naming the loop, and their
per-example gradients are a one-line error, never zeros."""
import operator
import os
import subprocess
import sys

import hypothesis
from hypothesis import strategies as st
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
import passes
from fisher_reference import brute_fisher
from kfac_graph import emit
from kfac_graph.taps import LayerTaps
from passes import unroll
from per_example_reference import one_example_loop

L = keras.layers
B, T, D, U = 3, 5, 3, 4
RTOL = 1e-6
SETTINGS = hypothesis.settings(max_examples=6, deadline=None, derandomize=True, database=None,
                               suppress_health_check=list(hypothesis.HealthCheck))


@pytest.fixture(autouse=True)
def _float64():
    """Keras layers in float64 (floatx alone does not change a global policy
    already made; conftest puts both back after the test)."""
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.standard_normal((B, T, D))), tf.constant(rng.integers(0, 2, B)))


def _keras(*layers, shape=(T, D), classes=2):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input(shape), *layers, L.Dense(classes)])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    return model, loss_fn


def _assert_per_example_exact(loss_fn, args):
    reg = loss_fn.registration(*args)
    want = one_example_loop(loss_fn, args, reg.variables)
    got = kg.per_example_gradients(loss_fn, *args)
    for v, g, w in zip(reg.variables, got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=RTOL, atol=1e-12, err_msg=v.name)
    norms = np.sqrt(sum(np.sum(np.reshape(w.numpy(), [B, -1]) ** 2, 1) for w in want))
    np.testing.assert_allclose(kg.per_example_gradient_norms(loss_fn, *args).numpy(), norms,
                               rtol=RTOL)


CELLS = {
    "lstm": (lambda: L.LSTM(U), ["dense"]),  # [x, h] @ [kernel; recurrent_kernel] + bias
    "gru": (lambda: L.GRU(U), ["dense", "scale_and_shift", "dense"]),  # bias [2, 3u], split
    "gru_reset_before": (lambda: L.GRU(U, reset_after=False), ["dense", "dense"]),  # sliced kernel
    "simple_rnn": (lambda: L.SimpleRNN(U), ["dense"]),  # (x @ kernel + bias) + h @ recurrent
    "lstm_no_bias": (lambda: L.LSTM(U, use_bias=False), ["dense"]),  # x @ kernel + h @ recurrent
    # every gate's slice of the kernels and biases
    "lstm_implementation_1": (lambda: L.LSTM(U, implementation=1),
                              ["dense", "scale_and_shift", "dense"]),
    "gru_implementation_1": (lambda: L.GRU(U, implementation=1),
                             ["dense", "dense", "scale_and_shift"]),
}
SLOW_CELLS = ("simple_rnn", "lstm_no_bias", "lstm_implementation_1", "gru_implementation_1")


@pytest.mark.parametrize("cell", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CELLS
                                  else c for c in CELLS])
def test_keras_cell_in_a_loop_is_exact(cell):
    make, kinds = CELLS[cell]
    _, loss_fn = _keras(make())
    args = _data()
    reg = loss_fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == kinds + ["dense"], reg.summary()
    assert all(layer.uses % T == 0 for layer in reg.layers[:-1]), reg.summary()
    assert not any("iteration_" in layer.name for layer in reg.layers)
    _assert_per_example_exact(loss_fn, args)


def test_lstm_verifies_and_its_full_blocks_equal_the_jacobian_fisher():
    model, loss_fn = _keras(L.LSTM(2), shape=(3, 2))
    x = tf.random.stateless_normal([B, 3, 2], [1, 2], dtype=tf.float64)
    args = (x, tf.constant([0, 1, 1]))
    reg = loss_fn.registration(*args)
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact",
                             approximations={layer.name: "full" for layer in reg.layers})
    est.update(*args)

    def softmax_fisher(z):
        p = tf.nn.softmax(z)
        return tf.linalg.diag(p) - p[:, :, None] * p[:, None, :]

    for layer, block in zip(reg.layers, est.blocks):
        want = brute_fisher(lambda p, xx: model(xx), list(layer.variables), x, softmax_fisher)
        np.testing.assert_allclose(block.full_matrix().numpy(), want, rtol=RTOL,
                                   atol=RTOL * np.abs(want).max(), err_msg=layer.name)
    report = kg.verify(loss_fn, *args, estimation_mode="exact")
    assert report.passed, report.table()


# under XLA the whole step's compilation takes ~12 s on 2 CPU cores (a dense
# model's too): slow
@pytest.mark.parametrize("jit_compile", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["eager", "xla"])
def test_kfac_and_dpsgd_train_an_lstm(jit_compile):
    _, loss_fn = _keras(L.LSTM(U))
    args = _data()
    opt = kg.KFAC(loss_fn, learning_rate=0.1, damping=1e-2, jit_compile=jit_compile)
    losses = [float(opt.step(*args)) for _ in range(5)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses
    if not jit_compile:
        dp = kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0)
        assert np.isfinite(float(dp.step(*args)))


def _raw_rnn(loop):
    rng = np.random.default_rng(1)
    wx, wh, wo = (tf.Variable(rng.standard_normal(s) * 0.5, name=n)
                  for s, n in (((D, U), "wx"), ((U, U), "wh"), ((U, 2), "wo")))
    b = tf.Variable(rng.standard_normal(U) * 0.1, name="b")
    cell = lambda h, xt: tf.tanh(xt @ wx + h @ wh + b)  # noqa: E731

    @kg.auto_register
    def loss_fn(x, y):
        h = loop(cell, x)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h @ wo))

    return loss_fn


def _scan(cell, x):
    h0 = tf.zeros([tf.shape(x)[0], U], x.dtype)
    return tf.scan(cell, tf.transpose(x, [1, 0, 2]), initializer=h0)[-1]


def _while(cell, x):
    body = lambda t, h: (t + 1, cell(h, x[:, t]))  # noqa: E731
    return tf.while_loop(lambda t, h: t < tf.shape(x)[1], body,
                         (tf.constant(0), tf.zeros([tf.shape(x)[0], U], x.dtype)))[1]


@pytest.mark.parametrize("loop", [_scan, _while], ids=["scan", "while_loop"])
def test_raw_loops_are_exact(loop):
    loss_fn = _raw_rnn(loop)
    args = _data()
    reg = loss_fn.registration(*args)
    assert [(layer.kind, layer.uses) for layer in reg.layers] == [
        ("dense", T), ("dense", 1)], reg.summary()  # x @ wx + h @ wh + b: one stacked layer
    _assert_per_example_exact(loss_fn, args)


COMPARE = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}


@hypothesis.given(start=st.integers(-3, 3), step=st.sampled_from([-2, -1, 1, 2, 3]),
                  limit=st.integers(-6, 6), compare=st.sampled_from(list(COMPARE)),
                  cap=st.sampled_from([None, 2]))
@SETTINGS
def test_trip_count_is_read_from_the_counter(start, step, limit, compare, cap):
    """Any counter form: the cell's kernel gets exactly the loop's trip count
    of uses (Python's own count of the same loop), or the loop is kept."""
    w = tf.Variable(tf.eye(D, dtype=tf.float64) * 0.5, name="w")
    v = tf.Variable(tf.ones(D, dtype=tf.float64), name="v")
    trips, i = 0, start
    while COMPARE[compare](i, limit) and (cap is None or trips < cap) and trips < 8:
        i, trips = i + step, trips + 1

    @kg.auto_register(max_loop_iterations=7)
    def loss_fn(x):
        _, h = tf.while_loop(lambda i, h: COMPARE[compare](i, limit),
                             lambda i, h: (i + step, tf.tanh(h @ w)),
                             (tf.constant(start), x), maximum_iterations=cap)
        return tf.reduce_sum(tf.square(h * v))

    layers = {layer.variables[0].name: layer
              for layer in loss_fn.registration(tf.ones([B, D], tf.float64)).layers}
    if trips == 0:
        assert "w:0" not in layers
    elif trips > 7:
        assert layers["w:0"].kind == "generic" and "more than 7 iterations" in layers["w:0"].reason
    else:
        assert (layers["w:0"].kind, layers["w:0"].uses) == ("dense", trips)


def test_dynamic_loop_stays_generic_with_a_one_line_error():
    w = tf.Variable(tf.eye(D, dtype=tf.float64), name="w")

    @kg.auto_register
    def loss_fn(x, n):
        _, h = tf.while_loop(lambda i, h: i < n, lambda i, h: (i + 1, tf.tanh(h @ w)),
                             (tf.constant(0), x))
        return tf.reduce_mean(tf.square(h))

    args = (tf.ones([B, D], tf.float64), tf.constant(3))
    layer, = loss_fn.registration(*args).layers
    assert layer.kind == "generic"
    assert "'while'" in layer.reason and "not static" in layer.reason and "n:0" in layer.reason
    with pytest.raises(kg.KfacGraphError, match="while") as info:
        kg.per_example_gradients(loss_fn, *args)
    assert "\n" not in str(info.value)


def test_stateful_body_and_iteration_limit_are_kept_with_reasons():
    w = tf.Variable(tf.eye(D, dtype=tf.float64), name="w")
    count = tf.Variable(0, name="count", trainable=False)

    def body(i, h):
        count.assign_add(1)
        return i + 1, tf.tanh(h @ w)

    @kg.auto_register
    def counting(x):
        return tf.reduce_mean(tf.square(tf.while_loop(lambda i, h: i < 3, body, (0, x))[1]))

    limit = tf.Variable(3.0, name="limit", trainable=False, dtype=tf.float64)

    @kg.auto_register
    def read_in_condition(x):
        cond = lambda i, h: tf.cast(i, tf.float64) < limit  # noqa: E731
        return tf.reduce_mean(tf.square(tf.while_loop(cond, lambda i, h: (i + 1, tf.tanh(h @ w)),
                                                      (0, x))[1]))

    x = tf.ones([B, D], tf.float64)
    assert "writes state" in counting.registration(x).layers[0].reason
    assert "not static" in read_in_condition.registration(x).layers[0].reason
    _, loss_fn = _keras(L.SimpleRNN(U))
    limited = kg.auto_register(loss_fn.python_function, max_loop_iterations=T - 1)
    reasons = {layer.reason for layer in limited.registration(*_data()).layers[:-1]}
    assert all(f"more than {T - 1} iterations" in r for r in reasons), reasons
    with pytest.raises(ValueError, match="max_loop_iterations must be an integer >= 0"):
        kg.auto_register(loss_fn.python_function, max_loop_iterations=-1)


def test_unrolled_graph_computes_what_the_loop_computed():
    loss_fn = _raw_rnn(_while)
    args = _data()
    traced = passes.frontends.from_concrete_function(loss_fn.concrete_function(*args))
    unrolled = unroll.unroll_loops(traced)
    assert unrolled.unrolled_loops == {"while": T} and not unrolled.kept_loops
    assert not any(n.op in ("While", "StatelessWhile") for n in unrolled.graph_def.node)
    assert unroll.unroll_loops(traced).graph_def == unrolled.graph_def  # the input is unchanged
    reg = loss_fn.registration(*args)

    @tf.function
    def rerun(x, y):
        return LayerTaps.build(reg, (x, y)).loss

    np.testing.assert_allclose(rerun(*args).numpy(), loss_fn(*args).numpy(), rtol=1e-12)


# --- slow: longer sequences, combinations, nesting, replicas ------------------


@pytest.mark.slow
def test_longer_lstm_is_exact_and_trains():
    steps = 24
    _, loss_fn = _keras(L.LSTM(8), shape=(steps, D))
    rng = np.random.default_rng(2)
    args = (tf.constant(rng.standard_normal((B, steps, D))), tf.constant([0, 1, 1]))
    assert [layer.uses for layer in loss_fn.registration(*args).layers] == [steps, 1]
    _assert_per_example_exact(loss_fn, args)
    opt = kg.KFAC(loss_fn, learning_rate=0.1, damping=1e-2)
    losses = [float(opt.step(*args)) for _ in range(3)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses


IDS = tf.constant([[1, 2, 3, 0, 0], [4, 1, 0, 0, 0], [2, 2, 2, 2, 1]])
COMBOS = {
    "bidirectional_stacked": (lambda: [L.Bidirectional(L.LSTM(U, return_sequences=True)),
                                       L.GRU(U, go_backwards=True)], None),
    "masking_layer": (lambda: [L.Masking(0.0), L.LSTM(U, return_sequences=True),
                               L.GlobalAveragePooling1D()], "zeros"),
    "embedding_mask_bidirectional": (
        lambda: [L.Embedding(6, D, mask_zero=True),
                 L.Bidirectional(L.SimpleRNN(U, return_sequences=True)), L.GRU(U)], "ids"),
}


@pytest.mark.slow
@pytest.mark.parametrize("combo", list(COMBOS))
def test_combinations_verify(combo):
    make, inputs = COMBOS[combo]
    x, y = _data()
    if inputs == "zeros":  # the last two steps masked
        x = tf.concat([x[:, :3], tf.zeros([B, 2, D], x.dtype)], 1)
    shape = (T,) if inputs == "ids" else (T, D)
    _, loss_fn = _keras(*make(), shape=shape)
    args = (IDS if inputs == "ids" else x, y)
    reg = loss_fn.registration(*args)
    assert "generic" not in [layer.kind for layer in reg.layers], reg.summary()
    report = kg.verify(loss_fn, *args)
    assert report.passed, report.table()


@pytest.mark.slow
def test_nested_loops_unroll():
    rng = np.random.default_rng(1)
    wx, wh = (tf.Variable(rng.standard_normal(s) * 0.5) for s in ((D, U), (U, U)))

    def inner(h):
        return tf.while_loop(lambda k, h: k < 2, lambda k, h: (k + 1, tf.tanh(h @ wh)), (0, h))[1]

    @kg.auto_register
    def loss_fn(x, y):
        body = lambda t, h: (t + 1, inner(tf.tanh(x[:, t] @ wx + h)))  # noqa: E731
        h = tf.while_loop(lambda t, h: t < T, body,
                          (0, tf.zeros([tf.shape(x)[0], U], x.dtype)))[1]
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h[:, :2]))

    args = _data()
    assert [(layer.kind, layer.uses) for layer in loss_fn.registration(*args).layers] == [
        ("dense", T), ("dense", 2 * T)]
    _assert_per_example_exact(loss_fn, args)


@pytest.mark.slow
def test_mirrored_strategy_matches_one_device(tmp_path):
    out = tmp_path / "mirrored.npz"
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recurrent_mirrored.py")
    proc = subprocess.run([sys.executable, script, "--devices", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = np.load(out)
    assert not r["generic"] and int(r["skipped"]) == 0
    np.testing.assert_allclose(r["params"], r["reference"], rtol=RTOL, atol=1e-10)
    np.testing.assert_allclose(r["losses"], r["reference_losses"], rtol=RTOL)
    assert r["losses"][-1] != r["losses"][0]


@pytest.mark.slow
def test_saved_model_gru_is_rewritten(tmp_path):
    """kfac-rewrite of a SavedModel whose loss runs a GRU's loop: its
    per-example gradients equal the one-example tapes, and it trains."""
    model, loss_fn = _keras(L.GRU(U))

    class Trainable(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, T, D], tf.float64),
                                      tf.TensorSpec([None], tf.int64)])
        def loss(self, x, y):
            return loss_fn.python_function(x, y)

    module = Trainable()
    module.model = model
    tf.saved_model.save(module, str(tmp_path / "model"))
    reg = kg.register_saved_model(str(tmp_path / "model"), "loss")
    assert "generic" not in [layer.kind for layer in reg.layers], reg.summary()
    emit.rewrite_saved_model(str(tmp_path / "model"), "loss", str(tmp_path / "rewritten"))
    rewritten = tf.saved_model.load(str(tmp_path / "rewritten"))
    args = _data()
    want = one_example_loop(loss_fn, args, model.trainable_variables)
    got = {tuple(g.shape[1:]): g.numpy() for g in rewritten.per_example_gradients(*args)}
    for w in want:
        np.testing.assert_allclose(got[tuple(w.shape[1:])], w.numpy(), rtol=RTOL, atol=1e-12)
    losses = [float(rewritten.kfac_step(*args)) for _ in range(3)]
    assert losses[-1] < losses[0], losses
