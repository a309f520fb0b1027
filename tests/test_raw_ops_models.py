"""Models written with raw TensorFlow ops on ``tf.Variable``s (no Keras
layers), against brute force.

- A table read by its handle (``tf.gather`` and ``tf.nn.embedding_lookup``
  on a ``tf.Variable`` write ``ResourceGather``; ``tf.gather_nd`` writes
  ``ResourceGatherNd``): DP-SGD's reweighting replaces every variable's
  reads, so every such read is written as a read and a gather
  (``gather_reads.py``). Before, ``kg.DPSGD`` raised "its reads cannot be
  replaced" on a registered embedding whose per-example gradients were
  right, and ``tf.gather_nd`` by ``[B, 1]`` ids (generic) raised it in
  ``kg.per_example_gradients``. The clipped sum with no noise equals the
  clipped sum of one-example tapes' gradients.
- ``tf.nn.local_response_normalization``: its gradient ``LRNGrad`` has no
  gradient in TensorFlow, so the default K-FAC (the quadratic model's
  double backward) and ``kg.verify``'s exact Fisher check raised "No
  gradient defined"; ``double_backward.py`` gives it one, checked against
  the double backward of LRN written in differentiable ops.
"""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import double_backward

B, V, E, K = 5, 7, 4, 3
CLIP = 0.5


def _loop(fn, variables, args):
    out = []
    for i in range(B):
        with tf.GradientTape() as tape:
            loss = fn(*(a[i:i + 1] for a in args))
        out.append([tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)])
    return [np.stack([o[k] for o in out]) for k in range(len(variables))]


LOOKUPS = {
    "gather": lambda table, ids: tf.gather(table, ids[:, 0], axis=0),
    "embedding_lookup": lambda table, ids: tf.reduce_mean(tf.nn.embedding_lookup(table, ids), 1),
    "gather_nd": lambda table, ids: tf.gather_nd(table, ids[:, :1]),
}


@pytest.mark.parametrize("lookup", sorted(LOOKUPS))
def test_tables_read_by_handle_clip_like_one_example_tapes(lookup):
    rng = np.random.default_rng(0)
    table = tf.Variable(rng.normal(size=(V, E)), name="table")
    w = tf.Variable(rng.normal(size=(E, K)), name="w")

    @kg.auto_register
    def loss_fn(ids, y):
        h = tf.tanh(LOOKUPS[lookup](table, ids))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h @ w))

    args = (tf.constant(rng.integers(0, V, (B, 3))), tf.constant(rng.integers(0, K, B)))
    reg = loss_fn.registration(*args)
    assert [v.name for v in reg.variables] == ["table:0", "w:0"]
    ref = _loop(loss_fn, list(reg.variables), args)
    pxg = kg.per_example_gradients(loss_fn, *args)
    for got, want in zip(pxg, ref):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)
    norms = np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, 1) for g in ref))
    factor = np.minimum(1.0, CLIP / norms)
    clipped = [np.tensordot(factor, g, axes=1) / B for g in ref]
    for method in ("reweight", "materialize"):
        got = kg.dp_gradients(loss_fn, *args, l2_norm_clip=CLIP, noise_multiplier=0.0,
                              seed=[1, 2], method=method)
        for g, want in zip(got, clipped):
            np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), want,
                                       rtol=1e-10, atol=1e-12)
    opt = kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=CLIP, noise_multiplier=0.0, seed=0)
    before = table.numpy()
    opt.step(*args)
    np.testing.assert_allclose(table.numpy(), before - 0.1 * clipped[0], rtol=1e-10, atol=1e-12)


def _window_sum(z, radius):  # S(z) by a cumulative sum (not double_backward's slices)
    c = tf.cumsum(tf.pad(z, [[0, 0]] * 3 + [[radius + 1, radius]]), axis=-1)
    return c[..., 2 * radius + 1:] - c[..., :-(2 * radius + 1)]


def _lrn_by_hand(x, depth_radius, bias, alpha, beta):
    return x * (bias + alpha * _window_sum(x * x, depth_radius)) ** -beta


@pytest.mark.parametrize("radius,bias,alpha,beta", [(1, 1.0, 0.3, 0.75), (2, 2.0, 1e-1, 0.5)])
def test_lrn_grad_differentiates_again(radius, bias, alpha, beta):
    rng = np.random.default_rng(1)
    x, dy, u = (tf.constant(rng.normal(size=(2, 3, 3, 6)), tf.float32) for _ in range(3))
    attrs = dict(depth_radius=radius, bias=bias, alpha=alpha, beta=beta)

    @tf.function
    def second(lrn):
        with double_backward.differentiable():
            r = tf.gradients(lrn(x), x, grad_ys=dy)[0]
            return r, tf.gradients(r, [dy, x], grad_ys=u)

    r, (d_dy, d_x) = second(lambda x: tf.nn.local_response_normalization(x, **attrs))
    r_ref, (d_dy_ref, d_x_ref) = second(lambda x: _lrn_by_hand(x, **attrs))
    for got, want in ((r, r_ref), (d_dy, d_dy_ref), (d_x, d_x_ref)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)


def test_lrn_model_trains_with_default_kfac_and_verifies():
    rng = np.random.default_rng(2)
    kernel = tf.Variable(rng.normal(size=(3, 3, 2, 4)).astype("float32") / 4, name="kernel")
    w = tf.Variable(rng.normal(size=(4 * 4 * 4, K)).astype("float32") / 8, name="w")

    @kg.auto_register
    def loss_fn(x, y):
        h = tf.nn.relu(tf.nn.conv2d(x, kernel, 1, "SAME"))
        h = tf.nn.local_response_normalization(h, depth_radius=1, alpha=0.5)
        logits = tf.reshape(h, [-1, 64]) @ w
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    x = tf.constant(rng.normal(size=(B, 4, 4, 2)), tf.float32)
    y = tf.constant(rng.integers(0, K, B))
    report = kg.verify(loss_fn, x, y, estimation_mode="exact")
    assert report.passed, report.table()
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(x, y)) for _ in range(3)]
    assert int(opt.skipped_steps.numpy()) == 0
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


# the weights on the left: before, every one of these was generic
LEFT_EINSUMS = {"oi,bi->bo": ((4, 5), (5,)), "io,bti->bto": ((5, 4), (3, 5)),
                "hdo,bhd->bo": ((2, 3, 4), (2, 3)), "oi,bi->bo (+ bias)": ((4, 5), (5,))}


@pytest.mark.parametrize("equation", sorted(LEFT_EINSUMS))
def test_einsum_with_the_variable_first_is_dense(equation):
    rng = np.random.default_rng(3)
    kernel_shape, x_shape = LEFT_EINSUMS[equation]
    kernel = tf.Variable(rng.normal(size=kernel_shape) / 2, name="kernel")
    bias = tf.Variable(rng.normal(size=(4,)), name="bias")
    head = tf.Variable(rng.normal(size=(4, K)), name="head")

    @kg.auto_register
    def loss_fn(x, y):
        h = tf.einsum(equation.split(" ")[0], kernel, x)
        h = tf.tanh(h + bias if "bias" in equation else h)
        h = tf.reduce_mean(h, 1) if h.shape.rank == 3 else h
        logits = tf.einsum("ok,bo->bk", head, h)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    args = (tf.constant(rng.normal(size=(B, *x_shape))), tf.constant(rng.integers(0, K, B)))
    reg = loss_fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == ["dense", "dense"]
    assert [len(layer.variables) for layer in reg.layers] == [2 if "bias" in equation else 1, 1]
    ref = _loop(loss_fn, list(reg.variables), args)
    for got, want in zip(kg.per_example_gradients(loss_fn, *args), ref):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)
    report = kg.verify(loss_fn, *args, estimation_mode="exact")
    assert report.passed, report.table()


def _biased(kind, bias_shape, rng):
    """A layer with its bias stored as ``bias_shape``, then a dense head."""
    width = 4
    if kind == "conv":
        kernel = tf.Variable(rng.normal(size=(3, 3, 2, width)) / 4, name="kernel")
        x = rng.normal(size=(B, 4, 4, 2))
        apply = lambda x: tf.nn.conv2d(x, kernel, 1, "SAME")  # noqa: E731
    else:
        kernel = tf.Variable(rng.normal(size=(3, width)) / 2, name="kernel")
        x = rng.normal(size=(B, 2, 3) if kind == "sequence" else (B, 3))
        apply = lambda x: x @ kernel  # noqa: E731
    bias = tf.Variable(rng.normal(size=bias_shape), name="bias")
    head = tf.Variable(rng.normal(size=(width, K)), name="head")

    @kg.auto_register
    def loss_fn(x, y):
        h = tf.tanh(apply(x) + bias)
        h = tf.reduce_mean(h, axis=list(range(1, h.shape.rank - 1))) if h.shape.rank > 2 else h
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h @ head))

    return loss_fn, (tf.constant(x), tf.constant(rng.integers(0, K, B)))


@pytest.mark.parametrize("kind,bias_shape", [("dense", (1, 4)), ("sequence", (1, 1, 4)),
                                             ("conv", (1, 1, 1, 4))])
def test_bias_with_leading_unit_axes_is_the_layers_bias(kind, bias_shape):
    """A bias ``[1, d]`` (``[1, 1, 1, C]``) is the layer's own bias, as ``[d]``
    is (before: a shift layer of its own, so no Kronecker block held it):
    per-example gradients equal one-example tapes and the K-FAC block equals
    the ``[d]`` bias's twin's, reshaped."""
    fn, args = _biased(kind, bias_shape, np.random.default_rng(4))
    twin, _ = _biased(kind, bias_shape[-1:], np.random.default_rng(4))
    reg = fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == [
        "conv2d" if kind == "conv" else "dense", "dense"]
    assert [v.name for v in reg.layers[0].variables] == ["kernel:0", "bias:0"]
    ref = _loop(fn, list(reg.variables), args)
    for got, want in zip(kg.per_example_gradients(fn, *args), ref):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)
    blocks = []
    for f in (fn, twin):
        est = kg.FisherEstimator(f, estimation_mode="exact", damping=1e-2)
        est.update(*args)
        est.update_inverses()
        blocks.append(est.blocks[0])
    rng = np.random.default_rng(5)
    vs = [tf.constant(rng.normal(size=v.shape)) for v in reg.layers[0].variables]
    for method in ("multiply", "multiply_inverse"):
        got = getattr(blocks[0], method)(vs)
        want = getattr(blocks[1], method)([vs[0], tf.reshape(vs[1], [-1])])
        assert got[1].shape == bias_shape
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.reshape(a, [-1]), np.reshape(b, [-1]), rtol=1e-10)
