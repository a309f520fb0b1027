"""Stacked dense layers (``passes/patterns_stacked.py``): a recurrent cell's
``x @ W + h @ R + b`` registers as one dense layer on ``[x, h]`` with the
kernel ``[W; R]``. Shown in float64 against the same cell written with the
concatenation by hand (``concat([x, h]) @ [W; R] + b``, a plain dense layer):
equal registrations, per-example gradients (the stacked kernel's split back
into W and R) and Fisher blocks of every approximation; and against brute
force (one-example tapes, the Jacobian Fisher). A kernel that is also used
alone keeps one layer per product."""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph.optimizer import costs
from fisher_reference import brute_fisher
from per_example_reference import one_example_loop

B, T, D, U, K = 3, 4, 3, 5, 2
RTOL = 1e-6


def _weights(seed=1):
    rng = np.random.default_rng(seed)
    make = lambda shape, name: tf.Variable(rng.standard_normal(shape) * 0.5, name=name)  # noqa: E731
    return make((D, U), "wx"), make((U, U), "wh"), make(U, "b"), make((U, K), "wo")


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return tf.constant(rng.standard_normal((B, T, D))), tf.constant(rng.integers(0, K, B))


def _rnn(cell, wo):
    """Loss of an RNN over T steps (a tf.scan) with a dense head."""

    def logits(x):
        h0 = tf.zeros([tf.shape(x)[0], U], x.dtype)
        return tf.scan(cell, tf.transpose(x, [1, 0, 2]), initializer=h0)[-1] @ wo

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits(x)))

    return loss_fn, logits


CELLS = {
    "bias_after_sum": lambda wx, wh, b: lambda h, x: tf.tanh(x @ wx + h @ wh + b),
    "bias_inside": lambda wx, wh, b: lambda h, x: tf.tanh((x @ wx + b) + h @ wh),
}


def _pair(cell="bias_after_sum"):
    """(stacked loss, its variables, hand-concatenated loss, its variables)."""
    wx, wh, b, wo = _weights()
    stacked, _ = _rnn(CELLS[cell](wx, wh, b), wo)
    w = tf.Variable(tf.concat([wx, wh], 0), name="w")
    cb, cwo = tf.Variable(b, name="cb"), tf.Variable(wo, name="cwo")
    by_hand, _ = _rnn(lambda h, x: tf.tanh(tf.concat([x, h], -1) @ w + cb), cwo)
    return stacked, (wx, wh, b, wo), by_hand, (w, cb, cwo)


@pytest.mark.parametrize("cell", list(CELLS))
def test_cell_is_one_dense_layer_with_its_bias(cell):
    loss_fn, (wx, wh, b, wo), _, _ = _pair(cell)
    reg = loss_fn.registration(*_data())
    assert [(layer.kind, layer.uses, [v.name for v in layer.variables]) for layer in reg.layers] \
        == [("dense", T, [wx.name, wh.name, b.name]), ("dense", 1, [wo.name])], reg.summary()
    assert {a["stacked_rows"] for a in reg.layers[0].use_attrs} == {(D, U)}


@pytest.mark.parametrize("cell", list(CELLS))
def test_per_example_gradients_equal_the_loop_and_the_concatenated_cell(cell):
    loss_fn, (wx, wh, b, wo), by_hand, (w, cb, cwo) = _pair(cell)
    args = _data()
    got = kg.per_example_gradients(loss_fn, *args)
    want = one_example_loop(loss_fn, args, [wx, wh, b, wo])
    for v, g, r in zip((wx, wh, b, wo), got, want):
        assert g.shape == (B, *v.shape), v.name
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=RTOL, atol=1e-12, err_msg=v.name)
    hand = kg.per_example_gradients(by_hand, *args)
    np.testing.assert_allclose(np.concatenate([got[0], got[1]], 1), hand[0].numpy(), rtol=RTOL,
                               atol=1e-12)
    norms = np.sqrt(sum(np.sum(np.reshape(r.numpy(), [B, -1]) ** 2, 1) for r in want))
    np.testing.assert_allclose(kg.per_example_gradient_norms(loss_fn, *args).numpy(), norms,
                               rtol=RTOL)


@pytest.mark.parametrize("approximation", ["kron", "diagonal", "series", "full"])
def test_blocks_equal_the_concatenated_cells(approximation):
    loss_fn, _, by_hand, _ = _pair()
    args = _data()
    blocks = []
    for fn in (loss_fn, by_hand):
        reg = fn.registration(*args)
        est = kg.FisherEstimator(fn, estimation_mode="exact",
                                 approximations={reg.layers[0].name: approximation})
        est.update(*args)
        blocks.append(est.blocks[0])
    stacked, hand = blocks
    np.testing.assert_allclose(stacked.full_matrix().numpy(), hand.full_matrix().numpy(),
                               rtol=RTOL, atol=1e-12)
    rng = np.random.default_rng(3)
    vs = [tf.constant(rng.standard_normal(s)) for s in ((D, U), (U, U), (U,))]
    got = stacked.multiply_inverse(vs, damping=0.1)
    want = hand.multiply_inverse([tf.concat(vs[:2], 0), vs[2]], damping=0.1)
    np.testing.assert_allclose(np.concatenate([got[0], got[1]], 0), want[0].numpy(), rtol=RTOL,
                               atol=1e-12)
    np.testing.assert_allclose(got[2].numpy(), want[1].numpy(), rtol=RTOL, atol=1e-12)


def test_full_block_equals_the_jacobian_fisher():
    wx, wh, b, wo = _weights()
    loss_fn, logits = _rnn(CELLS["bias_after_sum"](wx, wh, b), wo)
    x, y = _data()
    reg = loss_fn.registration(x, y)
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact",
                             approximations={reg.layers[0].name: "full"})
    est.update(x, y)

    def softmax_fisher(z):
        p = tf.nn.softmax(z)
        return tf.linalg.diag(p) - p[:, :, None] * p[:, None, :]

    want = brute_fisher(lambda p, xx: logits(xx), [wx, wh, b], x, softmax_fisher)
    np.testing.assert_allclose(est.blocks[0].full_matrix().numpy(), want, rtol=RTOL,
                               atol=RTOL * np.abs(want).max())


def test_kernel_also_used_alone_keeps_one_layer_per_product():
    wx, wh, b, wo = _weights()
    skip = tf.Variable(np.random.default_rng(4).standard_normal((U, K)) * 0.5, name="skip")
    cell = CELLS["bias_after_sum"](wx, wh, b)

    @kg.auto_register
    def loss_fn(x, y):
        h0 = tf.zeros([tf.shape(x)[0], U], x.dtype)
        h = tf.scan(cell, tf.transpose(x, [1, 0, 2]), initializer=h0)[-1]
        z = h @ wo + tf.tanh(x[:, -1] @ wx) @ skip  # wx applied alone too
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, z))

    args = _data()
    reg = loss_fn.registration(*args)
    kinds = {layer.variables[0].name: (layer.kind, len(layer.variables)) for layer in reg.layers}
    assert kinds[wx.name] == ("dense", 1) and kinds[wh.name] == ("dense", 1), reg.summary()
    assert not reg.generic_variables, reg.summary()
    want = one_example_loop(loss_fn, args, reg.variables)
    for v, g, r in zip(reg.variables, kg.per_example_gradients(loss_fn, *args), want):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=RTOL, atol=1e-12, err_msg=v.name)


@pytest.mark.slow
def test_kfac_trains_the_stacked_cell_under_xla():
    loss_fn, _, _, _ = _pair()
    args = _data()
    opt = kg.KFAC(loss_fn, damping=1e-1, jit_compile=True)
    losses = [float(opt.step(*args)) for _ in range(5)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses


def test_costs_count_both_kernels():
    loss_fn, _, _, _ = _pair()
    opt = kg.KFAC(loss_fn, momentum_type="regular", adapt_damping=False)
    opt.build(*_data())
    cell = opt.costs[0]
    assert cell.forward == T * B * (D + U) * U
    assert cell.inverse == pytest.approx(
        ((D + U + 1) ** 3 + U ** 3) / costs.FACTORISATION_RATE)
