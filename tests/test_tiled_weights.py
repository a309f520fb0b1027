"""A variable tiled or broadcast over the batch (``passes/patterns_scale_shift.py``,
``TILED_SHIFT``): a ViT's class and register tokens (``tile(token, [B, 1,
1])`` concatenated before the patches; SigLIP's pooling probe, ``repeat``ed,
which tiles ``[1, 1, 1, D]`` to ``[1, B, 1, D]`` behind a unit axis), GPT-OSS's attention sinks (a
per-head logit broadcast to ``[B, H, T, 1]``). Each copy is per example, so
the variable is a shift of zeros whose per-example gradient is the output
gradient at that example's copy, summed over the axes it is broadcast
along. Before, these were generic ("no layer pattern matches its use by
Tile"). A tile along any axis but the batch is no such layer and stays
generic. Checked in float64 against a loop of one-example gradients and the
brute-force Fisher."""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_checks import block_matrix
from fisher_reference import brute_fisher, softmax_fisher
from per_example_reference import assert_matches_loop

B, T, D, H, C = 3, 4, 5, 2, 2


def _model(form):
    """Tokens ``[B, T, D]`` behind a class token, a projection, per-head
    attention over positions with a sink logit, the class position's output."""
    rng = np.random.RandomState(0)
    token = tf.Variable(rng.normal(size=(1, 1, D)), name="token")
    sinks = tf.Variable(rng.normal(size=(H,)), name="sinks")
    w = tf.Variable(rng.normal(size=(D, H)), name="w")
    head = tf.Variable(rng.normal(size=(D, C)), name="head")

    def logits(params, x):
        token, sinks, w, head = params
        batch = x.shape[0]
        copies = (tf.tile(token, [batch, 1, 1]) if form == "tile"
                  else tf.repeat(token, batch, axis=0) if form == "repeat"  # SigLIP's probe
                  else tf.broadcast_to(token, [batch, 1, D]))
        h = tf.concat([copies, x], axis=1)  # [B, T + 1, D]
        scores = tf.transpose(tf.tanh(h @ w), [0, 2, 1])[..., None]  # [B, H, T + 1, 1]
        sink = tf.broadcast_to(tf.reshape(sinks, [1, H, 1, 1]), [batch, H, T + 1, 1])
        weights = tf.nn.softmax(tf.concat([scores, sink], axis=-1), axis=-1)[..., 0]
        pooled = tf.einsum("bht,btd->bd", weights, h)
        return pooled @ head

    params = [token, sinks, w, head]

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, logits(params, x)))

    args = (tf.constant(rng.normal(size=(B, T, D))), tf.constant([0, 1, 1]))
    return loss_fn, logits, params, args


@pytest.mark.parametrize("form", ["tile", "broadcast", "repeat"])
def test_tiled_token_and_sinks(form):
    loss_fn, logits, params, args = _model(form)
    reg = loss_fn.registration(*args)
    kinds = {layer.variables[0].name.split(":")[0]: layer.kind for layer in reg.layers}
    assert kinds == {"token": "scale_and_shift", "sinks": "scale_and_shift", "w": "dense",
                     "head": "dense"}, reg.summary()
    assert_matches_loop(loss_fn, args)
    token, sinks, w, head = params
    for index, variable in ((0, token), (1, sinks)):
        want = brute_fisher(
            lambda p, x: logits([p[0] if i == index else v for i, v in enumerate(params)], x),
            [variable], args[0], softmax_fisher)
        (layer,) = [layer for layer in reg.layers if layer.variables[0] is variable]
        np.testing.assert_allclose(block_matrix(loss_fn, args, layer, "scale_and_shift", "full"),
                                   want, rtol=1e-6, atol=1e-12)


def test_tiled_weights_train():
    loss_fn, _, _, args = _model("tile")
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(8)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses


def test_a_tile_along_positions_is_no_shift():
    """``tile(w [1, 2, D], [B, 2, 1])`` repeats the variable along the
    positions too: its copies are no per-example shift of the variable's
    shape, and it stays generic, with its gradients exact."""
    rng = np.random.RandomState(1)
    w = tf.Variable(rng.normal(size=(1, 2, D)), name="w")
    head = tf.Variable(rng.normal(size=(D, C)), name="head")

    @kg.auto_register
    def loss_fn(x, y):
        h = tf.tanh(x + tf.tile(w, [x.shape[0], 2, 1]))  # [B, T = 4, D]
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, tf.reduce_mean(h, axis=1) @ head))

    args = (tf.constant(rng.normal(size=(B, T, D))), tf.constant([0, 1, 1]))
    reg = loss_fn.registration(*args)
    (layer,) = [layer for layer in reg.layers if layer.variables[0] is w]
    assert layer.kind == "generic", reg.summary()
    assert_matches_loop(loss_fn, args)
