"""keras-hub backbones built from tiny configs with random weights (never a
preset): BERT (token, position and segment embeddings, post-norm LayerNorm,
a pooled tanh head), GPT-2 (pre-norm, its LM head tied to the token table:
``ReversibleEmbedding(reverse=True)``) and Llama (RMSNorm, rotary position
embeddings, grouped-query attention with fewer key/value heads, a gated
SwiGLU MLP; untied and tied heads) and DeBERTa-v3 (relative position
embeddings repeated over the batch and projected by each layer's own query
and key: a second use of those layers, ``tests/test_weight_paths.py``).

Shown: every trainable variable registers in a non-generic layer (but
DeBERTa's relative table and its normalisation, computed from weights
alone); the
per-example gradients and norms equal a loop of one-example tapes (float64
at rtol 1e-6, float32 at 1e-4); a tied table's exact-mode Fisher blocks equal
the brute-force Jacobian Fisher; kg.KFAC with its defaults lowers the loss
in 20 steps with no skipped step, and kg.DPSGD runs a step. The losses:
a classifier on BERT's pooled output, and the LM head's logits at the last
position against ``[B]`` next tokens for GPT-2, Llama and DeBERTa."""
import re

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_reference import brute_fisher
from per_example_reference import one_example_loop
from xla_reference import assert_xla_matches_plain

B, T, V, C = 3, 5, 40, 4
DEBERTA_GENERIC = ("rel_embedding/rel_embedding", "rel_embedding/gamma", "rel_embedding/beta")


def _set_dtype(dtype):
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)


def _backbone(family, tied=False):
    keras.utils.set_random_seed(0)
    if family == "bert":
        return keras_hub.models.BertBackbone(
            vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
            max_sequence_length=8, num_segments=2)
    if family == "gpt2":
        return keras_hub.models.GPT2Backbone(
            vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
            max_sequence_length=8)
    if family == "deberta":
        return keras_hub.models.DebertaV3Backbone(
            vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
            max_sequence_length=8, bucket_size=4)
    if family == "gemma":
        return keras_hub.models.GemmaBackbone(
            vocabulary_size=V, num_layers=2, num_query_heads=2, num_key_value_heads=1,
            hidden_dim=16, intermediate_dim=32, head_dim=8)
    return keras_hub.models.LlamaBackbone(
        vocabulary_size=V, num_layers=2, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=32, tie_word_embeddings=tied)


def _model(family, dtype="float32", tied=False):
    """``(loss_fn, args, backbone)``: BERT classifies its pooled output into
    C classes; GPT-2 and Llama predict the next token from the last position
    with the backbone's LM head (GPT-2's tied to the token table)."""
    _set_dtype(dtype)
    backbone = _backbone(family, tied)
    rng = np.random.RandomState(1)
    x = tf.constant(rng.randint(0, V, (B, T)))
    mask = tf.ones_like(x)
    if family == "bert":
        head = keras.layers.Dense(C)
        segments = tf.constant([[0] * 3 + [1] * (T - 3)] * B)

        def logits(x):
            out = backbone({"token_ids": x, "segment_ids": segments[:tf.shape(x)[0]],
                            "padding_mask": tf.ones_like(x)})
            return head(out["pooled_output"])
        y = tf.constant(rng.randint(0, C, (B,)))
    else:
        def logits(x):
            h = backbone({"token_ids": x, "padding_mask": tf.ones_like(x)})
            return backbone.token_embedding(h[:, -1], reverse=True)
        y = tf.constant(rng.randint(0, V, (B,)))
    del mask

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits(x)))
    return loss_fn, (x, y), backbone


def _assert_matches_loop(loss_fn, args, rtol, atol):
    reg = loss_fn.registration(*args)
    got = kg.per_example_gradients(loss_fn, *args)
    want = one_example_loop(loss_fn, args, reg.variables)
    for v, g, w in zip(reg.variables, got, want):
        assert g.shape == (B, *v.shape), v.name
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=v.name)
    norms = np.sqrt(sum(np.sum(np.reshape(w, [B, -1]).astype(np.float64) ** 2, axis=1)
                        for w in want))
    np.testing.assert_allclose(kg.per_example_gradient_norms(loss_fn, *args), norms, rtol=rtol)
    return reg


def _assert_all_registered(reg, backbone, extra=(), generic=()):
    """Every trainable variable registered once, and in a non-generic layer
    unless it is named in ``generic``."""
    assert {layer.name for layer in reg.layers if layer.kind == "generic"} == set(generic), (
        reg.summary())
    own = sum(int(np.prod(v.shape)) for v in backbone.trainable_variables)
    assert len(reg.variables) == len(backbone.trainable_variables) + len(extra), reg.summary()
    assert sum(layer.num_parameters for layer in reg.layers) == own + sum(extra), reg.summary()


def _kinds(reg):
    """``{Keras layer name: {kinds of the layers under its scope}}``."""
    out = {}
    for layer in reg.layers:
        for part in layer.name.split("/"):
            out.setdefault(re.sub(r"_\d+$", "", part), set()).add(layer.kind)
    return out


@pytest.mark.parametrize("family", [
    "bert", "llama", *(pytest.param(f, marks=pytest.mark.slow)  # (DeBERTa's batch of one
                       for f in ("gpt2", "deberta", "gemma"))])  # and training, GPT-2's
    # float32 check: fast set)
def test_backbone_registers_and_per_example_gradients_are_exact_float64(family):
    loss_fn, args, backbone = _model(family, "float64")
    # Llama's and Gemma's RMSNorm normalise in float32 whatever the model's
    # dtype: the loop itself is only float32-exact there
    rtol, atol = (1e-4, 1e-7) if family in ("llama", "gemma") else (1e-6, 1e-12)
    reg = _assert_matches_loop(loss_fn, args, rtol=rtol, atol=atol)
    # DeBERTa's relative table is layer-normalised as a weight, before any
    # example axis: no layer pattern (its per-example gradients come from the
    # generic Jacobian, checked above)
    _assert_all_registered(reg, backbone, extra=(16 * C, C) if family == "bert" else (),
                           generic=DEBERTA_GENERIC if family == "deberta" else ())
    kinds = _kinds(reg)
    if family == "bert":
        assert [kinds[k] for k in ("token_embedding", "position_embedding",
                                   "segment_embedding")] == [{"embedding"}] * 3, reg.summary()
    if family == "gpt2":  # the LM head is the token table, transposed
        token = reg.layers[0]
        assert (token.kind, token.uses) == ("tied_embedding", 2), reg.summary()
        assert [a["tied_role"] for a in token.use_attrs] == ["lookup", "projection"]
        assert kinds["position_embedding"] == {"embedding"}
    if family == "llama":  # RMSNorm: a scale alone; the SwiGLU gate a dense layer
        assert kinds["self_attention_layernorm"] == {"scale_and_shift"}, reg.summary()
        assert kinds["feedforward_gate_dense"] == {"dense"}, reg.summary()
        shapes = [tuple(v.shape) for v in reg.variables]
        assert (16, 2, 4) in shapes and (16, 4, 4) in shapes  # 2 key/value heads, 4 query heads
    if family == "deberta":  # relative embeddings (a weight repeated over the batch)
        # projected by each layer's own query and key: a second use of both
        for name in ("query", "key"):
            assert [(layer.kind, layer.uses) for layer in reg.layers
                    if layer.name.endswith(f"/{name}_1")] == [("dense", 2)] * 2, reg.summary()
    if family == "gemma":  # x * (1 + scale); kernels [heads, d, head_dim] contracted on axis 1
        assert reg.layers[0].kind == "tied_embedding"
        assert kinds["pre_attention_norm"] == {"scale_and_shift"}, reg.summary()
        query = [layer for layer in reg.layers if layer.name.endswith("query_1")][0]
        assert query.kind == "dense" and query.attrs["kernel_perm"] == (1, 0, 2)


@pytest.mark.parametrize("family,tied", [
    ("gpt2", True), pytest.param("bert", False, marks=pytest.mark.slow),
    pytest.param("llama", True, marks=pytest.mark.slow)])
def test_backbone_per_example_gradients_float32(family, tied):
    loss_fn, args, backbone = _model(family, "float32", tied=tied)
    reg = _assert_matches_loop(loss_fn, args, rtol=1e-4, atol=1e-6)
    assert not reg.generic_variables, reg.summary()
    assert reg.layers[0].kind == ("tied_embedding" if tied else "embedding"), reg.summary()


@pytest.mark.parametrize("family", ["gpt2", "deberta"])
def test_a_batch_of_one_registers_the_layers_of_any_other_batch(family):
    """On a static batch of one every unit axis could be the batch's: GPT-2's
    token lookup (ids ``[1, T]``) read as a position table's, taking the sum
    from its position table, and DeBERTa's relative embeddings, ``repeat``-ed
    once, read as the same for every example, so their query and key
    projections went generic. A Keras ``fit`` whose last batch was one
    example then stopped on "these arguments register different layers"."""
    loss_fn, (x, y), _ = _model(family)
    layers = [[(layer.kind, tuple(v.name for v in layer.variables))
               for layer in loss_fn.registration(x[:b], y[:b]).layers] for b in (B, 1)]
    assert layers[0] == layers[1]
    assert [kind for kind, _ in layers[0]].count("generic") == (3 if family == "deberta" else 0)


def test_an_empty_constant_whose_shape_holds_the_batch_size(keras_float64):
    """DeiT's encoder starts its outputs from ``empty((0, T, d))`` and
    ``empty((0, heads, T, T))``: at a batch equal to the head count (or to
    T or d) the pass took such a constant for a copy over the examples and
    indexed its first value, stopping on "index 0 is out of bounds".
    Float64: the distillation token's gradients are about 1e-6 here, where
    float32's rounding alone parts the two sides by their size."""
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.DeiTBackbone(
        image_shape=(16, 16, 3), patch_size=8, num_layers=1, num_heads=2, hidden_dim=8,
        intermediate_dim=16)

    @kg.auto_register
    def loss_fn(x):
        return tf.reduce_mean(tf.square(backbone(x)))

    x = tf.random.stateless_normal([2, 16, 16, 3], [0, 1], dtype=tf.float64)
    reg = loss_fn.registration(x)
    assert not reg.generic_variables, reg.summary()
    got = kg.per_example_gradients(loss_fn, x)
    for v, g, w in zip(reg.variables, got, one_example_loop(loss_fn, (x,), reg.variables)):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-15, err_msg=v.name)


def _trains(loss_fn, args, steps=20):
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(steps)]
    assert all(np.isfinite(losses)) and int(opt.skipped_steps) == 0, losses
    assert losses[-1] < 0.5 * losses[0], losses
    variables = loss_fn.registration(*args).variables
    fresh = kg.auto_register(loss_fn.python_function)  # DPSGD.step runs the pass itself
    dp = kg.DPSGD(fresh, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=0.5)
    before = [v.numpy() for v in variables]
    assert np.isfinite(float(dp.step(*args))) and int(dp.iterations) == 1
    assert all(np.all(np.isfinite(v.numpy())) for v in variables)
    assert any(not np.array_equal(b, v.numpy()) for b, v in zip(before, variables))


@pytest.mark.slow  # 30-80 s each, most of it building the first K-FAC and DP-SGD steps
@pytest.mark.parametrize("family,tied", [
    ("gpt2", True), ("bert", False), ("llama", False), ("llama", True), ("gemma", True),
    ("deberta", True)])
def test_backbone_trains_with_kfac_defaults_and_dpsgd(family, tied):
    loss_fn, args, _ = _model(family, "float32", tied=tied)
    _trains(loss_fn, args)


@pytest.mark.slow  # 2-3 minutes each: the step's XLA compile
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_whole_step_xla_with_a_covariance_period_matches_the_plain_step(family):
    """The step an accelerator runs by default (``jit_compile="auto"`` there:
    the whole step under XLA), with steps that skip the statistics: the same
    parameters as the plain step on four batches (exact-mode statistics: XLA
    and TensorFlow's kernels draw different samples)."""
    def train(jit):
        loss_fn, (x, y), backbone = _model(family, "float32", tied=True)
        opt = kg.KFAC(loss_fn, jit_compile=jit, cov_update_period=2, estimation_mode="exact")
        for shift in range(4):
            opt.step((x + shift) % V, (y + shift) % V)
        assert int(opt.skipped_steps) == 0
        return [v.numpy() for v in backbone.trainable_variables]

    assert_xla_matches_plain(train, False, rtol=2e-3, atol=2e-5)


def _tied_model(bias, form):
    """A raw tied table ``E [7, 3]``: ``z = tanh(mean_t E[x_t] W) E^T (+ b)``,
    the projection written as ``form``."""
    rng = np.random.RandomState(5)
    table = tf.Variable(rng.normal(size=(7, 3)), name="table")
    w = tf.Variable(rng.normal(size=(3, 3)), name="w")
    b = tf.Variable(rng.normal(size=(7,)), name="b")

    def logits(x):
        h = tf.tanh(tf.reduce_mean(tf.gather(table, x), axis=1) @ w)
        z = {"transpose_b": lambda: tf.matmul(h, table, transpose_b=True),
             "einsum": lambda: tf.einsum("bd,vd->bv", h, table),
             "transpose": lambda: h @ tf.transpose(table)}[form]()
        return z + b if bias else z

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits(x)))
    x = tf.constant(rng.randint(0, 7, (B, 4)))
    return loss_fn, logits, table, (x, tf.constant([1, 6, 0]))


@pytest.mark.parametrize("bias,form", [(False, "transpose_b"), (True, "einsum"),
                                       pytest.param(True, "transpose", marks=pytest.mark.slow)])
def test_tied_table_fisher_blocks_match_brute_force(bias, form):
    """The full block is the exact Fisher of the table (both uses and their
    cross terms); the default block its exact diagonal. A projection bias is
    a shift layer of its own."""
    loss_fn, logits, table, args = _tied_model(bias, form)
    reg = _assert_matches_loop(loss_fn, args, rtol=1e-6, atol=1e-12)
    got = [(layer.kind, [v.name.split(":")[0] for v in layer.variables]) for layer in reg.layers]
    assert got == [("tied_embedding", ["table"]), ("dense", ["w"])] + (
        [("scale_and_shift", ["b"])] if bias else []), got
    softmax_fisher = lambda z: (lambda p: tf.linalg.diag(p) - p[:, :, None] * p[:, None, :])(
        tf.nn.softmax(z))
    want = brute_fisher(lambda p, xx: logits(xx), [table], args[0], softmax_fisher)
    for approximation, expected in (("full", want), (None, np.diag(np.diag(want)))):
        est = kg.FisherEstimator(loss_fn, estimation_mode="exact", approximations=(
            {"tied_embedding": approximation} if approximation else None))
        est.update(*args)
        np.testing.assert_allclose(est.blocks[0].full_matrix(), expected, rtol=1e-6, atol=1e-12)
    report = kg.verify(loss_fn, *args, estimation_mode="exact")
    assert report.passed, report.table()


def test_table_projected_untransposed_stays_generic():
    """A square table looked up and also multiplied as stored (``h @ E``,
    not ``h @ E^T``) is no tied embedding: generic, with the reason; its
    per-example gradients (the lookup reads the variable's handle, rewritten
    as a read and a gather, ``gather_reads.py``) equal one-example tapes."""
    rng = np.random.RandomState(7)
    table = tf.Variable(rng.normal(size=(5, 5)), name="square")

    @kg.auto_register
    def loss_fn(x, y):
        h = tf.tanh(tf.reduce_mean(tf.gather(table, x), axis=1))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h @ table))

    args = (tf.constant(rng.randint(0, 5, (B, 4))), tf.constant([1, 4, 0]))
    reg = loss_fn.registration(*args)
    assert reg.layers[0].kind == "generic" and "different kinds" in reg.layers[0].reason
    grads = kg.per_example_gradients(loss_fn, *args)
    for i in range(B):
        with tf.GradientTape() as tape:
            loss = loss_fn(args[0][i:i + 1], args[1][i:i + 1])
        for g, w in zip(grads, tape.gradient(loss, reg.variables)):
            np.testing.assert_allclose(g[i], tf.convert_to_tensor(w), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bias", [False, True])
def test_tied_head_over_positions_through_tensordot(bias):
    """``keras.ops.matmul(h [B, T, d], transpose(E))`` (Keras writes it as a
    Tensordot: Reshape to ``[B*T, d]``, MatMul, Reshape back) with a
    per-token loss: the projection reads ``h`` with its batch axis, so the
    per-example gradients equal a loop and the Fisher update runs (before: a
    ``[B*T, ...]`` shape error)."""
    rng = np.random.RandomState(3)
    table = tf.Variable(rng.normal(size=(7, 3)), name="table")
    b = tf.Variable(rng.normal(size=(7,)), name="b")

    @kg.auto_register
    def loss_fn(x, y):
        h = tf.tanh(tf.gather(table, x))
        z = keras.ops.matmul(h, keras.ops.transpose(table))
        z = z + b if bias else z
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, z))

    x = tf.constant(rng.randint(0, 7, (B, 4)))
    args = (x, tf.constant(rng.randint(0, 7, (B, 4))))
    reg = _assert_matches_loop(loss_fn, args, rtol=1e-6, atol=1e-12)
    assert [layer.kind for layer in reg.layers] == ["tied_embedding"] + (
        ["scale_and_shift"] if bias else [])
    est = kg.FisherEstimator(loss_fn, approximations={"tied_embedding": "full"})
    est.update(*args)
    assert np.all(np.isfinite(est.blocks[0].full_matrix()))
