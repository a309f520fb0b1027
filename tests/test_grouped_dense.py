"""Grouped dense layers (kind ``"grouped_dense"``): a kernel ``[G, d_in,
d_out]`` applied group by group, ``einsum("eti,eih->eth", x, W)``, as
keras-hub's mixtures of experts apply their experts' output projections
(every token through every expert, weighed by the routing after). Before,
such kernels were generic: exact per-example gradients through a Jacobian
of ``B |W|`` entries and a diagonal Fisher.

Checked in float64: per-example gradients and norms against a loop of
one-example tapes; the per-example-gradient blocks (full, diagonal) in
exact mode against the brute-force Fisher; the Kronecker block, for one
example with one token (where K-FAC is exact per group), against the
brute-force Fisher's diagonal blocks, one per expert."""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph.layers.grouped_dense import GroupedDenseSpec
from fisher_reference import brute_fisher, softmax_fisher
from per_example_reference import assert_matches_loop, one_example_loop

D, E, M, C = 3, 4, 2, 2


def _moe(batch, tokens, form="eti,eih->eth", seed=0, bias=False):
    """Tokens ``[B, T, D]`` as rows, every expert's hidden ``tanh(rows W_in)``
    ``[E, B T, M]``, its output ``einsum(form, hidden, W_out)`` (``bias``:
    ``+ b_out[:, None, :]``, GPT-OSS's), weighed by a softmax router and
    summed over experts, mean over tokens, a head."""
    rng = np.random.RandomState(seed)
    w_in = tf.Variable(rng.normal(size=(E, D, M)), name="w_in")
    w_out = tf.Variable(rng.normal(size=(E, M, D)), name="w_out")
    router = tf.Variable(rng.normal(size=(D, E)), name="router")
    head = tf.Variable(rng.normal(size=(D, C)), name="head")
    b_out = tf.Variable(rng.normal(size=(E, D)), name="b_out")

    def logits(params, x):
        w_in, w_out, router, head, b_out = params
        rows = tf.reshape(x, [-1, D])
        hidden = tf.tanh(tf.einsum("th,ehm->etm", rows, w_in))
        out = tf.einsum(form, hidden, w_out)  # [E, N, D]
        out = out + b_out[:, None, :] if bias else out
        route = tf.transpose(tf.nn.softmax(rows @ router))  # [E, N]
        mixed = tf.reduce_sum(out * route[:, :, None], axis=0)
        return tf.reduce_mean(tf.reshape(mixed, [-1, tokens, D]), axis=1) @ head

    params = [w_in, w_out, router, head, b_out]

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, logits(params, x)))

    args = (tf.constant(rng.normal(size=(batch, tokens, D))),
            tf.constant(rng.randint(0, C, batch)))
    return loss_fn, logits, params, args


def _experts(reg, w_out):
    (layer,) = [layer for layer in reg.layers if layer.variables[0] is w_out]
    return layer


@pytest.mark.parametrize("form,bias", [("eti,eih->eth", False), ("etm,emh->eth", True)],
                         ids=["mixtral", "gpt_oss_biased"])
def test_grouped_dense_per_example(form, bias):
    loss_fn, _, params, args = _moe(3, 4, form, bias=bias)
    reg = loss_fn.registration(*args)
    layer = _experts(reg, params[1])
    assert layer.kind == "grouped_dense", reg.summary()
    assert list(layer.variables) == ([params[1], params[4]] if bias else [params[1]])
    assert layer.use_attrs[0]["input_shape"] == (E, 3, 4, M)
    assert not [layer for layer in reg.layers if layer.kind == "generic"], reg.summary()
    assert_matches_loop(loss_fn, args)
    want = one_example_loop(loss_fn, args, reg.variables)
    norms = np.sqrt(sum(np.sum(np.square(w), axis=tuple(range(1, w.ndim))) for w in want))
    np.testing.assert_allclose(kg.per_example_gradient_norms(loss_fn, *args), norms, rtol=1e-6)


def test_grouped_dense_norms_both_forms():
    """The rule's norms, by the Gram form (one token per example: ``k (d_in +
    d_out) < d_in d_out``) and materialised (eight), equal its gradients'."""
    rule = kg.layers.kind("grouped_dense").rule
    spec = GroupedDenseSpec((E, M, D))
    rng = np.random.RandomState(3)
    for tokens in (1, 8):
        x = tf.constant(rng.normal(size=(3, E, tokens, M)))
        g = tf.constant(rng.normal(size=(3, E, tokens, D)))
        grads = rule.per_example_grads([(x, g)], spec)[0]
        np.testing.assert_allclose(
            grads, np.einsum("bjti,bjto->bjio", x, g), rtol=1e-12)
        np.testing.assert_allclose(rule.squared_norms([(x, g)], spec),
                                   np.sum(np.square(grads), axis=(1, 2, 3)), rtol=1e-10)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("block", ["full", "diagonal"])
def test_grouped_dense_exact_blocks(block, bias):
    loss_fn, logits, params, args = _moe(3, 2, bias=bias)
    w_in, w_out, router, head, b_out = params
    own = [w_out, b_out] if bias else [w_out]
    want = brute_fisher(lambda p, x: logits([w_in, p[0], router, head, p[-1]], x), own,
                        args[0], softmax_fisher)
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact",
                             approximations={"grouped_dense": block})
    est.update(*args)
    reg = loss_fn.registration(*args)
    got = est.blocks[reg.layers.index(_experts(reg, w_out))].full_matrix()
    np.testing.assert_allclose(got, want if block == "full" else np.diag(np.diag(want)),
                               rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_dense_kronecker_block_one_token(bias):
    """One example, one token: each expert's K-FAC block ``A_j (x) G_j`` (over
    ``[W_j; b_j]`` with a bias) is its exact Fisher block; the block drops
    the cross-expert terms."""
    loss_fn, logits, params, args = _moe(1, 1, bias=bias)
    w_in, w_out, router, head, b_out = params
    own = [w_out, b_out] if bias else [w_out]
    want = brute_fisher(lambda p, x: logits([w_in, p[0], router, head, p[-1]], x), own,
                        args[0], softmax_fisher)
    expert = np.concatenate([np.repeat(np.arange(E), M * D)]
                            + ([np.repeat(np.arange(E), D)] if bias else []))
    mask = expert[:, None] == expert[None, :]
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact")
    est.update(*args)
    reg = loss_fn.registration(*args)
    block = est.blocks[reg.layers.index(_experts(reg, w_out))]
    assert type(block).__name__ == "GroupedDenseKroneckerBlock"
    np.testing.assert_allclose(block.full_matrix(), want * mask, rtol=1e-6, atol=1e-12)
    # its inverse is the damped block's inverse
    rng = np.random.RandomState(4)
    vec = [tf.constant(rng.normal(size=v.shape)) for v in own]
    block.update_inverses(damping=0.1)
    back = block.multiply(block.multiply_inverse(vec, damping=0.1), damping=0.1)
    for got, v in zip(back, vec):
        np.testing.assert_allclose(got, v, rtol=1e-6, atol=1e-9)


def test_grouped_dense_per_time_step():
    """A kernel per time step on a time-major input, ``einsum("eti,eih->eth")``
    with ``e`` the time and ``t`` the batch (``T = B``, so the shapes alone
    would pass for tokens of examples): the pass follows the batch to the
    second axis, one row per example, and the layer is exact."""
    rng = np.random.RandomState(5)
    w_out = tf.Variable(rng.normal(size=(3, M, D)), name="w_out")  # one per time step
    head = tf.Variable(rng.normal(size=(D, C)), name="head")

    @kg.auto_register
    def loss_fn(x, y):
        steps = tf.transpose(tf.tanh(x), [1, 0, 2])  # [T, B, M]
        out = tf.einsum("eti,eih->eth", steps, w_out)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, tf.reduce_mean(out, axis=0) @ head))

    args = (tf.constant(rng.normal(size=(3, 3, M))), tf.constant([0, 1, 1]))
    reg = loss_fn.registration(*args)
    layer = _experts(reg, w_out)
    assert (layer.kind, layer.use_attrs[0]["input_shape"]) == (
        "grouped_dense", (3, 3, 1, M)), reg.summary()
    assert_matches_loop(loss_fn, args)


def test_grouped_dense_without_rows_is_generic():
    """Experts' inputs that the pass cannot follow to the examples' rows (a
    roll, which it does not read): the kernel stays generic, with the reason,
    its gradients exact."""
    loss_fn, _, params, args = _moe(3, 2, seed=6)
    rng = np.random.RandomState(6)
    w_out = tf.Variable(rng.normal(size=(E, M, D)), name="w_out")
    head = tf.Variable(rng.normal(size=(D, C)), name="head")

    @kg.auto_register
    def rolled(x, y):
        hidden = tf.roll(tf.tanh(tf.einsum("th,ehm->etm", tf.reshape(x, [-1, D]), params[0])),
                         shift=1, axis=2)
        out = tf.reduce_sum(tf.einsum("eti,eih->eth", hidden, w_out), axis=0)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, tf.reduce_mean(tf.reshape(out, [-1, 2, D]), axis=1) @ head))

    reg = rolled.registration(*args)
    layer = _experts(reg, w_out)
    assert layer.kind == "generic" and "grouped dense" in layer.reason, reg.summary()
    assert_matches_loop(rolled, args)


def test_grouped_dense_trains():
    """``kg.verify`` passes, ``kg.KFAC`` with its defaults lowers the loss with
    no skipped step, and a ``kg.DPSGD`` step moves the experts."""
    loss_fn, _, params, args = _moe(8, 3)
    report = kg.verify(loss_fn, *args)
    assert report.passed and "GroupedDenseRule" in report.table(), report.table()
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(10)]
    assert losses[-1] < 0.5 * losses[0] and int(opt.skipped_steps) == 0, losses
    dp = kg.DPSGD(kg.auto_register(loss_fn.python_function), learning_rate=0.1,
                  l2_norm_clip=1.0, noise_multiplier=0.5)
    before = params[1].numpy()
    assert np.isfinite(float(dp.step(*args)))
    assert np.all(np.isfinite(params[1].numpy())) and not np.array_equal(before, params[1].numpy())
