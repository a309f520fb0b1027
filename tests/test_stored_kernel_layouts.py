"""Convolution kernels stored in another layout and transposed before the op.

Qwen3.5's gated delta net keeps its causal depthwise kernel as `[C, k]` and
applies `expand_dims(transpose(w, (1, 0)), -1)`; a kernel ported from
PyTorch is stored `[Cout, Cin, kh, kw]` and transposed `(2, 3, 1, 0)` before
`Conv2D`. The pass registers the convolution with the use's `kernel_perm`:
per-example gradients come back in the stored layout, and the Fisher block
is the op layout's, wrapped in `PermutedKernelBlock`.

In float64: per-example gradients and norms against a loop of one-example
tapes; the "full" and "diagonal" blocks against the brute-force Fisher from
per-example Jacobians; the Kronecker block against the block of the same
layer with its kernel stored in the op's layout (same matrix up to the
layout permutation, same products).
"""
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import kfac_graph as kg
from fisher_reference import brute_fisher
from kfac_graph import fisher
from kfac_graph.fisher.blocks_compose import PermutedKernelBlock
from per_example_reference import assert_matches_loop

F64 = tf.float64
B, C, T, K, CLASSES = 3, 4, 6, 3, 3
RTOL = 1e-6


def _causal_depthwise(x, kernel, stored):
    """Qwen3.5's causal conv: `x [B, C, T]`, the kernel `[C, k]` (stored) or
    `[k, C]` (the op's layout)."""
    xp = ops.pad(x, [[0, 0], [0, 0], [K - 1, 0]])
    w = ops.transpose(kernel, (1, 0)) if stored else kernel
    out = ops.depthwise_conv(ops.transpose(xp, (0, 2, 1)), ops.expand_dims(w, -1),
                             strides=1, padding="valid")
    return ops.transpose(out, (0, 2, 1))


def _depthwise_model(stored, seed=0):
    """``(loss_fn, args, logits(params, x), variables)``: the causal
    depthwise conv, tanh, a dense head on the flattened output."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(C, K))
    kernel = tf.Variable(w if stored else w.T, name="conv1d_kernel")
    head = tf.Variable(rng.normal(size=(C * T, CLASSES)) * 0.3, name="head")

    def logits(params, x):
        h = tf.tanh(_causal_depthwise(x, params[0], stored))
        return tf.reshape(h, [-1, C * T]) @ params[1]

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, logits([kernel, head], x)))

    x = tf.constant(rng.normal(size=(B, C, T)))
    return loss_fn, (x, tf.constant([0, 2, 1])), logits, [kernel, head]


def _conv2d_model(seed=0):
    """A Conv2D whose kernel is stored `[Cout, Cin, kh, kw]` and transposed
    `(2, 3, 1, 0)` to the op's `[kh, kw, Cin, Cout]`, with a bias."""
    rng = np.random.default_rng(seed)
    kernel = tf.Variable(rng.normal(size=(5, 2, 3, 2)) * 0.5, name="torch_kernel")
    bias = tf.Variable(rng.normal(size=(5,)), name="torch_bias")
    head = tf.Variable(rng.normal(size=(5, CLASSES)), name="head")

    def logits(params, x):
        h = tf.nn.conv2d(x, tf.transpose(params[0], (2, 3, 1, 0)), 1, "SAME") + params[1]
        return tf.reduce_mean(tf.tanh(h), axis=[1, 2]) @ params[2]

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, logits([kernel, bias, head], x)))

    x = tf.constant(rng.normal(size=(B, 5, 4, 2)))
    return loss_fn, (x, tf.constant([1, 0, 2])), logits, [kernel, bias, head]


def _brute(logits, variables, x):
    return brute_fisher(logits, variables, x, lambda z: fisher.Categorical(z).fisher())


def _block(loss_fn, args, kind, approximation):
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact", cov_ema_decay=0.0,
                             approximations={kind: approximation})
    est.update(*args)
    return est.blocks[0]


@pytest.mark.parametrize("build, kind", [(lambda: _depthwise_model(True), "depthwise_conv2d"),
                                         (_conv2d_model, "conv2d")])
def test_registered_with_the_stored_layout_and_exact_per_example(build, kind):
    loss_fn, args, _, variables = build()
    reg = assert_matches_loop(loss_fn, args, rtol=RTOL)
    layer = reg.layers[0]
    assert layer.kind == kind and [v.name for v in layer.variables] == \
        [v.name for v in variables[:-1]]
    assert layer.use_attrs[0]["kernel_perm"] == ((1, 0) if kind.startswith("depth")
                                                 else (2, 3, 1, 0))
    want = np.sqrt(sum(np.sum(np.reshape(g, [B, -1]) ** 2, 1)
                       for g in kg.per_example_gradients(loss_fn, *args)))
    np.testing.assert_allclose(kg.per_example_gradient_norms(loss_fn, *args), want, rtol=RTOL)


@pytest.mark.parametrize("approximation", ["full", "diagonal"])
@pytest.mark.parametrize("build, kind", [(lambda: _depthwise_model(True), "depthwise_conv2d"),
                                         (_conv2d_model, "conv2d")])
def test_full_and_diagonal_blocks_match_brute_force(build, kind, approximation):
    loss_fn, args, logits, variables = build()
    want = _brute(logits, variables, args[0])
    n = sum(int(np.prod(v.shape)) for v in variables[:-1])
    want = want[:n, :n]
    if approximation == "diagonal":
        want = np.diag(np.diag(want))
    got = _block(loss_fn, args, kind, approximation).full_matrix().numpy()
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-12)


def test_kronecker_block_is_the_op_layouts_block_permuted():
    """The stored `[C, k]` kernel's block is the `[k, C]` kernel's block,
    rows and columns in the stored order, and its products are that block's
    products transposed back."""
    stored_fn, args, _, _ = _depthwise_model(True)
    op_fn, _, _, _ = _depthwise_model(False)
    stored, op = (_block(fn, args, "depthwise_conv2d", "kron") for fn in (stored_fn, op_fn))
    assert isinstance(stored, PermutedKernelBlock)
    order = np.arange(C * K).reshape(K, C).T.reshape(-1)  # stored entry -> op entry
    np.testing.assert_allclose(stored.full_matrix(), op.full_matrix().numpy()[order][:, order],
                               rtol=RTOL, atol=1e-14)
    stored.update_inverses(), op.update_inverses()
    v = tf.constant(np.random.default_rng(1).normal(size=(C, K)))
    for name in ("multiply", "multiply_inverse"):
        got = getattr(stored, name)([v])[0]
        want = getattr(op, name)([tf.transpose(v)])[0]
        assert got.shape == (C, K)
        np.testing.assert_allclose(got, tf.transpose(want), rtol=RTOL, atol=1e-12)


def test_kfac_trains_the_stored_layout():
    """``kg.verify`` passes; ten `kg.KFAC` steps with the defaults lower the
    loss, none skipped."""
    loss_fn, args, _, _ = _depthwise_model(True)
    report = kg.verify(loss_fn, *args)
    assert report.passed, report.table()
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(10)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses
