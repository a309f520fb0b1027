"""Lookups added over the batch to rows of examples (`row_groups`).

Swin adds its relative-position bias `[H, N, N]` to the scores of every
window, `[B nW, H, N, N]`; VideoPrism adds its spatial position table to
every frame, `[B F, N, d]`. Each example holds `k` rows there (its windows
or frames), all reading the same ids, so its gradient is summed over its
`k` rows before the lookup's rule (`passes/unflatten_rows.py`,
`kfac_graph/layers/embedding.py`). Before, both tables were generic ("its
input holds each example's k rows"). Float64, against a loop of
one-example gradients and the brute-force Fisher; keras-hub's Swin and
VideoPrism from tiny configs.
"""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_checks import block_matrix
from fisher_reference import brute_fisher, softmax_fisher
from per_example_reference import assert_matches_loop

B, W, N, D, H, C = 3, 2, 3, 4, 2, 2


def _windows():
    """Windowed attention with a relative bias table looked up by `[N, N]` ids."""
    rng = np.random.RandomState(0)
    table = tf.Variable(rng.normal(size=(2 * N - 1, H)), name="relative_bias")
    wq = tf.Variable(rng.normal(size=(D, D)) * 0.5, name="wq")
    head = tf.Variable(rng.normal(size=(D, C)), name="head")
    ids = tf.constant(np.arange(N)[None, :] - np.arange(N)[:, None] + N - 1)

    def logits(params, x):
        table, wq = params
        q = tf.reshape(tf.reshape(x, [-1, N, D]) @ wq, [-1, N, H, D // H])  # [B W, N, H, d]
        scores = tf.einsum("bqnd,bknd->bnqk", q, q)
        bias = tf.transpose(tf.gather(tf.identity(table), ids), [2, 0, 1])[None]
        weights = tf.nn.softmax(scores + bias, axis=-1)
        out = tf.reshape(tf.einsum("bnqk,bknd->bqnd", weights, q), [-1, W * N, D])
        return tf.reduce_mean(out, axis=1) @ head

    return table, wq, logits, rng.normal(size=(B, W * N, D))


def _frames():
    """A position table looked up by `range(N)` and added to every frame of a
    video, `[B F, N, d]`."""
    rng = np.random.RandomState(1)
    table = tf.Variable(rng.normal(size=(N, D)), name="position_embedding")
    w = tf.Variable(rng.normal(size=(D, D)) * 0.5, name="w")
    head = tf.Variable(rng.normal(size=(D, C)), name="head")

    def logits(params, x):
        table, w = params
        frames = tf.reshape(x, [-1, N, D]) + tf.gather(table, tf.range(N))  # [B F, N, d]
        h = tf.reshape(tf.tanh(frames @ w), [-1, W * N, D])
        return tf.reduce_mean(h, axis=1) @ head

    return table, w, logits, rng.normal(size=(B, W, N, D))


@pytest.mark.parametrize("build", [_windows, _frames])
def test_lookup_on_rows_matches_loop_and_brute_force(build):
    table, other, logits, x = build()
    params = [table, other]

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, logits(params, x)))

    args = (tf.constant(x), tf.constant([0, 1, 1]))
    reg = loss_fn.registration(*args)
    (layer,) = [layer for layer in reg.layers if layer.variables[0] is table]
    assert (layer.kind, layer.use_attrs[0]["row_groups"]) == ("embedding", W), reg.summary()
    assert not [layer for layer in reg.layers if layer.kind == "generic"]
    assert_matches_loop(loss_fn, args)
    want = brute_fisher(lambda p, x: logits([p[0], other], x), [table], args[0], softmax_fisher)
    np.testing.assert_allclose(block_matrix(loss_fn, args, layer, "embedding", "full"), want,
                               rtol=1e-6, atol=1e-12)
    # the default Kronecker block runs
    assert np.all(np.isfinite(block_matrix(loss_fn, args, layer, "embedding",
                                           estimation_mode="sampled")))


def _keras_hub_loss(backbone, shape):
    keras = pytest.importorskip("keras")
    head = keras.layers.Dense(3, dtype="float64")

    @kg.auto_register
    def loss_fn(x, y):
        out = backbone(x)
        pooled = tf.reduce_mean(out, axis=list(range(1, len(out.shape) - 1)))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, head(pooled)))

    x = tf.constant(np.random.RandomState(2).normal(size=(2, *shape)))
    return loss_fn, (x, tf.constant([0, 2]))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["swin", "videoprism"])
def test_keras_hub_tables_on_rows(family):
    """keras-hub's Swin (relative tables on windows; in the fast set in
    ``tests/test_flattened_rows.py``) and VideoPrism (position tables on
    frames) register every variable, float64, equal to a loop."""
    keras = pytest.importorskip("keras")
    keras_hub = pytest.importorskip("keras_hub")
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    m = keras_hub.models
    if family == "swin":
        backbone = m.SwinTransformerBackbone(image_shape=(16, 16, 3), embed_dim=8, depths=[2],
                                             num_heads=[2], window_size=2, patch_size=2)
        shape, tables = (16, 16, 3), "relative_position_bias_table"
    else:
        backbone = m.VideoPrismBackbone(num_frames=2, patch_size=8, hidden_dim=16,
                                        intermediate_dim=32, num_heads=2, num_spatial_layers=1,
                                        num_temporal_layers=1, num_auxiliary_layers=0,
                                        image_shape=(16, 16, 3))
        shape, tables = (2, 16, 16, 3), "position_embedding"
    loss_fn, args = _keras_hub_loss(backbone, shape)
    reg = loss_fn.registration(*args)
    assert not [layer for layer in reg.layers if layer.kind == "generic"], reg.summary()
    on_rows = [layer for layer in reg.layers if layer.kind == "embedding"
               and tables in layer.variables[0].name]
    assert on_rows and all(layer.use_attrs[0].get("row_groups") for layer in on_rows[:1])
    assert_matches_loop(loss_fn, args, rtol=1e-6, atol=1e-10)
