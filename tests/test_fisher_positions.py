"""K-FAC-expand and K-FAC-reduce (Eschenhagen et al. 2023) against their
definitions, in float64.

References: the layer input `a` and the per-example output gradients
`g_{b,t} = d l_b / d s_{b,t}` come from GradientTape on a hand-written copy
of the forward pass; the factors are built from them in numpy:

    expand: A = cov over all B*T rows of [a, 1],  G likewise, F = T (A (x) G);
    reduce: A = (1/B) sum_b abar abar^T (abar: the mean of [a, 1] over t),
            G = (1/B) sum_b gsum gsum^T (gsum: the sum of g over t), F = A (x) G.
"""
import hypothesis
from hypothesis import strategies as st
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import fisher
from fisher_reference import F64, brute_fisher, cov, homog, np_patches, operator_matrix
from fisher_reference import pi_damped_kron
from fisher_checks import assert_same_inverse_products, updated_estimators

LAM = 0.3
KW = dict(dtype=F64, ema_decay=0.0, damping=LAM)


def _float64():
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")


def _reduce_factors(a, gs):
    """(A, G) of K-FAC-reduce: a [B, T, d] (bias: pass homog(a)), gs a list
    of [B, T, d_out] sources."""
    abar = a.mean(axis=1)
    g = sum(np.einsum("bi,bj->ij", s.sum(1), s.sum(1)) for s in gs) / a.shape[0]
    return abar.T @ abar / a.shape[0], g


def _expand_factors(a, gs):
    return cov(a), sum(cov(s) for s in gs)


# --- the blocks against their definitions ---------------------------------------------


def test_dense_reduce_block_against_definition():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(4, 3, 5))
    gs = [rng.normal(size=(4, 3, 2)) for _ in range(2)]
    block = fisher.FullyConnectedKroneckerReduceBlock([(5, 2), (2,)], **KW)
    block.update([(tf.constant(a), [tf.constant(g) for g in gs])])
    want_a, want_g = _reduce_factors(homog(a), gs)
    np.testing.assert_allclose(block.input_factor.value(), want_a, rtol=1e-12)
    np.testing.assert_allclose(block.output_factor.value(), want_g, rtol=1e-12)
    np.testing.assert_allclose(block.full_matrix(), np.kron(want_a, want_g), atol=1e-12)
    block.update_inverses()
    damped = pi_damped_kron(want_a, want_g, LAM, 1.0)  # R = 1: the damping is not divided
    np.testing.assert_allclose(operator_matrix(block.multiply, block.var_shapes), damped,
                               rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(operator_matrix(block.multiply_inverse, block.var_shapes),
                               np.linalg.inv(damped), rtol=1e-7, atol=1e-9)


def test_dense_reduce_averages_over_uses_of_different_lengths():
    rng = np.random.default_rng(1)
    uses = [(rng.normal(size=(3, t, 4)), rng.normal(size=(3, t, 2))) for t in (2, 5)]
    block = fisher.FullyConnectedKroneckerReduceBlock([(4, 2)], num_uses=2, **KW)
    block.update([(tf.constant(a), tf.constant(g)) for a, g in uses])
    a_all = np.concatenate([a for a, _ in uses], axis=1)
    g_all = np.concatenate([g for _, g in uses], axis=1)
    want_a, want_g = _reduce_factors(a_all, [g_all])
    np.testing.assert_allclose(block.full_matrix(), np.kron(want_a, want_g), atol=1e-12)


def test_conv_reduce_block_against_hand_patches():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 5, 6, 2))
    attrs = dict(strides=[1, 2, 2, 1], padding="SAME", data_format="NHWC")
    block = fisher.ConvKroneckerReduceBlock([(2, 3, 2, 4), (4,)], attrs, **KW)
    patches = np_patches(x, 2, 3, (2, 2), padding="SAME")  # [B, T, 12]
    g = rng.normal(size=(3, 3, 3, 4))
    block.update([(tf.constant(x), tf.constant(g))])
    want_a, want_g = _reduce_factors(homog(patches), [g.reshape(3, 9, 4)])
    np.testing.assert_allclose(block.full_matrix(), np.kron(want_a, want_g), atol=1e-12)


def test_depthwise_reduce_block_against_hand_patches():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 4, 4, 3))
    attrs = dict(strides=[1, 1, 1, 1], padding="VALID", data_format="NHWC")
    block = fisher.DepthwiseConvKroneckerReduceBlock([(2, 2, 3, 2), (6,)], attrs, **KW)
    g = rng.normal(size=(2, 3, 3, 6))
    block.update([(tf.constant(x), tf.constant(g))])
    for c in range(3):
        patches = np_patches(x[..., c:c + 1], 2, 2)  # [B, 9, 4]
        want_a, want_g = _reduce_factors(homog(patches), [g.reshape(2, 9, 3, 2)[:, :, c]])
        np.testing.assert_allclose(block.input_factor.value()[c], want_a, atol=1e-12)
        np.testing.assert_allclose(block.output_factor.value()[c], want_g, atol=1e-12)


@hypothesis.settings(max_examples=15, deadline=None, database=None)
@hypothesis.given(batch=st.integers(1, 4), d_in=st.integers(1, 4), d_out=st.integers(1, 3),
                  bias=st.booleans(), uses=st.integers(1, 3), sources=st.integers(1, 3),
                  seed=st.integers(0, 2 ** 16))
def test_reduce_equals_expand_with_one_position_per_use_property(batch, d_in, d_out, bias,
                                                                 uses, sources, seed):
    """One position per use and one use: the same block; U uses of one
    position each: reduce's A is the outer product of the uses' mean, expand's
    the mean of the outer products (their difference is the uses' covariance)."""
    rng = np.random.default_rng(seed)
    shapes = [(d_in, d_out)] + [(d_out,)] * bias
    data = [(rng.normal(size=(batch, 1, d_in)),
             [rng.normal(size=(batch, 1, d_out)) for _ in range(sources)]) for _ in range(uses)]
    tensors = [(tf.constant(a), [tf.constant(g) for g in gs]) for a, gs in data]
    expand = fisher.FullyConnectedKroneckerBlock(shapes, num_uses=uses, **KW)
    reduce = fisher.FullyConnectedKroneckerReduceBlock(shapes, num_uses=uses, **KW)
    expand.update(tensors)
    reduce.update(tensors)
    a = np.concatenate([a for a, _ in data], axis=1)  # [B, U, d_in]: uses as positions
    a = homog(a) if bias else a
    gs = [np.concatenate([gs[s] for _, gs in data], axis=1) for s in range(sources)]
    want_a, want_g = _reduce_factors(a, gs)
    np.testing.assert_allclose(reduce.full_matrix(), np.kron(want_a, want_g), atol=1e-12)
    if uses == 1:
        np.testing.assert_allclose(reduce.full_matrix(), expand.full_matrix(), atol=1e-12)
        reduce.update_inverses()
        expand.update_inverses()
        vs = [tf.constant(rng.normal(size=s)) for s in shapes]
        for got, want in zip(reduce.multiply_inverse(vs), expand.multiply_inverse(vs)):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


# --- through the estimator: Dense and EinsumDense on [B, T, d] ----------------------------


def _sequence_model(rng, projection, t=3, d=4, k=3):
    """x [B, T, d] -> projection -> tanh -> flatten -> Dense(k): the loss and
    a reference ``fn(x) -> (s, per-example losses)`` written by hand."""
    _float64()
    head = keras.layers.Dense(k)
    if projection == "dense":
        layer = keras.layers.Dense(2)
        project = lambda x: tf.einsum("btd,de->bte", x, layer.kernel) + layer.bias  # noqa
    elif projection == "transposed":  # a kernel stored [d_out, d_in]
        w, b = tf.Variable(rng.normal(size=(2, d))), tf.Variable(rng.normal(size=2))
        project = lambda x: tf.matmul(x, w, transpose_b=True) + b  # noqa
        layer = project
    else:
        layer = keras.layers.EinsumDense("btd,dhk->bthk", output_shape=(t, 2, 2), bias_axes="hk")
        project = lambda x: tf.einsum("btd,dhk->bthk", x, layer.kernel) + layer.bias  # noqa
    x = tf.constant(rng.normal(size=(5, t, d)))
    y = tf.constant(rng.integers(0, k, size=5))
    head(tf.reshape(layer(x), [5, -1]))  # builds the variables

    def rest(s):
        return head(tf.reshape(tf.tanh(s), [s.shape[0], -1]))

    def loss_fn(x, y):
        logits = rest(layer(x))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    def reference(x, y):
        s = project(x)
        return s, tf.nn.sparse_softmax_cross_entropy_with_logits(y, rest(s))

    return loss_fn, reference, x, y


@pytest.mark.parametrize("projection", ["dense", "einsum", "transposed"])
def test_estimator_expand_and_reduce_against_definitions(projection):
    rng = np.random.default_rng(4)
    loss_fn, reference, x, y = _sequence_model(rng, projection)
    with tf.GradientTape() as tape:
        s, losses = reference(x, y)
        total = tf.reduce_sum(losses)
    g = tape.gradient(total, s).numpy()
    g = g.reshape(g.shape[0], g.shape[1], -1)  # [B, T, d_out]
    a = homog(x.numpy())
    fn = kg.auto_register(loss_fn)
    for positions, factors, replicas in (("kron_expand", _expand_factors, 3.0),
                                         ("kron_reduce", _reduce_factors, 1.0)):
        est = kg.FisherEstimator(fn, estimation_mode="empirical",
                                 approximations={"dense": positions})
        est.update(x, y)
        want_a, want_g = factors(a, [g])
        block = est.blocks[0]
        if projection == "transposed":  # the block inside, on [d_in, d_out]
            assert isinstance(block, fisher.TransposedKernelBlock)
            block = block.block
        np.testing.assert_allclose(block.full_matrix(), replicas * np.kron(want_a, want_g),
                                   rtol=1e-6, atol=1e-12)
        assert est.memory()["layers"][0]["positions"] == positions.split("_")[1]


def test_reduce_equals_expand_with_one_position():
    _float64()
    rng = np.random.default_rng(5)
    layer, head = keras.layers.Dense(3), keras.layers.Dense(2)
    x = tf.constant(rng.normal(size=(6, 1, 4)))
    y = tf.constant(rng.integers(0, 2, size=6))

    @kg.auto_register
    def loss_fn(x, y):
        logits = head(tf.reshape(tf.tanh(layer(x)), [-1, 3]))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    ests = updated_estimators(loss_fn, (x, y), (None, {"dense": "kron_reduce"}))
    for i in range(2):
        np.testing.assert_allclose(ests[1].blocks[i].full_matrix(), ests[0].blocks[i].full_matrix(),
                                   rtol=1e-10)
    assert_same_inverse_products(ests[1], ests[0], loss_fn.registration(x, y).variables, rng)


def test_reduce_is_exact_for_one_example_with_inputs_shared_over_positions():
    """a_{b,t} = a_b: each example's gradient is abar (x) gsum, so for one example
    reduce equals the brute-force Fisher (and expand does not)."""
    rng = np.random.default_rng(6)
    w = tf.Variable(rng.normal(size=(3, 2)))
    b = tf.Variable(rng.normal(size=2))
    mix = tf.constant(rng.normal(size=(4, 2)))  # position weights

    def model(params, x):
        a = tf.tile(x[:, None, :], [1, 4, 1])  # [B, T, d]: the same input at every t
        s = tf.einsum("btd,de->bte", a, params[0]) + params[1]
        return tf.einsum("bte,te->be", tf.tanh(s), mix)

    x = tf.constant(rng.normal(size=(1, 3)))
    want = brute_fisher(model, [w, b], x, lambda z: fisher.Categorical(z).fisher())

    @kg.auto_register
    def loss_fn(x, y):
        z = model([w, b], x)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, z))

    y = tf.constant([1])
    got = {}
    for choice in ("kron_expand", "kron_reduce"):
        est = kg.FisherEstimator(loss_fn, estimation_mode="exact",
                                 approximations={"dense": choice})
        est.update(x, y)
        got[choice] = est.blocks[0].full_matrix().numpy()
    np.testing.assert_allclose(got["kron_reduce"], want, rtol=1e-6, atol=1e-12)
    assert not np.allclose(got["kron_expand"], want, rtol=1e-3)


def test_reduce_is_not_offered_for_embeddings():
    _float64()
    table = tf.Variable(np.ones((5, 2)))

    @kg.auto_register
    def loss_fn(ids, y):
        z = tf.reduce_sum(tf.nn.embedding_lookup(table, ids), axis=1)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, z))

    est = kg.FisherEstimator(loss_fn, approximations={"embedding": "kron_reduce"})
    with pytest.raises(ValueError, match="kron_reduce.*embedding"):
        est.build(tf.constant([[1, 2]]), tf.constant([0]))


@pytest.mark.parametrize("choice", ["kron_expand", "kron_reduce"])
def test_kfac_trains_with_expand_and_reduce(choice):
    _float64()
    rng = np.random.default_rng(7)
    proj = keras.layers.EinsumDense("btd,dk->btk", output_shape=(None, 8), bias_axes="k")
    conv = keras.layers.Conv1D(4, 3, padding="same")
    head = keras.layers.Dense(3)
    x = tf.constant(rng.normal(size=(32, 6, 5)))
    y = tf.constant((x.numpy().sum(axis=(1, 2)) > 0).astype(np.int32)
                    + (x.numpy()[:, 0, 0] > 0).astype(np.int32))

    def loss_fn(x, y):
        h = tf.nn.relu(conv(tf.tanh(proj(x))))
        logits = head(tf.reduce_mean(h, axis=1))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    opt = kg.KFAC(loss_fn, damping=1e-2, momentum_type="regular", learning_rate=0.2,
                  inverse_update_period=2,
                  approximations={"dense": choice, "conv2d": choice})
    losses = [float(opt.step(x, y)) for _ in range(25)]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.6 * losses[0]
    assert {r["positions"] for r in opt.memory()["layers"]} == {choice.split("_")[1]}


def test_reduce_by_layer_name_leaves_the_other_layers_expanded():
    _float64()
    rng = np.random.default_rng(8)
    first, second, head = keras.layers.Dense(3), keras.layers.Dense(3), keras.layers.Dense(2)
    x = tf.constant(rng.normal(size=(4, 5, 2)))
    y = tf.constant(rng.integers(0, 2, size=4))

    @kg.auto_register
    def loss_fn(x, y):
        h = tf.tanh(second(tf.tanh(first(x))))
        logits = head(tf.reduce_mean(h, axis=1))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    names = [layer.name for layer in loss_fn.registration(x, y).layers]
    est = kg.FisherEstimator(loss_fn, approximations={names[1]: "kron_reduce"})
    est.update(x, y)
    assert [type(b).__name__ for b in est.blocks] == [
        "FullyConnectedKroneckerBlock", "FullyConnectedKroneckerReduceBlock",
        "FullyConnectedKroneckerBlock"]
    assert [float(b.replicas) for b in est.blocks] == [5.0, 1.0, 1.0]
    rows = est.summary().splitlines()
    assert " reduce " in rows[3] and " expand " in rows[2] and " expand " in rows[4]
