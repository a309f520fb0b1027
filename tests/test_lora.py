"""Low-rank adapters: Keras's ``enable_lora`` on Dense and EinsumDense.

The kernel ``K = W0 + s A B`` (W0 frozen) makes A and B two dense layers
(``passes/lora.py``, ``kfac_graph/layers/lora.py``); before, both were
generic ("no layer pattern matches its use by MatMul"). Float64 models
(Keras keeps the adapters themselves in float32, so their gradients are
compared at float32's precision): per-example gradients against a loop of
one-example tapes, the exact Fisher's full block against brute force, and
the Kronecker blocks against those of the same model written by hand as two
dense layers in a row.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_checks import block_matrix
from fisher_reference import softmax_fisher
from per_example_reference import assert_matches_loop

B, T, D, HEADS, HEAD, RANK, C = 3, 4, 5, 2, 3, 2, 3
ALPHA = 3  # the adapters' scale is ALPHA / RANK
F32 = dict(rtol=1e-5, atol=1e-7)


def _float64():
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)


def _adapted_model():
    """Dense -> query-like EinsumDense ``[D, heads, head]`` -> output-like
    ``[heads, head, D]`` -> Gemma's one-head value ``[1, D, D]`` (applied
    permuted) -> head; all but the head with adapters of rank 2."""
    x = keras.Input((T, D))
    dense = keras.layers.Dense(D, name="dense")
    query = keras.layers.EinsumDense("btd,dnh->btnh", (T, HEADS, HEAD), bias_axes="nh",
                                     name="query")
    out = keras.layers.EinsumDense("btnh,nhd->btd", (T, D), name="out")
    value = keras.layers.EinsumDense("btd,ndh->btnh", (T, 1, D), name="value")
    head = keras.layers.Dense(C, name="head")
    hidden = out(keras.activations.tanh(query(dense(x))))
    model = keras.Model(x, head(keras.layers.Reshape((T, D))(value(hidden))))
    for layer in (dense, query, out, value):
        layer.enable_lora(RANK, lora_alpha=ALPHA)
    rng = np.random.default_rng(1)
    for v in model.trainable_variables:  # B starts at zero: make every gradient nonzero
        v.assign(rng.normal(size=v.shape) * 0.4)
    return model


def _loss(model):
    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, model(x)))
    return loss_fn


def _args(rng=None):
    rng = rng or np.random.default_rng(0)
    return (tf.constant(rng.normal(size=(B, T, D))), tf.constant(rng.integers(0, C, (B, T))))


def test_adapters_are_dense_layers_and_match_loop():
    _float64()
    model = _adapted_model()
    loss_fn, args = _loss(model), _args()
    reg = assert_matches_loop(loss_fn, args, **F32)
    kinds = {v.name.split(":")[0]: layer.kind for layer in reg.layers for v in layer.variables}
    for name in ("dense", "query", "out", "value"):
        assert kinds[f"{name}/lora_kernel_a"] == kinds[f"{name}/lora_kernel_b"] == "dense"
    assert kinds["dense/bias"] == kinds["query/bias"] == "scale_and_shift"
    assert not any(k.endswith("/kernel") and not k.startswith("head") for k in kinds)
    assert _by_variable(reg, "value/lora_kernel_a").use_attrs[0]["kernel_perm"] == (1, 0, 2)
    names = [layer.name for layer in reg.layers]
    assert any(n.endswith("query_1/lora_a") for n in names), names
    norms = kg.per_example_gradient_norms(loss_fn, *args)
    grads = kg.per_example_gradients(loss_fn, *args)
    want = np.sqrt(sum(np.sum(np.reshape(g, (B, -1)) ** 2, axis=1) for g in grads))
    np.testing.assert_allclose(norms, want, rtol=1e-6)
    assert {layer.use_attrs[0]["lora"]["scale"] for layer in reg.layers
            if "lora" in layer.use_attrs[0]} == {ALPHA / RANK}


def _by_variable(reg, name):
    return next(layer for layer in reg.layers
                if layer.variables[0].name.split(":")[0] == name)


@pytest.mark.parametrize("which", [
    "query/lora_kernel_a", pytest.param("value/lora_kernel_b", marks=pytest.mark.slow),
    *(pytest.param(w, marks=pytest.mark.slow)  # (the same rule on other layouts)
      for w in ("query/lora_kernel_b", "out/lora_kernel_a", "value/lora_kernel_a"))])
def test_full_block_is_brute_force_fisher(which):
    _float64()
    model = _adapted_model()
    loss_fn, args = _loss(model), _args()
    layer = _by_variable(loss_fn.registration(*args), which)
    variable = layer.variables[0]
    with tf.GradientTape(persistent=True) as tape:  # the float32 adapter's own Jacobians
        z = tf.reshape(model(args[0]), [-1, C])
        entries = [[z[n, k] for k in range(C)] for n in range(B * T)]
    jac = np.stack([np.stack([np.reshape(tape.gradient(entries[n][k], variable), -1)
                              for k in range(C)]) for n in range(B * T)])
    # a mean over tokens: the Fisher sums an example's tokens, averages examples
    # (exact mode with a column per position and class is this Jacobian Fisher)
    want = np.einsum("nkp,nkl,nlq->pq", jac, softmax_fisher(z).numpy(), jac) / B
    got = block_matrix(loss_fn, args, layer, "dense", "full", position_columns="separate")
    np.testing.assert_allclose(got, want,
                               rtol=1e-5, atol=1e-9)


def test_kronecker_blocks_equal_two_dense_layers_written_out():
    """A query-like adapter's Kronecker blocks are those of ``x W0 +
    s (x A) B`` written with einsums (the pass matches those as plain dense
    layers, A's kernel multi-axis, B's applied at every position and head)."""
    _float64()
    rng = np.random.default_rng(2)
    layer = keras.layers.EinsumDense("btd,dnh->btnh", (T, HEADS, HEAD), name="query")
    layer.build((None, T, D))
    layer.enable_lora(RANK, lora_alpha=ALPHA)
    head = tf.Variable(rng.normal(size=(HEADS * HEAD, C)), name="head")
    for v in layer.trainable_variables:
        v.assign(rng.normal(size=v.shape) * 0.4)
    a, b = layer.lora_kernel_a, layer.lora_kernel_b
    scale = layer.lora_alpha / layer.lora_rank

    def written_out(x):  # (the adapters are float32, cast as Keras casts them)
        xa = scale * tf.einsum("btd,dnr->btnr", x, tf.cast(a, x.dtype))
        return (tf.einsum("btd,dnh->btnh", x, layer._kernel)
                + tf.einsum("btnr,rh->btnh", xa, tf.cast(b, x.dtype)))

    def losses(forward):
        @kg.auto_register
        def loss_fn(x, y):
            h = tf.reshape(tf.tanh(forward(x)), [-1, T, HEADS * HEAD])
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h @ head))
        return loss_fn

    args = _args(rng)
    adapted, reference = losses(layer), losses(written_out)
    for variable in (a, b):
        layers = [_by_variable(fn.registration(*args), variable.path)
                  for fn in (adapted, reference)]
        assert [layer.kind for layer in layers] == ["dense", "dense"]
        got, want = (block_matrix(fn, args, layer, "dense")
                     for fn, layer in zip((adapted, reference), layers))
        np.testing.assert_allclose(got, want, **F32, err_msg=variable.path)


def test_kfac_and_dp_sgd_train_the_adapters_alone():
    _float64()
    model = _adapted_model()
    loss_fn, args = _loss(model), _args()
    frozen = [v.numpy() for v in model.non_trainable_variables]
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(8)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses
    for v, before in zip(model.non_trainable_variables, frozen):
        np.testing.assert_array_equal(v.numpy(), before, err_msg=v.path)
    model = _adapted_model()
    loss_fn = _loss(model)
    dp = kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=0.0)
    before = float(loss_fn(*args))
    for _ in range(5):
        dp.step(*args)
    assert float(loss_fn(*args)) < before


def test_adapter_applied_transposed_stays_generic_and_exact():
    """A kernel ``W0 + A B`` applied as ``x K^T`` is left generic, saying why."""
    rng = np.random.default_rng(3)
    w0 = tf.constant(rng.normal(size=(C, D)))
    a = tf.Variable(rng.normal(size=(C, RANK)), name="a")
    b = tf.Variable(rng.normal(size=(RANK, D)), name="b")

    @kg.auto_register
    def loss_fn(x, y):
        logits = tf.matmul(x, w0 + 0.5 * tf.matmul(a, b), transpose_b=True)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    args = (tf.constant(rng.normal(size=(B, D))), tf.constant([0, 2, 1]))
    reg = assert_matches_loop(loss_fn, args)
    assert [layer.kind for layer in reg.layers] == ["generic", "generic"]
    assert "low-rank adapter's kernel is read by an op that applies it transposed" in (
        reg.layers[0].reason), reg.layers[0].reason


def test_trainable_base_kernel_is_a_third_dense_layer():
    """``(W0 + s A B)`` with W0 trainable too (a Keras adapter restored from a
    SavedModel, where the frozen flag is lost): three dense layers, exact."""
    rng = np.random.default_rng(4)
    w0 = tf.Variable(rng.normal(size=(D, C)), name="w0")
    a = tf.Variable(rng.normal(size=(D, RANK)), name="a")
    b = tf.Variable(rng.normal(size=(RANK, C)), name="b")

    @kg.auto_register
    def loss_fn(x, y):
        logits = tf.einsum("btd,dc->btc", x, w0 + 0.5 * tf.matmul(a, b))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    args = _args(rng)
    reg = assert_matches_loop(loss_fn, args)
    assert {layer.variables[0].name: layer.kind for layer in reg.layers} == {
        "w0:0": "dense", "a:0": "dense", "b:0": "dense"}


def test_adapter_on_rows_of_examples():
    """An adapted Dense on ``[k B, d]`` rows (a video's frames folded into the
    batch, VideoPrism's): A, B and the bias read each example's k rows."""
    _float64()
    dense = keras.layers.Dense(D, name="frames")
    dense.build((None, D))
    dense.enable_lora(RANK, lora_alpha=ALPHA)
    head = keras.layers.Dense(C, name="head")
    rng = np.random.default_rng(5)
    for v in dense.trainable_variables:
        v.assign(rng.normal(size=v.shape) * 0.4)

    @kg.auto_register
    def loss_fn(x, y):
        rows = dense(tf.reshape(x, [-1, D]))  # [B T, D]
        pooled = tf.reduce_mean(tf.reshape(tf.tanh(rows), [-1, T, D]), axis=1)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, head(pooled)))

    args = (_args(rng)[0], tf.constant([0, 2, 1]))
    reg = assert_matches_loop(loss_fn, args, **F32)
    assert {layer.kind for layer in reg.layers} == {"dense", "scale_and_shift"}
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(4)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses


def test_embedding_adapter_is_a_lookup_and_a_dense_layer():
    """``Embedding.enable_lora``: ``K[ids] = W0[ids] + s A[ids] B``; A is an
    embedding layer (output gradient ``s g B^T``), B a dense layer on ``s A[ids]``;
    their blocks are those of the lookup written out so."""
    _float64()
    rng = np.random.default_rng(6)
    table = keras.layers.Embedding(7, D, name="table")
    table.build((None, T))
    table.enable_lora(RANK, lora_alpha=ALPHA)
    for v in table.trainable_variables:
        v.assign(rng.normal(size=v.shape) * 0.4)
    head = tf.Variable(rng.normal(size=(D, C)), name="head")
    a, b = table.lora_embeddings_a, table.lora_embeddings_b

    def written_out(ids):
        rows = (ALPHA / RANK) * tf.gather(tf.cast(a, tf.float64), ids)
        return tf.gather(table._embeddings, ids) + rows @ tf.cast(b, tf.float64)

    def losses(lookup):
        @kg.auto_register
        def loss_fn(ids, y):
            pooled = tf.reduce_mean(tf.tanh(lookup(ids)), axis=1)
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                y, pooled @ head))
        return loss_fn

    args = (tf.constant(rng.integers(0, 7, (B, T))), tf.constant([0, 2, 1]))
    adapted, reference = losses(table), losses(written_out)
    reg = assert_matches_loop(adapted, args, **F32)
    assert [_by_variable(reg, v.path).kind for v in (a, b)] == ["embedding", "dense"]
    for variable in (a, b):
        layers = [_by_variable(fn.registration(*args), variable.path)
                  for fn in (adapted, reference)]
        assert layers[0].kind == layers[1].kind
        got, want = (block_matrix(fn, args, layer, layer.kind)
                     for fn, layer in zip((adapted, reference), layers))
        np.testing.assert_allclose(got, want, **F32, err_msg=variable.path)
    opt = kg.KFAC(adapted)
    losses_ = [float(opt.step(*args)) for _ in range(4)]
    assert losses_[-1] < losses_[0] and int(opt.skipped_steps) == 0, losses_


@pytest.mark.slow
def test_int8_quantized_layers_with_adapters():
    """``model.quantize("int8")`` then ``enable_lora`` (Keras's QLoRA recipe):
    the frozen int8 kernels apply through a custom gradient (the inputs are
    quantized, only their scale is differentiable, the gradient is the
    dequantized kernel's), which is replayed (``passes/custom_gradients.py``;
    differentiated through its forward, every per-example gradient was
    wrong); the adapters are two dense layers applied one after the other."""
    keras.utils.set_random_seed(0)
    x = keras.Input((T, D))
    hidden = keras.layers.Dense(8, activation="relu", name="dense")(x)
    hidden = keras.layers.EinsumDense("btd,dnh->btnh", (T, HEADS, HEAD), bias_axes="nh",
                                      name="query")(hidden)
    model = keras.Model(x, keras.layers.Dense(C, name="head")(
        keras.layers.Reshape((T, HEADS * HEAD))(hidden)))
    model.quantize("int8")
    rng = np.random.default_rng(7)
    for name in ("dense", "query"):
        model.get_layer(name).enable_lora(RANK)
    for v in model.trainable_variables:  # B starts at zero
        if "lora_kernel_b" in v.path:
            v.assign(rng.normal(size=v.shape).astype("float32") * 0.3)
    loss_fn = _loss(model)
    args = (tf.constant(rng.normal(size=(B, T, D)).astype("float32")),
            tf.constant(rng.integers(0, C, (B, T))))
    reg = assert_matches_loop(loss_fn, args, rtol=1e-4, atol=1e-6)
    assert {layer.kind for layer in reg.layers} == {"dense", "scale_and_shift"}, reg.summary()
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(4)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses
