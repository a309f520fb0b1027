"""Losses the pass reads no distribution from, and custom gradients it cannot re-run.

An L1 loss, a CTC loss (sparse labels: TensorFlow's `CTCLoss` op) or any
loss whose batch reduction the pass reads down to per-example terms but no
further is kind "opaque" (`passes/match_loss.py`): per-example gradients,
norms and DP-SGD work, against a loop of one-example tapes; its Fisher is
the empirical one (each example's own loss's gradient, against the loop),
and `kg.KFAC` trains on it; asked for a sampled or exact Fisher, it says in
one line that there is no distribution. A custom gradient the re-run graph
would replace by a different one (a gradient reversal, a straight-through
estimator, the CTC loss on dense labels, whose gradient TensorFlow computes
in a loop of its forward pass) is refused at registration, one line
(`passes/custom_gradients.py`); one whose forward is its derivative
written stably (a log-sum-exp with the maximum held by `stop_gradient`)
still registers and matches the loop.
"""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from passes import custom_gradients
from passes.errors import KfacGraphError
from per_example_reference import assert_matches_loop, one_example_loop

B, T, D, V = 4, 6, 3, 5


def _params(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (tf.Variable(rng.normal(size=(D, V)).astype(dtype), name="kernel"),
            tf.Variable(rng.normal(size=(V,)).astype(dtype), name="bias"))


def _x(dtype, shape=(B, T, D), seed=1):
    return tf.constant(np.random.default_rng(seed).normal(size=shape).astype(dtype))


def _l1(weighted):
    w, b = _params("float64")

    @kg.auto_register
    def loss_fn(x, y, s):
        err = tf.abs(x[:, 0] @ w + b - y)  # piecewise linear: no curvature, opaque
        if weighted:  # a sample-weighted mean: sum(s * l) / sum(s)
            return tf.reduce_sum(s[:, None] * err) / tf.reduce_sum(s)
        return tf.reduce_mean(err)
    y = tf.constant(np.random.default_rng(2).normal(size=(B, V)))
    return loss_fn, (_x("float64"), y, tf.constant([1.0, 0.0, 2.0, 1.0], tf.float64))


def test_l1_loss_is_opaque_with_exact_per_example_gradients():
    loss_fn, args = _l1(weighted=False)
    reg = assert_matches_loop(loss_fn, args)
    assert reg.loss.kind == "opaque" and reg.loss.output is None
    assert "per-example terms" in reg.summary()
    want = one_example_loop(loss_fn, args, reg.variables)
    norms = np.sqrt(sum(np.sum(np.reshape(g, [B, -1]) ** 2, 1) for g in want))
    np.testing.assert_allclose(kg.per_example_gradient_norms(loss_fn, *args), norms, rtol=1e-8)


def test_empirical_fisher_of_an_opaque_loss():
    """The empirical Fisher needs no distribution: each example's own loss's
    gradient, ``F = (1/B) sum_i g_i g_i^T``, against the loop's ``g_i``."""
    loss_fn, args = _l1(weighted=False)
    reg = loss_fn.registration(*args)
    est = kg.FisherEstimator(loss_fn, estimation_mode="empirical", cov_ema_decay=0.0,
                             approximations={"dense": "full"})
    est.update(*args)
    g = np.concatenate([np.reshape(w, [B, -1]) for w in
                        one_example_loop(loss_fn, args, reg.variables)], axis=1)
    np.testing.assert_allclose(est.blocks[0].full_matrix(), g.T @ g / B, rtol=1e-9, atol=1e-12)
    with pytest.raises(KfacGraphError, match=r"opaque .*estimation_mode=\"empirical\""):
        kg.FisherEstimator(loss_fn).update(*args)  # sampled: no distribution to sample


@pytest.mark.parametrize("options", [dict(momentum_type="regular", learning_rate=0.1),
                                     dict(qmodel_curvature="kfac")])
def test_kfac_trains_an_opaque_loss_on_its_empirical_fisher(options):
    loss_fn, args = _l1(weighted=False)
    opt = kg.KFAC(loss_fn, estimation_mode="empirical", **options)
    losses = [float(opt.step(*args)) for _ in range(10)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses


def test_weighted_opaque_terms_sum_to_the_batch_gradient():
    """``sum(s l) / sum(s)``: example i's term is ``s_i l_i / sum(s)``."""
    loss_fn, args = _l1(weighted=True)
    reg = loss_fn.registration(*args)
    assert reg.loss.kind == "opaque" and reg.loss.reduction == "sum"
    got = kg.per_example_gradients(loss_fn, *args)
    with tf.GradientTape() as tape:
        loss = loss_fn(*args)
    for g, w in zip(got, tape.gradient(loss, reg.variables)):
        np.testing.assert_allclose(np.sum(g, 0), w, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(got[0][1], np.zeros_like(got[0][1]))  # weight 0


def _ctc(sparse):
    w, b = _params("float32")

    @kg.auto_register
    def loss_fn(x, labels):
        logits = tf.einsum("btd,dv->btv", x, w) + b
        n = tf.shape(x)[0]
        return tf.reduce_mean(tf.nn.ctc_loss(
            tf.sparse.from_dense(labels) if sparse else labels, logits,
            label_length=None if sparse else tf.fill([n], 2), logit_length=tf.fill([n], T),
            logits_time_major=False, blank_index=0))
    return loss_fn, (_x("float32"), tf.constant([[1, 2], [3, 4], [2, 2], [4, 1]]))


@pytest.mark.parametrize("sparse", [True, False])
def test_ctc_loss_is_opaque_and_exact(sparse):
    """On sparse labels TensorFlow's CTCLoss op; on dense ones (Keras's
    ``ops.ctc_loss``) a custom gradient computed in the forward's loop,
    replayed in the graph kfac_graph re-runs (``passes/gradient_replay.py``)."""
    loss_fn, args = _ctc(sparse)
    reg = assert_matches_loop(loss_fn, args, rtol=1e-4, atol=1e-5)
    assert reg.loss.kind == "opaque" and [layer.kind for layer in reg.layers] == ["dense"]
    assert np.abs(kg.per_example_gradients(loss_fn, *args)[0]).max() > 0.1
    dp = kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=0.5)
    before = reg.variables[0].numpy()
    assert np.isfinite(float(dp.step(*args)))
    assert not np.array_equal(before, reg.variables[0].numpy())
    with pytest.raises(KfacGraphError, match="no predictive distribution"):
        kg.KFAC(loss_fn).step(*args)
    opt = kg.KFAC(loss_fn, estimation_mode="empirical", momentum_type="regular",
                  learning_rate=0.05)
    losses = [float(opt.step(*args)) for _ in range(5)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@tf.custom_gradient
def _reverse_gradient(x):
    return tf.identity(x), lambda dy: -dy


@tf.custom_gradient
def _straight_through_round(x):
    return tf.round(x), lambda dy: dy


@tf.custom_gradient
def _scaled_quantizer(x):
    """Rounds on a scale taken from ``x`` and divides it back, as Keras's int8
    layers quantize their inputs: only the scale's path is differentiable."""
    scale = 127.0 / tf.reduce_max(tf.abs(x), axis=-1, keepdims=True)  # per row
    return tf.round(x * scale) / scale, lambda dy: dy


@tf.custom_gradient
def _stable_logsumexp(x):
    """Its forward is its derivative's, with the maximum held constant."""
    m = tf.stop_gradient(tf.reduce_max(x, axis=-1, keepdims=True))
    y = tf.math.log(tf.reduce_sum(tf.exp(x - m), axis=-1)) + m[..., 0]
    return y, lambda dy: dy[..., None] * tf.nn.softmax(x)


def _with(op):
    w, b = _params("float64")

    @kg.auto_register
    def loss_fn(x, y):
        h = op(x[:, 0] @ w + b)
        logits = tf.stack([_stable_logsumexp(h), h[:, 0]], axis=1) if op is tf.identity else h
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
    return loss_fn, (_x("float64"), tf.constant([0, 1, 1, 0]))


@pytest.mark.parametrize("op", [_reverse_gradient, _straight_through_round, _scaled_quantizer])
def test_surrogate_custom_gradients_are_replayed(op):
    """A gradient reversal and straight-through estimators: their own
    gradients, replayed; per-example gradients equal the loop's, which uses
    them too (the forward's derivative would have the other sign, none, or
    the scale's alone)."""
    loss_fn, args = _with(op)
    assert_matches_loop(loss_fn, args)


def test_a_custom_gradient_that_cannot_be_replayed_is_refused():
    """Its function gone from the process (a graph from elsewhere): one line."""
    loss_fn, args = _with(_reverse_gradient)
    concrete = tf.function(loss_fn.python_function).get_concrete_function(*args)
    graph_def = concrete.graph.as_graph_def()
    for node in graph_def.node:
        if "_gradient_op_type" in node.attr:
            node.attr["_gradient_op_type"].s = b"CustomGradient-999999999"
    loss = concrete.outputs[0].name
    with pytest.raises(KfacGraphError, match=r"custom gradient .* passes input .* cannot be "
                                             r"replayed"):
        custom_gradients.honour(graph_def, loss, "fn")


def test_a_stable_custom_gradient_still_matches_the_loop():
    loss_fn, args = _with(tf.identity)
    assert_matches_loop(loss_fn, args)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_custom_gradients_registered_inside_a_tf_function(jit_compile):
    """Registered first while tracing the caller's function (the pass runs
    as plain Python there, never converted by AutoGraph), under XLA too: a
    replayed straight-through estimator, and swish's exact custom gradient."""
    want_fn, args = _with(_straight_through_round)
    want = kg.per_example_gradients(want_fn, *args)
    loss_fn, _ = _with(_straight_through_round)
    got = tf.function(lambda *a: kg.per_example_gradients(loss_fn, *a),
                      jit_compile=jit_compile)(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    swish_fn, _ = _with(tf.nn.silu)
    got = tf.function(lambda *a: kg.per_example_gradients(swish_fn, *a),
                      jit_compile=jit_compile)(*args)
    reg = swish_fn.registration(*args)
    for g, w in zip(got, one_example_loop(swish_fn, args, reg.variables)):
        np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-12)
