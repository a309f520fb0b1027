"""FisherEstimator in exact mode against brute-force Fishers (float64).

References never touch kfac_graph: per-example Jacobians of the model output
from tf.GradientTape, the loss's closed-form Fisher, numpy Kronecker products.
Every estimator here has the default cov_ema_decay (0.95) and one update, so
these also check that the debiased average equals that batch's estimate.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import fisher
from kfac_graph.fisher import block_choice

F64 = tf.float64


def _var(rng, shape, name):
    return tf.Variable(rng.normal(size=shape), dtype=F64, name=name)


def _brute(z_fn, params, fisher_z):
    """(1/B) sum_i J_i^T F_i J_i over ``params`` (each flattened row-major),
    J_i = dz_i/dtheta from tape.jacobian (no pfor)."""
    with tf.GradientTape(persistent=True) as tape:
        z = z_fn()
    jacs = tape.jacobian(z, params, experimental_use_pfor=False)
    b, k = z.shape
    j = np.concatenate([np.reshape(jj.numpy(), [b, k, -1]) for jj in jacs], -1)
    return np.einsum("bkn,bkl,blm->nm", j, fisher_z(z.numpy()), j) / b


def _softmax_fisher(z):
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bk,kl->bkl", p, np.eye(z.shape[-1])) - p[:, :, None] * p[:, None, :]


def _normal_fisher(z):
    return np.broadcast_to(2.0 * np.eye(z.shape[-1]), (z.shape[0],) + (z.shape[-1],) * 2)


def _sizes(variables):
    return [int(np.prod(v.shape)) for v in variables]


def _key(v):
    """Identifies a Keras variable and the tf.Variable behind it alike."""
    return id(v.handle)


def _restrict(full, all_vars, layer_vars):
    """The rows/columns of ``full`` (over ``all_vars``) of ``layer_vars``."""
    starts = np.cumsum([0] + _sizes(all_vars))
    index = {_key(v): i for i, v in enumerate(all_vars)}
    idx = np.concatenate([np.arange(starts[index[_key(v)]], starts[index[_key(v)] + 1])
                          for v in layer_vars])
    return full[np.ix_(idx, idx)]


@pytest.mark.parametrize("transposed", [False, True])
def test_single_dense_one_example_linear_model_is_exact(transposed):
    rng = np.random.default_rng(0)
    w = _var(rng, (2, 4) if transposed else (4, 2), "w")
    b = _var(rng, (2,), "b")
    x, y = tf.constant(rng.normal(size=(1, 4))), tf.constant(rng.normal(size=(1, 2)))
    model = lambda x: tf.matmul(x, w, transpose_b=transposed) + b

    est = kg.FisherEstimator(lambda x, y: tf.reduce_sum(tf.square(y - model(x))),
                             estimation_mode="exact")
    est.update(x, y)
    (layer,), (block,) = est.registration.layers, est.blocks
    assert layer.kind == "dense" and est.registration.loss.kind == "normal"
    assert isinstance(block, block_choice.TransposedKernelBlock) == transposed
    reference = _brute(lambda: model(x), [w, b], _normal_fisher)
    np.testing.assert_allclose(block.full_matrix(), reference, rtol=1e-10, atol=1e-12)


def test_mlp_kronecker_blocks_equal_kron_of_hand_factors():
    rng = np.random.default_rng(1)
    w1, b1, w2, b2 = (_var(rng, (3, 4), "w1"), _var(rng, (4,), "b1"),
                      _var(rng, (4, 3), "w2"), _var(rng, (3,), "b2"))
    x = rng.normal(size=(5, 3))
    y = tf.constant([0, 2, 1, 1, 0])

    def loss(x, y):
        h = tf.tanh(tf.matmul(x, w1) + b1)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, tf.matmul(h, w2) + b2))

    est = kg.FisherEstimator(loss, estimation_mode="exact")
    est.update(tf.constant(x), y)
    reg = est.registration
    assert [tuple(layer.variables) for layer in reg.layers] == [(w1, b1), (w2, b2)]
    assert [type(block) for block in est.blocks] == [fisher.FullyConnectedKroneckerBlock] * 2

    # By hand: activations, per-example output Jacobians J_i = dz_i/ds_i, F_i.
    h = np.tanh(x @ w1.numpy() + b1.numpy())
    z = h @ w2.numpy() + b2.numpy()
    f = _softmax_fisher(z)
    bar = lambda a: np.concatenate([a, np.ones((len(a), 1))], 1)
    j1 = np.einsum("ok,bo->bko", w2.numpy(), 1 - h ** 2)  # dz/ds1: [B, K, d1]
    factors = [(bar(x).T @ bar(x) / 5, np.einsum("bko,bkl,blp->op", j1, f, j1) / 5),
               (bar(h).T @ bar(h) / 5, f.mean(0))]
    for block, (a, g) in zip(est.blocks, factors):
        np.testing.assert_allclose(block.full_matrix(), np.kron(a, g), rtol=1e-9, atol=1e-12)


@pytest.fixture(scope="module")
def cnn():
    keras.utils.set_random_seed(2)
    model = keras.Sequential([
        keras.Input((5, 5, 2), dtype="float64"),
        keras.layers.Conv2D(3, 2, padding="same", activation="tanh", dtype="float64"),
        keras.layers.BatchNormalization(dtype="float64"),
        keras.layers.DepthwiseConv2D(2, depth_multiplier=2, strides=2, activation="tanh",
                                     dtype="float64"),
        keras.layers.Flatten(dtype="float64"),
        keras.layers.Dense(3, dtype="float64")])
    bn = model.layers[1]
    rng = np.random.default_rng(3)
    for v in (bn.gamma, bn.beta, bn.moving_mean):
        v.assign(rng.normal(size=3))
    bn.moving_variance.assign(rng.uniform(0.5, 2.0, size=3))
    x = tf.constant(rng.normal(size=(3, 5, 5, 2)))
    y = tf.constant([2, 0, 1])

    def loss(x, y):
        logits = model(x, training=False)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    variables = list(model.trainable_variables)
    reference = _brute(lambda: model(x, training=False), variables, _softmax_fisher)
    return loss, x, y, variables, reference


def test_cnn_diagonal_and_full_blocks_equal_the_brute_force_block(cnn):
    loss, x, y, variables, reference = cnn
    est = kg.FisherEstimator(loss, estimation_mode="exact", approximations={
        "conv2d": "diagonal", "depthwise_conv2d": "diagonal", "dense": "full",
        "scale_and_shift": "full"})
    est.update(x, y)
    kinds = [layer.kind for layer in est.registration.layers]
    assert kinds == ["conv2d", "scale_and_shift", "depthwise_conv2d", "dense"]
    assert [type(b) for b in est.blocks] == [
        fisher.ConvDiagonalBlock, fisher.ScaleAndShiftFullBlock,
        fisher.DepthwiseConvDiagonalBlock, fisher.NaiveFullBlock]
    ids = {_key(v) for v in variables}
    for layer, block in zip(est.registration.layers, est.blocks):
        assert all(_key(v) in ids for v in layer.variables), layer.name
        expected = _restrict(reference, variables, layer.variables)
        got = block.full_matrix().numpy()
        if isinstance(block, fisher.DiagonalBlock):
            expected = np.diag(np.diag(expected))
        np.testing.assert_allclose(got, expected, rtol=1e-8, atol=1e-12, err_msg=layer.name)


def test_cnn_kronecker_blocks_equal_the_brute_force_for_one_location():
    """A conv whose output has one location, on one example, with a linear
    model after it: KFC is exact there."""
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((3, 3, 2), dtype="float64"),
                              keras.layers.Conv2D(4, 3, dtype="float64"),
                              keras.layers.Flatten(dtype="float64")])
    x = tf.constant(np.random.default_rng(5).normal(size=(1, 3, 3, 2)))
    est = kg.FisherEstimator(lambda x: tf.reduce_sum(tf.square(model(x))),
                             estimation_mode="exact")
    est.update(x)
    (block,) = est.blocks
    assert isinstance(block, fisher.ConvKroneckerBlock)
    reference = _brute(lambda: model(x), list(model.trainable_variables), _normal_fisher)
    np.testing.assert_allclose(block.full_matrix(), reference, rtol=1e-10, atol=1e-12)


def test_tied_autoencoder_kernel_and_shift_blocks():
    """A kernel used as stored and transposed (per-example-gradient block),
    and the two biases as shift-only layers (fed xhat = 1)."""
    rng = np.random.default_rng(6)
    w, b_enc, b_dec = _var(rng, (5, 3), "w"), _var(rng, (3,), "b_enc"), _var(rng, (5,), "b_dec")

    def decode(x):
        h = tf.tanh(tf.matmul(x, w) + b_enc)
        return tf.matmul(h, w, transpose_b=True) + b_dec

    x = tf.constant(rng.normal(size=(4, 5)))
    est = kg.FisherEstimator(lambda x: tf.reduce_sum(tf.square(x - decode(x))),
                             estimation_mode="exact", approximations={"dense": "full"})
    est.update(x)
    layers = est.registration.layers
    assert [(layer.kind, layer.uses) for layer in layers] == [
        ("dense", 2), ("scale_and_shift", 1), ("scale_and_shift", 1)]
    assert isinstance(est.blocks[0], fisher.NaiveFullBlock)
    variables = [w, b_enc, b_dec]
    reference = _brute(lambda: decode(x), variables, _normal_fisher)
    for layer, block in zip(layers, est.blocks):
        np.testing.assert_allclose(block.full_matrix(), _restrict(reference, variables,
                                                                  layer.variables),
                                   rtol=1e-9, atol=1e-12, err_msg=layer.name)
    default = kg.FisherEstimator(est.fn, estimation_mode="exact")
    default.update(x)
    assert isinstance(default.blocks[0], fisher.NaiveDiagonalBlock)
    np.testing.assert_allclose(default.blocks[0].full_matrix(),
                               np.diag(np.diag(_restrict(reference, variables, [w]))),
                               rtol=1e-9, atol=1e-12)


def test_nchw_bias_add_shift_block():
    """A [C] shift added over NCHW (BiasAdd with data_format): the block sees
    channels-last data, where a [C] vector broadcasts over channels."""
    rng = np.random.default_rng(7)
    w, b = _var(rng, (2, 3), "w"), _var(rng, (3,), "b")

    def z_of(x):  # x [B, 2, 2, 2] (NCHW-ish): mix channels, then add b per channel
        h = tf.transpose(tf.tensordot(tf.transpose(x, [0, 2, 3, 1]), w, 1), [0, 3, 1, 2])
        return tf.reshape(tf.tanh(tf.nn.bias_add(h, b, data_format="NCHW")), [-1, 12])

    x = tf.constant(rng.normal(size=(3, 2, 2, 2)))
    est = kg.FisherEstimator(lambda x: tf.reduce_sum(tf.square(z_of(x))),
                             estimation_mode="exact", approximations={"dense": "full"})
    est.update(x)
    (shift,) = [i for i, layer in enumerate(est.registration.layers)
                if layer.kind == "scale_and_shift"]
    layer = est.registration.layers[shift]
    assert layer.attrs.get("data_format") in ("NCHW", b"NCHW")
    reference = _brute(lambda: z_of(x), [w, b], _normal_fisher)
    np.testing.assert_allclose(est.blocks[shift].full_matrix(),
                               _restrict(reference, [w, b], [b]), rtol=1e-9, atol=1e-12)


def test_embedding_one_lookup_and_a_dense_layer_used_twice():
    """Embedding Kronecker is exact for one example with one lookup; a
    dense layer applied twice gets the independent-uses block (R = 2)."""
    rng = np.random.default_rng(8)
    table, w, u = _var(rng, (5, 3), "table"), _var(rng, (3, 3), "w"), _var(rng, (3, 2), "u")

    def z_of(ids):
        h = tf.gather(table, ids)
        return tf.matmul(tf.tanh(tf.matmul(tf.tanh(tf.matmul(h, w)), w)), u)

    ids = tf.constant([3])
    est = kg.FisherEstimator(lambda ids: tf.reduce_sum(tf.square(z_of(ids))),
                             estimation_mode="exact")
    est.update(ids)
    layers = est.registration.layers
    assert [(layer.kind, layer.uses) for layer in layers] == [("embedding", 1), ("dense", 2),
                                                               ("dense", 1)]
    reference = _brute(lambda: z_of(ids), [table], _normal_fisher)
    np.testing.assert_allclose(est.blocks[0].full_matrix(), reference, rtol=1e-10, atol=1e-12)
    assert float(est.blocks[1].replicas) == 2.0
