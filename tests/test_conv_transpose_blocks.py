"""The Fisher blocks of transposed convolutions against numpy, in float64.

Expand (the default ``"kron"``, ``fisher/blocks_conv_transpose.py``): KFC on
the kernel with the factors swapped, ``R kron(G, A)`` in the canonical order,
A over the layer input's positions, G over the output gradient's patches
there, and the bias's exact block beside it.

Reduce (``"kron_reduce"`` on the ``conv2d_transpose`` and
``conv3d_transpose`` kinds): the kernel's block is ``A (x) G`` (R = 1) in
the canonical order ``kron(G, A)``, with

    A = (1/B) sum_b xbar_b xbar_b^T,   xbar_b: example b's input averaged over its positions,
    G = sum_s (1/B) sum_b psum_b psum_b^T,   psum_b: its output-gradient patches summed there,

and the bias's exact block beside it, as in the expand block.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import fisher
from kfac_graph.fisher import defaults
from fisher_checks import assert_damped_products, assert_same_inverse_products, updated_estimators
from fisher_reference import F64, np_patches, operator_matrix, out_size

LAM = 0.3


def _float64():
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")


# -- expand (the default "kron"): KFC with the factors swapped --------------------------


def _np_block(x, dys, kernel, stride, padding, bias):
    """The stated approximation in numpy: (kernel part, bias part, damped)."""
    kh, kw = kernel
    a = x.reshape(-1, x.shape[-1])
    a_cov = a.T @ a / len(a)
    g_cov = 0
    for dy in dys:
        p = np_patches(dy, kh, kw, (stride, stride), padding=padding).reshape(len(a), -1)
        g_cov = g_cov + p.T @ p / len(p)
    t = x.shape[1] * x.shape[2]
    kernel_part = t * np.kron(g_cov, a_cov)  # canonical order: W[p, q, c, o], o fastest
    r = np.sqrt(LAM / t)
    pi = np.sqrt((np.trace(a_cov) / len(a_cov)) / (np.trace(g_cov) / len(g_cov)))
    damped_kernel = t * np.kron(g_cov + r / pi * np.eye(len(g_cov)),
                                a_cov + pi * r * np.eye(len(a_cov)))
    if not bias:
        return kernel_part, None, damped_kernel
    bias_part = sum(dy.sum(axis=(1, 2)).T @ dy.sum(axis=(1, 2)) for dy in dys) / len(x)
    damped = np.zeros([len(kernel_part) + len(bias_part)] * 2)
    damped[:len(kernel_part), :len(kernel_part)] = damped_kernel
    damped[len(kernel_part):, len(kernel_part):] = bias_part + LAM * np.eye(len(bias_part))
    return kernel_part, bias_part, damped


@pytest.mark.parametrize("case", [((3, 3), 2, "SAME", True, "NHWC"),
                                  ((3, 3), 1, "SAME", True, "NCHW"),
                                  ((2, 2), 2, "VALID", False, "NHWC"),
                                  ((1, 3), 1, "VALID", True, "NHWC")])
def test_kronecker_block_against_numpy(case):
    kernel, stride, padding, bias, fmt = case
    rng = np.random.default_rng(4)
    cout, cin, hy, wy = 2, 2, 5, 6
    dys = [rng.normal(size=(2, hy, wy, cout)) for _ in range(2)]
    hx, wx = (out_size(s, k, stride, 1, padding) for s, k in zip((hy, wy), kernel))
    x = rng.normal(size=(2, hx, wx, cin))
    strides, to_fmt = [1, stride, stride, 1], lambda t: tf.constant(t)  # noqa: E731
    if fmt == "NCHW":
        strides, to_fmt = [1, 1, stride, stride], lambda t: tf.constant(t.transpose(0, 3, 1, 2))
    attrs = dict(strides=strides, padding=padding, kernel_shape=(*kernel, cout, cin),
                 data_format=fmt)
    shapes = [(*kernel, cout, cin)] + ([(cout,)] if bias else [])
    block = fisher.ConvTransposeKroneckerBlock(shapes, attrs, dtype=F64, ema_decay=0.0,
                                               damping=LAM)
    block.update([(to_fmt(x), [to_fmt(d) for d in dys])])
    kernel_part, bias_part, damped = _np_block(x, dys, kernel, stride, padding, bias)
    full = block.full_matrix().numpy()
    n = len(kernel_part)
    np.testing.assert_allclose(full[:n, :n], kernel_part, rtol=1e-10, atol=1e-12)
    if bias:
        np.testing.assert_allclose(full[n:, n:], bias_part, rtol=1e-10, atol=1e-12)
        assert not np.any(full[:n, n:]) and not np.any(full[n:, :n])
    assert float(block.parts[0].block.replicas) == hx * wx
    if kernel == (3, 3):
        return  # the products: on the smaller cases
    assert_damped_products(block, damped)
    shapes = block.var_shapes
    chol = operator_matrix(block.multiply_cholesky, shapes)
    np.testing.assert_allclose(chol @ chol.T, damped, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(operator_matrix(block.multiply_cholesky_inverse, shapes),
                               np.linalg.inv(chol), rtol=1e-7, atol=1e-9)


def test_kronecker_block_two_uses():
    """Uses independent: A, G averaged over both uses' rows, R = T U; the
    bias's block from the gradient summed over the uses."""
    rng = np.random.default_rng(5)
    uses = [(rng.normal(size=(3, 2, 2, 2)), rng.normal(size=(3, 4, 4, 1))) for _ in range(2)]
    attrs = dict(strides=[1, 2, 2, 1], padding="VALID")
    block = fisher.ConvTransposeKroneckerBlock([(2, 2, 1, 2), (1,)], attrs, dtype=F64,
                                               ema_decay=0.0)
    block.update([(tf.constant(x), tf.constant(dy)) for x, dy in uses])
    a = np.concatenate([x.reshape(-1, 2) for x, _ in uses])
    p = np.concatenate([np_patches(dy, 2, 2, (2, 2)).reshape(-1, 4) for _, dy in uses])
    db = sum(dy.sum(axis=(1, 2)) for _, dy in uses)
    want = np.zeros([9, 9])
    want[:8, :8] = 8 * np.kron(p.T @ p / len(p), a.T @ a / len(a))
    want[8:, 8:] = db.T @ db / 3
    np.testing.assert_allclose(block.full_matrix().numpy(), want, rtol=1e-10, atol=1e-12)



# -- reduce ("kron_reduce") -----------------------------------------------------------


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
