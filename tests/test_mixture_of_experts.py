"""Mixture-of-experts layers as keras-hub writes them (Mixtral, Qwen-MoE).

The router is a dense layer on the tokens flattened into rows,
``reshape(h, [-1, d]) @ W_r``, never unflattened there (softmax, top-k and
the routing weights follow on ``[B*T, E]``). The rows are batch-major, so the
layer reads ``h`` with its batch axis (``patterns.DENSE_FLAT``); before, its
per-example gradients stopped at a one-line error (leading axis ``T*B``).
Checked in float64 against a loop of one-example gradients and the
brute-force Fisher."""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_reference import brute_fisher
from per_example_reference import one_example_loop

B, T, D, E, C = 3, 4, 3, 5, 2


def _softmax_fisher(z):
    p = tf.nn.softmax(z)
    return tf.linalg.diag(p) - p[:, :, None] * p[:, None, :]


def _router_model(bias):
    """Tokens ``[B, T, D]`` flattened to rows, routed by ``softmax(rows W + b)``
    over E experts (each a fixed scale here), mean over tokens, a head."""
    rng = np.random.RandomState(0)
    w = tf.Variable(rng.normal(size=(D, E)), name="router")
    b = tf.Variable(rng.normal(size=(E,)), name="router_bias")
    head = tf.Variable(rng.normal(size=(D, C)), name="head")
    scales = tf.constant(rng.normal(size=(E,)))

    def logits(params, x):
        w, b, head = params
        rows = tf.reshape(x, [-1, D])
        route = tf.nn.softmax(rows @ w + b if bias else rows @ w)
        mixed = rows * tf.reduce_sum(route * scales, axis=-1, keepdims=True)
        pooled = tf.reduce_mean(tf.reshape(mixed, [-1, T, D]), axis=1)
        return pooled @ head

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, logits([w, b, head], x)))

    args = (tf.constant(rng.normal(size=(B, T, D))), tf.constant([0, 1, 1]))
    return loss_fn, logits, [w, b, head], args


@pytest.mark.parametrize("bias", [False, True])
def test_router_on_flattened_tokens(bias):
    loss_fn, logits, params, args = _router_model(bias)
    reg = loss_fn.registration(*args)
    got = [(layer.kind, tuple(v.name.split(":")[0] for v in layer.variables))
           for layer in reg.layers]
    router = ("router", "router_bias") if bias else ("router",)
    assert got == [("dense", router), ("dense", ("head",))], reg.summary()
    assert reg.layers[0].use_attrs[0]["input_shape"] == (B, T, D)
    pex = kg.per_example_gradients(loss_fn, *args)
    for v, g, w in zip(reg.variables, pex, one_example_loop(loss_fn, args, reg.variables)):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-12, err_msg=v.name)
    w, b, head = params
    want = brute_fisher(lambda p, x: logits([p[0], p[-1] if bias else b, head], x),
                        [w, b] if bias else [w], args[0], _softmax_fisher)
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact", approximations={"dense": "full"})
    est.update(*args)
    np.testing.assert_allclose(est.blocks[0].full_matrix(), want, rtol=1e-6, atol=1e-12)
