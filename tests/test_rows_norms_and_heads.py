"""Examples flattened into rows (``passes/example_rows.py``), continued:
norms on rows, heads merged into a later axis, and relative-position tables.

- A layer, RMS or group norm on ``[k B, d]`` rows (Qwen3.5's gated RMSNorm
  on ``[B T H, d]``, RWKV-7's group norm on ``[B T, C]``) is a
  scale-and-shift layer reading them as ``[B, k, d]``. Before, its
  per-example gradients stopped at "leading axis kB".
- Rows follow a reshape that merges them with a later axis
  (``[3, B nW, H, n, d] -> [3, B nW H, n, d]``, ViTDet's qkv split), an
  unstack, einsums with one side in rows (scores) or with weights alone (a
  relative-position term), and slices that keep the rows whole.
- A relative-position table looked up on a constant ``[n, n]`` grid whose
  ``n`` equals the batch is no per-example lookup: it stays generic (exact).
  Before, the shape coincidence registered it as an embedding whose
  per-example gradients were wrong by 100%, with no error.
Checked in float64 against a loop of one-example gradients and, for the
norms, the brute-force Fisher."""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_reference import brute_fisher, softmax_fisher
from per_example_reference import assert_matches_loop

B, T, C = 3, 4, 2


@pytest.mark.parametrize("norm", ["layer", "rms", "group"])
def test_norms_on_flattened_rows(norm):
    """``[B, T, 4]`` as rows ``[B T 2, 2]`` (two heads) under a layer or RMS
    norm, or ``[B T, 4]`` under a group norm of two groups; then back to
    ``[B, T, 4]``, mean over time, a head."""
    keras = pytest.importorskip("keras")
    keras.config.set_floatx("float64")  # conftest restores the dtypes
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    layer = {"layer": keras.layers.LayerNormalization(),
             "rms": keras.layers.RMSNormalization(),
             "group": keras.layers.GroupNormalization(groups=2)}[norm]
    rng = np.random.RandomState(6)
    head = tf.Variable(rng.normal(size=(4, C)), name="head")
    width = 4 if norm == "group" else 2

    def logits(x):
        rows = layer(tf.reshape(tf.tanh(x), [-1, width]))
        return tf.reduce_mean(tf.reshape(rows, [-1, T, 4]), axis=1) @ head

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits(x)))

    args = (tf.constant(rng.normal(size=(B, T, 4))), tf.constant([0, 1, 1]))
    reg = loss_fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == ["scale_and_shift", "dense"], reg.summary()
    assert reg.layers[0].use_attrs[0]["output_shape"][:2] == (B, T * 4 // width)
    assert_matches_loop(loss_fn, args)
    params = list(reg.layers[0].variables)
    want = brute_fisher(lambda p, x: logits(x), params, args[0], softmax_fisher)
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact",
                             approximations={"scale_and_shift": "full"})
    est.update(*args)
    np.testing.assert_allclose(est.blocks[0].full_matrix(), want, rtol=1e-6, atol=1e-12)


def _windowed_attention(n):
    """ViTDet's attention, by hand: ``[B, 2n, 4]`` cut into two windows of
    ``n`` positions (rows ``[2 B, n, 4]``), a qkv projection, the heads
    merged into the rows (``[3, 2 B H, n, 2]``) and unstacked, scores plus a
    relative-position term ``einsum(q, table[ids])`` over an ``[n, n]``
    grid (through a slice that adds an axis and a squeeze), the weighted
    values back to ``[2 B, n, 4]``, an output projection, a head."""
    keras = pytest.importorskip("keras")
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(1)
    qkv, proj = keras.layers.Dense(12), keras.layers.Dense(4)
    rng = np.random.RandomState(7)
    table = tf.Variable(rng.normal(size=(2 * n - 1, 2)), name="rel_table")
    head = tf.Variable(rng.normal(size=(4, C)), name="head")
    ids = tf.constant(np.arange(n)[:, None] - np.arange(n)[None, :] + n - 1)

    def logits(x):
        windows = tf.reshape(x, [-1, n, 4])
        h = tf.reshape(qkv(windows), [-1, n, 3, 2, 2])
        h = tf.reshape(tf.transpose(h, [2, 0, 3, 1, 4]), [3, -1, n, 2])
        q, k, v = tf.unstack(h, axis=0)
        rel = tf.einsum("bid,ijd->bij", q, tf.gather(tf.identity(table), ids))
        scores = tf.einsum("bid,bjd->bij", q, k) + tf.squeeze(rel[..., None], -1)
        out = tf.reshape(tf.nn.softmax(scores) @ v, [-1, 2, n, 2])
        out = proj(tf.reshape(tf.transpose(out, [0, 2, 1, 3]), [-1, n, 4]))
        return tf.reduce_mean(tf.reshape(out, [-1, 2 * n, 4]), axis=1) @ head

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits(x)))

    args = (tf.constant(rng.normal(size=(B, 2 * n, 4))), tf.constant([0, 1, 1]))
    return loss_fn, args, table


@pytest.mark.parametrize("n", [B, 2], ids=["grid_as_wide_as_the_batch", "narrower_grid"])
def test_heads_merged_into_windows(n):
    loss_fn, args, table = _windowed_attention(n)
    reg = loss_fn.registration(*args)
    dense = [layer for layer in reg.layers if layer.kind == "dense"]
    assert [layer.use_attrs[0]["input_shape"] for layer in dense[:2]] == [
        (B, 2, n, 4)] * 2, reg.summary()
    (generic,) = [layer for layer in reg.layers if layer.kind == "generic"]
    assert list(generic.variables) == [table] and "no example axis" in generic.reason
    assert_matches_loop(loss_fn, args)


def _keras_hub_loss(backbone, x, features=None):
    keras = pytest.importorskip("keras")
    head = keras.layers.Dense(C)

    @kg.auto_register
    def loss_fn(x, y):
        h = backbone(features(x) if features else x)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, head(tf.reduce_mean(h, axis=list(range(1, len(h.shape) - 1))))))

    return loss_fn, (x, tf.constant([0, 1, 1][:x.shape[0]]))


def test_keras_hub_vit_det():
    """keras-hub's ViTDet from a tiny config, float64, batch 2 and windows
    of 2 x 2 patches (so the relative tables' grids are as wide as the
    batch): every projection a dense layer, the windowed ones on ``[B, nW,
    ..]``; the four relative tables generic; per-example gradients equal a
    loop."""
    keras = pytest.importorskip("keras")
    keras_hub = pytest.importorskip("keras_hub")
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.ViTDetBackbone(
        hidden_size=4, num_layers=2, intermediate_dim=8, num_heads=2,
        global_attention_layer_indices=[1], image_shape=(16, 16, 3), patch_size=4,
        num_output_channels=2, window_size=2)
    x = tf.constant(np.random.RandomState(2).normal(size=(2, 16, 16, 3)))
    loss_fn, args = _keras_hub_loss(backbone, x)
    reg = loss_fn.registration(*args)
    windowed = [layer for layer in reg.layers
                if layer.kind == "dense" and "windowed_transformer_encoder_1/multi" in layer.name]
    assert len(windowed) == 2 and all(
        layer.use_attrs[0]["input_shape"][:2] == (2, 4) for layer in windowed), reg.summary()
    generic = [layer for layer in reg.layers if layer.kind == "generic"]
    assert len(generic) == 4 and all("rel_pos" in layer.name for layer in generic)
    assert_matches_loop(loss_fn, args)


@pytest.mark.parametrize("family", ["rwkv7", pytest.param("qwen3_5", marks=pytest.mark.slow)])
def test_keras_hub_norms_on_rows(family):
    """keras-hub's RWKV-7 (a group norm on ``[B T, C]``) and Qwen3.5 (a gated
    RMSNorm on ``[B T H, d]`` after its linear attention) from tiny
    configs: those norms register as scale-and-shift layers and per-example
    gradients equal a loop. RWKV-7 in float64; Qwen3.5 in float32 (its
    linear attention builds float32 masks, so it does not trace in
    float64)."""
    keras = pytest.importorskip("keras")
    keras_hub = pytest.importorskip("keras_hub")
    if family == "rwkv7":
        keras.config.set_floatx("float64")
        keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    m = keras_hub.models
    if family == "rwkv7":
        backbone = m.RWKV7Backbone(hidden_size=16, head_size=8, num_layers=2,
                                   vocabulary_size=20, intermediate_dim=32)
        norm = "group_normalization"
    else:
        backbone = m.Qwen3_5Backbone(vocabulary_size=20, num_layers=2, hidden_dim=16,
                                     intermediate_dim=32, num_query_heads=4,
                                     num_key_value_heads=2, head_dim=4,
                                     linear_num_key_heads=2, linear_num_value_heads=4,
                                     linear_key_head_dim=4, linear_value_head_dim=4)
        norm = "linear_attn/norm"
    x = tf.constant(np.random.RandomState(3).randint(1, 20, (B, 5)))
    loss_fn, args = _keras_hub_loss(backbone, x, lambda x: {
        k: tf.ones_like(x) if "mask" in k else x for k in backbone.input})
    reg = loss_fn.registration(*args)
    norms = [layer for layer in reg.layers if norm in layer.variables[0].name]
    assert len(norms) == 2 and all(
        layer.kind == "scale_and_shift" for layer in norms), reg.summary()
    if family == "qwen3_5":  # its causal conv kernel, stored [C, k]
        convs = [layer for layer in reg.layers if "conv1d" in layer.variables[0].name]
        assert [layer.kind for layer in convs] == ["depthwise_conv2d"] * 2, reg.summary()
    # (RWKV-7's norms compute in float32 whatever the model's dtype)
    assert_matches_loop(loss_fn, args, rtol=1e-4, atol=1e-6)
