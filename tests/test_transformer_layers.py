"""Transformer layers: Einsum projections (kernels of rank > 2) with their
biases, and position embeddings (a lookup of ids without a batch axis, or a
table slice, added over the batch). float64 throughout; B=3, T=4, d=8, 2 heads.

Shown: the hand-written encoder registers with no generic layer; its
per-example gradients and norms equal a loop of one-example tapes; kg.verify
passes in exact mode; an EinsumDense's full block equals the brute-force
Jacobian Fisher, and its Kronecker block too where K-FAC is exact (one
example, one position); kg.KFAC lowers the loss with no skipped step and
kg.DPSGD runs a step."""
import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import kfac_graph as kg
from fisher_reference import brute_fisher
from per_example_reference import one_example_loop
from passes.patterns_multiaxis import einsum_dense_axes

B, T, D, V, C = 3, 4, 8, 11, 5
F64 = "float64"


class Encoder(keras.Model):
    """Token + learned position embedding, MHA, LayerNorm, MLP, mean pool."""

    def __init__(self, position="embedding"):
        super().__init__(dtype=F64)
        self.position = position
        self.tok = keras.layers.Embedding(V, D, dtype=F64)
        if position == "embedding":
            self.pos = keras.layers.Embedding(T, D, dtype=F64)
        else:  # a longer table, sliced to T rows
            self.pos_table = self.add_weight(shape=(T + 2, D), initializer="random_normal",
                                             dtype=F64, name="pos_table")
        self.mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, dtype=F64)
        self.ln = keras.layers.LayerNormalization(dtype=F64)
        self.ff1 = keras.layers.Dense(16, activation="tanh", dtype=F64)
        self.ff2 = keras.layers.Dense(D, dtype=F64)
        self.out = keras.layers.Dense(C, dtype=F64)

    def call(self, x):
        pos = self.pos(tf.range(T)) if self.position == "embedding" else self.pos_table[:T]
        h = self.tok(x) + pos
        h = self.ln(h + self.mha(h, h))
        h = h + self.ff2(self.ff1(h))
        return self.out(tf.reduce_mean(h, axis=1))


def _loss(model):
    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))
    return loss_fn


def _encoder(position="embedding"):
    keras.utils.set_random_seed(0)
    model = Encoder(position)
    x = tf.constant(np.random.RandomState(0).randint(0, V, (B, T)))
    y = tf.constant([0, 3, 1])
    model(x)
    return model, _loss(model), (x, y)


def _assert_matches_loop(loss_fn, args):
    reg = loss_fn.registration(*args)
    got = kg.per_example_gradients(loss_fn, *args)
    want = one_example_loop(loss_fn, args, reg.variables)
    for v, g, w in zip(reg.variables, got, want):
        assert g.shape == (B, *v.shape)
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-12, err_msg=v.name)
    norms = np.sqrt(sum(np.sum(np.reshape(w, [B, -1]) ** 2, axis=1) for w in want))
    np.testing.assert_allclose(kg.per_example_gradient_norms(loss_fn, *args), norms, rtol=1e-6)
    return reg


@pytest.mark.parametrize("position", ["embedding", "slice"])
def test_encoder_registers_and_per_example_gradients_are_exact(position):
    """``slice``: ``x + table[:T]``, a static slice of a position table added
    with no ``BroadcastTo``, is a part of the table (``passes.variable_parts``)
    read as the lookup of ids ``range(0, T)`` (``POSITION_PART``; it had
    registered as a shift of that part, exact but not the layer the README's
    table says)."""
    model, loss_fn, args = _encoder(position)
    reg = _assert_matches_loop(loss_fn, args)
    kinds = [layer.kind for layer in reg.layers]
    assert "generic" not in kinds, reg.summary()
    assert kinds == ["embedding", "embedding"] + ["dense"] * 4 + ["scale_and_shift"] + ["dense"] * 3
    shapes = [[tuple(v.shape) for v in layer.variables] for layer in reg.layers]
    assert shapes[2:6] == [[(D, 2, 4), (2, 4)]] * 3 + [[(2, 4, D), (D,)]]
    pos = reg.layers[1]
    assert pos.attrs["ids_broadcast"] and pos.variables[0].shape[0] == (
        T if position == "embedding" else T + 2)
    assert [layer.attrs.get("kernel_in_axes") for layer in reg.layers[2:6]] == [1, 1, 1, 2]
    assert position != "embedding" or pos.name.rsplit("/", 1)[-1].startswith("embedding"), pos.name


def test_encoder_verifies_exactly():
    model, loss_fn, args = _encoder()
    report = kg.verify(loss_fn, *args, estimation_mode="exact")
    assert report.passed, report.table()
    assert all(row.check("fisher").status == "pass" for row in report.rows[:-1]), report.table()


def _trains(loss_fn, args):
    loss_fn.registration(*args)
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(5)]
    assert all(np.isfinite(losses)) and int(opt.skipped_steps) == 0
    assert losses[-1] < losses[0]
    variables = loss_fn.registration(*args).variables
    fresh = kg.auto_register(loss_fn.python_function)  # DPSGD.step runs the pass itself
    dp = kg.DPSGD(fresh, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=0.0)
    before = [v.numpy() for v in variables]
    assert np.isfinite(float(dp.step(*args))) and int(dp.iterations) == 1
    after = [v.numpy() for v in variables]
    assert any(not np.array_equal(b, a) for b, a in zip(before, after))


@pytest.mark.slow
def test_encoder_trains_with_kfac_and_dpsgd():
    model, loss_fn, args = _encoder()
    _trains(loss_fn, args)


@pytest.mark.slow
def test_einsum_dense_trains_with_kfac_and_dpsgd():
    model, loss_fn = _einsum_model("abc,cde->abde", "de")
    x = tf.random.stateless_normal([B, T, D], seed=[5, 6], dtype=F64)
    _trains(loss_fn, (x, tf.constant([0, 3, 1])))


def _einsum_model(equation, bias_axes, positions=T):
    """x [B, positions, D] -> EinsumDense -> tanh -> flatten -> Dense(C)."""
    keras.utils.set_random_seed(1)
    heads = equation.endswith("->abde")  # else the output projection "abcd,cde->abe"
    shape = (positions, 2, 4) if heads else (positions, D)
    layers = [keras.Input((positions, D) if heads else (positions, 2, 4),
                          dtype=F64),
              keras.layers.EinsumDense(equation, shape, bias_axes=bias_axes, activation="tanh",
                                       dtype=F64),
              keras.layers.Flatten(dtype=F64), keras.layers.Dense(C, dtype=F64)]
    model = keras.Sequential(layers)
    return model, _loss(model)


def _fisher_check(equation, bias_axes, batch, positions, approximation):
    model, loss_fn = _einsum_model(equation, bias_axes, positions)
    x = tf.random.stateless_normal([batch, *model.input_shape[1:]], seed=[1, 2], dtype=F64)
    y = tf.constant([0, 3, 1][:batch])
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact", approximations={
        "dense": approximation})
    est.update(x, y)
    layer = model.layers[0]
    params = list(layer.trainable_variables)
    want = brute_fisher(lambda p, xx: model(xx), params, x,
                        lambda z: (lambda p: tf.linalg.diag(p) - p[:, :, None] * p[:, None, :])(
                            tf.nn.softmax(z)))
    if approximation == "diagonal":
        want = np.diag(np.diag(want))
    np.testing.assert_allclose(est.blocks[0].full_matrix(), want, rtol=1e-6, atol=1e-12)
    vs = [tf.ones_like(v) for v in params]  # the damped inverse keeps the variables' shapes
    assert [tuple(t.shape) for t in est.blocks[0].multiply_inverse(vs)] == [
        tuple(v.shape) for v in params]


@pytest.mark.parametrize("equation,bias_axes", [("abc,cde->abde", "de"), ("abcd,cde->abe", "e")])
def test_einsum_dense_fisher_blocks_match_brute_force(equation, bias_axes):
    _fisher_check(equation, bias_axes, batch=3, positions=T, approximation="full")
    # K-FAC is exact for one example at one position: checks the kernel's layout
    _fisher_check(equation, bias_axes, batch=1, positions=1, approximation="kron")
    _fisher_check(equation, bias_axes, batch=3, positions=T, approximation="diagonal")


def test_raw_einsum_op_and_separate_bias():
    """tf.einsum (an Einsum op) with a [d, heads, head_dim] kernel and a bias
    of fewer axes than the kernel's outputs (`[head_dim]`: a shift layer), and
    an output projection [heads, head_dim, C] whose bias `[C]` joins it."""
    rng = np.random.RandomState(0)
    wq = tf.Variable(rng.normal(size=(D, 2, 4)) / 3, name="wq")
    bq = tf.Variable(rng.normal(size=(4,)), name="bq")
    wo = tf.Variable(rng.normal(size=(2, 4, C)) / 3, name="wo")
    bo = tf.Variable(rng.normal(size=(C,)), name="bo")

    @kg.auto_register
    def loss_fn(x, y):
        h = tf.tanh(tf.einsum("btc,cnh->btnh", x, wq) + bq)
        logits = tf.reduce_mean(tf.einsum("btnh,nhk->btk", h, wo) + bo, axis=1)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    x = tf.constant(rng.normal(size=(B, T, D)))
    args = (x, tf.constant([0, 3, 1]))
    reg = _assert_matches_loop(loss_fn, args)
    got = [(layer.kind, [v.name.split(":")[0] for v in layer.variables]) for layer in reg.layers]
    assert got == [("dense", ["wq"]), ("scale_and_shift", ["bq"]), ("dense", ["wo", "bo"])], got
    assert [layer.attrs.get("kernel_in_axes") for layer in reg.layers] == [1, None, 2]
    report = kg.verify(loss_fn, *args, estimation_mode="exact")
    assert report.passed, report.table()


@pytest.mark.parametrize("equation,axes", [
    ("abc,cde->abde", 1), ("abcd,cde->abe", 2), ("...c,cde->...de", 1), ("bc,cde->bde", 1),
    ("abc,dce->abde", 1), ("abc,cd->abd", None), ("abc,abd->acd", None), ("abc,bcd->abd", None),
    ("abc,cde->abed", 1), ("abc,cdc->abd", None),
    # outputs interleaved with the positions (a mixture of experts' input
    # kernels: every expert on every token), the positions kept in order
    ("abc,cde->aebd", 1), ("th,ehm->etm", 1), ("abc,cde->bdae", None),
    ("...c,cde->d...e", None)])
def test_einsum_dense_axes(equation, axes):
    assert einsum_dense_axes(equation) == axes


@pytest.mark.parametrize("equation,perm", [("btd,ndh->btnh", (1, 0, 2)),
                                           ("btd,dhn->btnh", (0, 2, 1))])
def test_einsum_op_kernel_in_another_order(equation, perm):
    """tf.einsum with the contracted axis not first in the kernel (Gemma's
    ``"btd,ndh->btnh"``), or the output axes in another order, and a bias
    ``[n, h]``: one dense layer on the permuted kernel, exact."""
    rng = np.random.RandomState(6)
    w_shape = {"n": 2, "d": D, "h": 3}
    w = tf.Variable(rng.normal(size=[w_shape[c] for c in equation.split(",")[1][:3]]) / 3)
    b = tf.Variable(rng.normal(size=(2, 3)))
    head = tf.Variable(rng.normal(size=(6, C)))

    @kg.auto_register
    def loss_fn(x, y):
        h = tf.tanh(tf.einsum(equation, x, w) + b)
        logits = tf.reshape(tf.reduce_mean(h, axis=1), [-1, 6]) @ head
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    args = (tf.constant(rng.normal(size=(B, T, D))), tf.constant([0, 3, 1]))
    reg = _assert_matches_loop(loss_fn, args)
    first = reg.layers[0]
    assert first.kind == "dense" and len(first.variables) == 2, reg.summary()
    assert first.attrs["kernel_perm"] == perm and first.attrs["kernel_in_axes"] == 1


@settings(max_examples=3, deadline=None)
@given(heads=st.integers(1, 3), head_dim=st.integers(1, 3), bias=st.sampled_from(["de", "e", None]))
def test_einsum_dense_forms_per_example_exact(heads, head_dim, bias):
    """Keras's projection "abc,cde->abde" with any heads and bias axes: a bias
    over both output axes joins the layer, one over head_dim alone (heads > 1)
    is a shift layer; the per-example gradients are exact either way."""
    keras.utils.set_random_seed(2)
    model = keras.Sequential([
        keras.Input((T, D), dtype=F64),
        keras.layers.EinsumDense("abc,cde->abde", (T, heads, head_dim), bias_axes=bias,
                                 activation="tanh", dtype=F64),
        keras.layers.Flatten(dtype=F64), keras.layers.Dense(C, dtype=F64)])
    loss_fn = _loss(model)
    x = tf.random.stateless_normal([B, T, D], seed=[3, 4], dtype=F64)
    reg = _assert_matches_loop(loss_fn, (x, tf.constant([0, 3, 1])))
    first = reg.layers[0]
    joins = bias == "de" or (bias == "e" and heads == 1)  # [head_dim] is then every output axis
    assert first.kind == "dense" and len(first.variables) == (2 if joins else 1), reg.summary()
    assert "generic" not in [layer.kind for layer in reg.layers]


def test_kernel_contracted_on_a_later_axis_is_a_dense_layer():
    """"abc,dce->abde" (Keras transposes the kernel [d, c, e] to [c, d, e]
    before its Reshape): a dense layer on the permuted kernel, exact
    per-example gradients; its blocks in the stored layout equal the brute
    force (Kronecker where K-FAC is exact: one example, one position)."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((T, D), dtype=F64),
        keras.layers.EinsumDense("abc,dce->abde", (T, 2, 4), bias_axes="de", activation="tanh",
                                 dtype=F64),
        keras.layers.Flatten(dtype=F64), keras.layers.Dense(C, dtype=F64)])
    loss_fn = _loss(model)
    x = tf.random.stateless_normal([B, T, D], seed=[7, 8], dtype=F64)
    reg = _assert_matches_loop(loss_fn, (x, tf.constant([0, 3, 1])))
    kernel = reg.layers[0]
    assert kernel.kind == "dense" and [tuple(v.shape) for v in kernel.variables] == [
        (2, D, 4), (2, 4)], reg.summary()
    assert kernel.attrs["kernel_perm"] == (1, 0, 2) and kernel.attrs["kernel_in_axes"] == 1
    _fisher_check("abc,dce->abde", "de", batch=3, positions=T, approximation="full")
    _fisher_check("abc,dce->abde", "de", batch=1, positions=1, approximation="kron")
    _fisher_check("abc,dce->abde", "de", batch=3, positions=T, approximation="diagonal")


@settings(max_examples=3, deadline=None)
@given(contracted=st.sampled_from([(D,), (2, 4)]), out=st.sampled_from([(3,), (2, 3), (1, 2, 2)]),
       bias=st.booleans(), ellipsis=st.booleans())
def test_einsum_op_forms_per_example_exact(contracted, out, bias, ellipsis):
    """tf.einsum with a kernel `[*contracted, *out]` contracted on its leading
    axes, positions written out or as an ellipsis, with or without a bias of
    the output axes: one dense layer, exact per-example gradients."""
    rng = np.random.RandomState(4)
    w = tf.Variable(rng.normal(size=contracted + out) / 3, name="w")
    b = tf.Variable(rng.normal(size=out), name="b")
    c_letters, o_letters = "cd"[:len(contracted)], "xyz"[:len(out)]
    pos = "..." if ellipsis else "bt"
    equation = f"{pos}{c_letters},{c_letters}{o_letters}->{pos}{o_letters}"
    head = tf.Variable(rng.normal(size=(int(np.prod(out)), C)), name="head")

    @kg.auto_register
    def loss_fn(x, y):
        h = tf.einsum(equation, x, w)
        h = tf.tanh(h + b if bias else h)
        logits = tf.reshape(tf.reduce_mean(h, axis=1), [-1, int(np.prod(out))]) @ head
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    x = tf.constant(rng.normal(size=(B, T, *contracted)))
    reg = _assert_matches_loop(loss_fn, (x, tf.constant([0, 3, 1])))
    k = len(contracted) if len(contracted + out) > 2 else None  # None: a plain 2-D kernel
    assert einsum_dense_axes(equation) == k
    first = reg.layers[0]
    assert first.kind == "dense" and len(first.variables) == 1 + bias, reg.summary()
    assert first.attrs.get("kernel_in_axes") == k


@pytest.mark.parametrize("equation", ["btc,tm->bmc", "btc,tm->bcm", "btc,mt->bmc", "keras"])
def test_token_mixing_einsum_is_a_dense_layer(equation):
    """A 2-D kernel contracted on an earlier axis of its input (MLP-Mixer's
    and gMLP's token mixing as one einsum; Keras's EinsumDense("abc,bd->adc"),
    whose bias is a shift of its own): a dense layer on the input with that
    axis moved last, the other axes rows (before: generic). Per-example
    gradients equal the loop, and verify passes with the exact Fisher."""
    rng = np.random.RandomState(4)
    x = tf.constant(rng.normal(size=(B, T, 3)))
    head = tf.Variable(rng.normal(size=(3, C)) / 2, name="head")
    if equation == "keras":
        keras.utils.set_random_seed(0)
        mix = keras.layers.EinsumDense("abc,bd->adc", output_shape=(5, 3), bias_axes="d",
                                       dtype=F64)
    else:
        w = tf.Variable(rng.normal(size=(T, 5) if "tm" in equation else (5, T)) / 2, name="mix")
        mix = lambda h: tf.einsum(equation, h, w)  # noqa: E731

    @kg.auto_register
    def loss_fn(x, y):
        h = tf.tanh(mix(x))
        pooled = tf.reduce_mean(h, axis=1 if equation in ("keras", "btc,tm->bmc",
                                                          "btc,mt->bmc") else 2)
        logits = pooled[:, :3] @ head
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    args = (x, tf.constant([0, 3, 1]))
    reg = _assert_matches_loop(loss_fn, args)
    assert reg.layers[0].kind == "dense" and reg.layers[0].attrs["input_perm"] == (0, 2, 1)
    report = kg.verify(loss_fn, *args, estimation_mode="exact")
    assert report.passed, report.table()


@pytest.mark.parametrize("equation,form", [
    ("abc,cd->abd", ("io", None, None)), ("abc,dc->abd", ("oi", None, None)),
    ("...c,cd->...d", ("io", None, None)), ("abc,bd->adc", ("io", (0, 2, 1), (0, 2, 1))),
    ("abc,cd->adb", ("io", None, (0, 2, 1))),
    ("bd,bo->do", None),  # contracts the examples' axis: no dense layer
    ("abc,bd->dac", None),  # puts the examples' axis elsewhere
    ("abc,bc->a", None), ("ab,cd->abd", None)])
def test_einsum_2d_forms(equation, form):
    from passes.einsum_2d import einsum_2d_form
    assert einsum_2d_form(equation) == form
