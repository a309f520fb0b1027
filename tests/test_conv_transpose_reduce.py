"""K-FAC-reduce for transposed convolutions (``"kron_reduce"`` on the
``conv2d_transpose`` and ``conv3d_transpose`` kinds), in float64.

The definition, in numpy: the kernel's block is ``A (x) G`` (R = 1) in the
canonical order ``kron(G, A)``, with

    A = (1/B) sum_b xbar_b xbar_b^T,   xbar_b: example b's input averaged over its positions,
    G = sum_s (1/B) sum_b psum_b psum_b^T,   psum_b: its output-gradient patches summed there,

and the bias's exact block beside it, as in the expand block.
"""
import keras
import numpy as np
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import fisher
from kfac_graph.fisher import defaults
from fisher_checks import assert_damped_products, assert_same_inverse_products, updated_estimators
from fisher_reference import F64, np_patches

LAM = 0.3


def _float64():
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")


def _reduce_definition(x, dys, kernel, stride):
    """(kernel part, bias part, damped block) of K-FAC-reduce (VALID padding)."""
    b, cin = x.shape[0], x.shape[-1]
    xbar = x.reshape(b, -1, cin).mean(axis=1)
    a = xbar.T @ xbar / b
    g = 0
    for dy in dys:
        p = np_patches(dy, *kernel, (stride, stride))
        psum = p.reshape(b, -1, p.shape[-1]).sum(axis=1)
        g = g + psum.T @ psum / b
    r = np.sqrt(LAM)  # R = 1: the damping is not divided by the positions
    pi = np.sqrt((np.trace(a) / len(a)) / (np.trace(g) / len(g)))
    kernel_part = np.kron(g, a)  # canonical order: W[p, q, c, o], o (Cin_t) fastest
    bias_part = sum(dy.sum(axis=(1, 2)).T @ dy.sum(axis=(1, 2)) for dy in dys) / b
    n, m = len(kernel_part), len(bias_part)
    damped = np.zeros([n + m] * 2)
    damped[:n, :n] = np.kron(g + r / pi * np.eye(len(g)), a + pi * r * np.eye(len(a)))
    damped[n:, n:] = bias_part + LAM * np.eye(m)
    return kernel_part, bias_part, damped


def test_reduce_block_against_definition():
    rng = np.random.default_rng(0)
    cout, cin, kernel, stride = 2, 3, (2, 2), 2
    x = rng.normal(size=(3, 2, 3, cin))
    dys = [rng.normal(size=(3, 4, 6, cout)) for _ in range(2)]
    attrs = dict(strides=[1, stride, stride, 1], padding="VALID")
    block = fisher.ConvTransposeKroneckerReduceBlock([(*kernel, cout, cin), (cout,)], attrs,
                                                     dtype=F64, ema_decay=0.0, damping=LAM)
    block.update([(tf.constant(x), [tf.constant(d) for d in dys])])
    kernel_part, bias_part, damped = _reduce_definition(x, dys, kernel, stride)
    full = block.full_matrix().numpy()
    n = len(kernel_part)
    np.testing.assert_allclose(full[:n, :n], kernel_part, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(full[n:, n:], bias_part, rtol=1e-10, atol=1e-12)
    assert not np.any(full[:n, n:])
    assert float(block.parts[0].block.replicas) == 1.0
    assert_damped_products(block, damped)


def test_reduce_block_two_uses_average_inputs_and_sum_gradients_over_both():
    rng = np.random.default_rng(1)
    uses = [(rng.normal(size=(3, 2, 2, 2)), rng.normal(size=(3, 4, 4, 1))) for _ in range(2)]
    block = fisher.ConvTransposeKroneckerReduceBlock(
        [(2, 2, 1, 2)], dict(strides=[1, 2, 2, 1], padding="VALID"), dtype=F64, ema_decay=0.0)
    block.update([(tf.constant(x), tf.constant(dy)) for x, dy in uses])
    xbar = sum(x.reshape(3, -1, 2).sum(axis=1) for x, _ in uses) / 8  # 2 uses x 4 positions
    psum = sum(np_patches(dy, 2, 2, (2, 2)).reshape(3, -1, 4).sum(axis=1) for _, dy in uses)
    want = np.kron(psum.T @ psum / 3, xbar.T @ xbar / 3)
    np.testing.assert_allclose(block.full_matrix().numpy(), want, rtol=1e-10, atol=1e-12)


def _decoder(rng):
    up = keras.layers.Conv2DTranspose(3, 3, strides=2, padding="same")
    head = keras.layers.Dense(2)
    x = tf.constant(rng.normal(size=(8, 3, 3, 2)))
    y = tf.constant(rng.integers(0, 2, size=8))

    @kg.auto_register
    def loss_fn(x, y):
        logits = head(tf.reduce_mean(tf.tanh(up(x)), axis=(1, 2)))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    return loss_fn, x, y


def test_estimator_selects_reduce_for_the_kind_and_equals_expand_at_one_position():
    _float64()
    rng = np.random.default_rng(2)
    up, head = keras.layers.Conv2DTranspose(3, 2, strides=2), keras.layers.Dense(2)
    x = tf.constant(rng.normal(size=(6, 1, 1, 2)))  # one input position: reduce = expand
    y = tf.constant(rng.integers(0, 2, size=6))

    @kg.auto_register
    def loss_fn(x, y):
        logits = head(tf.reshape(tf.tanh(up(x)), [6, -1]))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    ests = updated_estimators(loss_fn, (x, y), (None, {"conv2d_transpose": "kron_reduce"}))
    assert type(ests[1].blocks[0]).__name__ == "ConvTransposeKroneckerReduceBlock"
    assert ests[1].memory()["layers"][0]["positions"] == "reduce"
    np.testing.assert_allclose(ests[1].blocks[0].full_matrix(), ests[0].blocks[0].full_matrix(),
                               rtol=1e-10, atol=1e-14)
    assert_same_inverse_products(ests[1], ests[0], loss_fn.registration(x, y).variables, rng)


def test_kfac_trains_a_decoder_with_reduce():
    _float64()
    loss_fn, x, y = _decoder(np.random.default_rng(3))
    opt = kg.KFAC(loss_fn, damping=1e-2, momentum_type="regular", learning_rate=0.2,
                  inverse_update_period=2, approximations={"conv2d_transpose": "kron_reduce"})
    losses = [float(opt.step(x, y)) for _ in range(15)]
    assert np.all(np.isfinite(losses)) and int(opt.skipped_steps) == 0
    assert losses[-1] < 0.8 * losses[0], losses
    assert opt.memory()["layers"][0]["positions"] == "reduce"


def test_conv3d_transpose_offers_reduce_too():
    assert (defaults.kind_blocks("conv3d_transpose")["kron_reduce"]
            is fisher.ConvTransposeKroneckerReduceBlock)
