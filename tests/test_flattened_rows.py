"""Layers on examples flattened into rows (``passes/example_rows.py``).

A Reshape of a tensor whose leading axis is the batch into ``[k B, ..]``
rows keeps each example's rows together (row-major order), and row-wise ops
(elementwise, softmax, a matmul on a weight, a transpose that keeps the
rows first) keep them so. A dense layer on such rows reads them as
``[B, k, ..]``. Before, its per-example gradients stopped at a one-line
error (leading axis ``kB``). Cases: a mixture of experts as keras-hub
writes them (Mixtral, Qwen-MoE), whose router and shared expert run on
``reshape(h, [-1, d])`` and are never unflattened there (softmax, top-k and
the routing weights follow on ``[B T, E]``); and windows cut from a
sequence (Swin's ``[B nW, N, C]``) projected by a Keras ``Dense``. The
experts' input kernels, ``einsum("th,ehm->etm", rows, W)``, are dense
layers on ``transpose(W, (1, 0, 2))`` whose output gradient is laid out
positions first (``output_perm``); their output kernels are grouped dense
layers (``tests/test_grouped_dense.py``).
Checked in float64 against a loop of one-example gradients and the
brute-force Fisher."""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_reference import brute_fisher, softmax_fisher
from per_example_reference import assert_matches_loop, one_example_loop

B, T, D, E, C = 3, 4, 3, 5, 2


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
    assert_matches_loop(loss_fn, args)
    w, b, head = params
    want = brute_fisher(lambda p, x: logits([p[0], p[-1] if bias else b, head], x),
                        [w, b] if bias else [w], args[0], softmax_fisher)
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact", approximations={"dense": "full"})
    est.update(*args)
    np.testing.assert_allclose(est.blocks[0].full_matrix(), want, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("family", [  # -m slow; the einsum forms below run in the fast set
    pytest.param(f, marks=pytest.mark.slow) for f in ("mixtral", "qwen_moe")])
def test_keras_hub_moe_backbone(family):
    """keras-hub's Mixtral and Qwen-MoE from tiny configs, float64: every
    router a dense layer on ``[B, T, d]``; the experts' stacked input kernels
    ``[E, d, m]`` (``einsum("th,ehm->etm")``, every expert on every token,
    weighed by the routing after) dense layers too; their output kernels
    (``"eti,eih->eth"``, each expert on its own input) grouped dense layers;
    no variable generic; per-example gradients equal a loop; kg.KFAC with
    its defaults lowers the loss."""
    keras = pytest.importorskip("keras")
    keras_hub = pytest.importorskip("keras_hub")
    keras.config.set_floatx("float64")  # conftest restores the dtypes
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    common = dict(vocabulary_size=20, num_layers=2, num_query_heads=4, num_key_value_heads=2,
                  hidden_dim=8, intermediate_dim=16, num_experts=3, top_k=2)
    backbone = (keras_hub.models.MixtralBackbone(**common) if family == "mixtral" else
                keras_hub.models.QwenMoeBackbone(**common, moe_intermediate_dim=8,
                                                 shared_expert_intermediate_dim=8))
    head = keras.layers.Dense(C)
    rng = np.random.RandomState(1)
    x = tf.constant(rng.randint(0, 20, (B, 5)))

    @kg.auto_register
    def loss_fn(x, y):
        h = backbone({"token_ids": x, "padding_mask": tf.ones_like(x)})
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, head(tf.reduce_mean(h, axis=1))))

    args = (x, tf.constant([0, 1, 1]))
    reg = loss_fn.registration(*args)
    routers = [layer for layer in reg.layers
               if "sparse_feedforward_gate_dense" in layer.variables[0].name]
    assert [(layer.kind, layer.use_attrs[0]["input_shape"]) for layer in routers] == [
        ("dense", (B, 5, 8))] * 2, reg.summary()
    # the experts' input kernels (every expert on every token) are dense
    # layers; their output kernels, one per expert's own input
    # (``"eti,eih->eth"``), grouped dense layers on ``[E, B, T, m]``
    experts = [layer for layer in reg.layers if "/experts/" in layer.variables[0].name]
    assert experts and all(
        (layer.kind, layer.use_attrs[0]["input_shape"][1:3]) == ("grouped_dense", (B, 5))
        if "output_dense" in layer.variables[0].name else layer.kind == "dense"
        for layer in experts), reg.summary()
    assert {layer.kind for layer in experts} == {"dense", "grouped_dense"}, reg.summary()
    assert not [layer for layer in reg.layers if layer.kind == "generic"], reg.summary()
    # the layer norms compute in float32 whatever the model's dtype
    assert_matches_loop(loss_fn, args, rtol=1e-4, atol=1e-6)
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(8)]
    assert losses[-1] < 0.5 * losses[0] and int(opt.skipped_steps) == 0, losses


def test_windows_of_a_sequence_through_keras_dense():
    """``[B, T, D]`` cut into windows ``[B T / 2, 2, D]``, a Keras ``Dense``
    (a Tensordot) and a softmax over each window, then back to ``[B, T, D]``."""
    keras = pytest.importorskip("keras")
    rng = np.random.RandomState(3)
    dense = keras.layers.Dense(D, dtype="float64")
    head = tf.Variable(rng.normal(size=(D, C)), name="head")

    @kg.auto_register
    def loss_fn(x, y):
        windows = tf.reshape(x, [-1, 2, D])
        h = tf.nn.softmax(tf.tanh(dense(windows)), axis=1)
        pooled = tf.reduce_mean(tf.reshape(h, [-1, T, D]), axis=1)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, pooled @ head))

    args = (tf.constant(rng.normal(size=(B, T, D))), tf.constant([0, 1, 1]))
    reg = loss_fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == ["dense", "dense"], reg.summary()
    assert reg.layers[0].use_attrs[0]["input_shape"] == (B, T // 2, 2, D)
    assert_matches_loop(loss_fn, args)


def test_keras_hub_swin_windows():
    """keras-hub's Swin Transformer from a tiny config, float64: attention
    within windows ``[B nW, N, C]``, the qkv projection split by a reshape,
    a transpose that moves the rows to the second axis and an unstack, the
    scores and weighted values batched matmuls, the output projection back
    on the rows (shifted windows in the second block). Every projection is
    a dense layer on ``[B, nW, N, C]``; the relative position bias tables
    (looked up by ids without an example axis and added to every window's
    scores) are embeddings summed over each example's windows
    (``row_groups``, ``tests/test_lookups_on_rows.py``); per-example
    gradients equal a loop."""
    keras = pytest.importorskip("keras")
    keras_hub = pytest.importorskip("keras_hub")
    keras.config.set_floatx("float64")  # conftest restores the dtypes
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.SwinTransformerBackbone(
        image_shape=(8, 8, 3), embed_dim=4, depths=[2], num_heads=[2], window_size=2,
        patch_size=2)
    head = keras.layers.Dense(C)
    rng = np.random.RandomState(2)

    @kg.auto_register
    def loss_fn(x, y):
        h = backbone(x)
        h = list(h.values())[-1] if isinstance(h, dict) else h  # the last stage's map
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, head(tf.reduce_mean(h, axis=list(range(1, len(h.shape) - 1))))))

    args = (tf.constant(rng.normal(size=(B, 8, 8, 3))), tf.constant([0, 1, 1]))
    reg = loss_fn.registration(*args)
    windowed = [layer for layer in reg.layers if "/attn_1/" in layer.name]
    assert windowed and all(
        layer.kind == "dense" and layer.use_attrs[0]["input_shape"][:2] == (B, 4)
        for layer in windowed), reg.summary()
    tables = [layer for layer in reg.layers
              if "relative_position_bias_table" in layer.variables[0].name]
    assert len(tables) == 2 and all(
        layer.kind == "embedding" and layer.use_attrs[0]["row_groups"] == 16 // (2 * 2)
        for layer in tables), reg.summary()
    assert not [layer for layer in reg.layers if layer.kind == "generic"]
    assert_matches_loop(loss_fn, args)


@pytest.mark.parametrize("form", ["th,ehm->etm", "th,ehm->tem"])
def test_experts_on_every_token(form):
    """Every expert on every token, ``einsum(form, rows, W [E, D, M])``, then
    weighed by the routing: a dense layer on the applied kernel
    ``transpose(W, (1, 0, 2))`` whose output ``[E, N, M]`` is laid out
    positions first (``output_perm``)."""
    rng = np.random.RandomState(4)
    w = tf.Variable(rng.normal(size=(E, D, 2)), name="experts")
    router = tf.Variable(rng.normal(size=(D, E)), name="router")
    head = tf.Variable(rng.normal(size=(2, C)), name="head")

    def logits(params, x):
        w, router, head = params
        rows = tf.reshape(x, [-1, D])
        out = tf.tanh(tf.einsum(form, rows, w))
        out = out if form.endswith("etm") else tf.transpose(out, [1, 0, 2])  # [E, N, M]
        route = tf.transpose(tf.nn.softmax(rows @ router))  # [E, N]
        mixed = tf.reduce_sum(out * route[:, :, None], axis=0)
        return tf.reduce_mean(tf.reshape(mixed, [-1, T, 2]), axis=1) @ head

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, logits([w, router, head], x)))

    args = (tf.constant(rng.normal(size=(B, T, D))), tf.constant([0, 1, 1]))
    reg = loss_fn.registration(*args)
    experts = [layer for layer in reg.layers if layer.variables[0] is w]
    assert [(layer.kind, layer.use_attrs[0].get("output_perm")) for layer in experts] == [
        ("dense", (1, 0, 2) if form.endswith("etm") else None)], reg.summary()
    assert_matches_loop(loss_fn, args)
    expected = brute_fisher(lambda p, x: logits([p[0], router, head], x), [w], args[0],
                            softmax_fisher)
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact", approximations={"dense": "full"})
    est.update(*args)
    block = est.blocks[reg.layers.index(experts[0])]
    np.testing.assert_allclose(block.full_matrix(), expected, rtol=1e-6, atol=1e-12)
    est = kg.FisherEstimator(loss_fn)  # the default Kronecker block runs
    est.update(*args)
    assert np.all(np.isfinite(est.blocks[reg.layers.index(experts[0])].full_matrix()))


def test_time_major_rows_are_not_examples():
    """``[B, T, D]`` made time-major and flattened to ``[T B, D]`` holds a
    time step, not an example, in each group of rows: with ``T = B`` the
    shapes alone would pass for examples. The dense layer there is generic,
    with the reason (it stopped at its first step on the one-line error
    naming it), and exact."""
    rng = np.random.RandomState(5)
    w = tf.Variable(rng.normal(size=(D, C)), name="w")

    @kg.auto_register
    def loss_fn(x, y):
        rows = tf.reshape(tf.transpose(x, [1, 0, 2]), [-1, D])  # [T B, D]
        z = tf.reduce_mean(tf.reshape(tf.tanh(rows @ w), [-1, B, C]), axis=0)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, z))

    args = (tf.constant(rng.normal(size=(B, B, D))), tf.constant([0, 1, 1]))
    (layer,) = loss_fn.registration(*args).layers
    assert layer.kind == "generic" and "not the batch's 3" in layer.reason, layer.reason

    def batch_first(x, y):  # the same loss, written for any batch: the reference
        z = tf.reduce_mean(tf.tanh(tf.einsum("btd,dc->btc", x, w)), axis=1)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, z))
    np.testing.assert_allclose(kg.per_example_gradients(loss_fn, *args)[0],
                               one_example_loop(batch_first, args, [w])[0], rtol=1e-9)


def test_experts_on_every_token_with_biases():
    """GPT-OSS's input projection: ``einsum("th,ehm->etm", rows, W) + b[:, None,
    :]``, the bias ``[E, M]`` read as the output with its positions' axis 1
    (a whole-axis slice that only adds it): the dense layer's bias."""
    rng = np.random.RandomState(6)
    w = tf.Variable(rng.normal(size=(E, D, 2)), name="experts")
    b = tf.Variable(rng.normal(size=(E, 2)), name="experts_bias")
    head = tf.Variable(rng.normal(size=(2, C)), name="head")

    def logits(params, x):
        w, b = params
        out = tf.tanh(tf.einsum("th,ehm->etm", tf.reshape(x, [-1, D]), w) + b[:, None, :])
        return tf.reduce_mean(tf.reshape(tf.reduce_sum(out, 0), [-1, T, 2]), axis=1) @ head

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, logits([w, b], x)))

    args = (tf.constant(rng.normal(size=(B, T, D))), tf.constant([0, 1, 1]))
    reg = loss_fn.registration(*args)
    assert [(layer.kind, len(layer.variables)) for layer in reg.layers] == [
        ("dense", 2), ("dense", 1)], reg.summary()
    assert_matches_loop(loss_fn, args)
    want = brute_fisher(logits, [w, b], args[0], softmax_fisher)
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact", approximations={"dense": "full"})
    est.update(*args)
    np.testing.assert_allclose(est.blocks[0].full_matrix(), want, rtol=1e-6, atol=1e-12)
