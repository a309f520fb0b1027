"""FisherEstimator: empirical and sampled modes, the debiased average,
inverses, approximations, and eager / tf.function / XLA agreement (float64)."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import fisher

F64 = tf.float64


def _mlp(seed=0, generic=False, batch=6):
    """tanh MLP 3-4-3 with softmax cross-entropy; with ``generic`` the hidden
    layer is multiplied by sin(a) (a generic variable)."""
    rng = np.random.default_rng(seed)
    var = lambda shape, name: tf.Variable(rng.normal(size=shape), dtype=F64, name=name)
    w1, b1, a, w2 = var((3, 4), "w1"), var((4,), "b1"), var((4,), "a"), var((4, 3), "w2")

    def logits(x):
        h = tf.tanh(tf.matmul(x, w1) + b1)
        if generic:
            h = h * tf.sin(a)
        return tf.matmul(h, w2)

    def loss(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits(x)))

    variables = [w1, b1, a, w2] if generic else [w1, b1, w2]
    x = tf.constant(rng.normal(size=(batch, 3)))
    y = tf.constant(rng.integers(0, 3, size=batch), tf.int32)
    return loss, logits, variables, x, y


def _flat(grads):
    return np.concatenate([np.ravel(g) for g in grads])


def _loop_empirical(logits, variables, x, y):
    """(1/B) sum_i grad_i grad_i^T of -log p(y_i|z_i), one tape per example."""
    rows = []
    for i in range(len(y)):
        with tf.GradientTape() as tape:
            nll = tf.nn.sparse_softmax_cross_entropy_with_logits(y[i:i + 1], logits(x[i:i + 1]))
        rows.append(_flat(tape.gradient(nll, variables)))
    rows = np.stack(rows)
    return rows.T @ rows / len(rows)


def _blocks_of(reference, variables, layers):
    sizes = [int(np.prod(v.shape)) for v in variables]
    starts = dict(zip([id(v) for v in variables], np.cumsum([0] + sizes)))
    out = []
    for layer in layers:
        idx = np.concatenate([np.arange(starts[id(v)], starts[id(v)] + int(np.prod(v.shape)))
                              for v in layer.variables])
        out.append(reference[np.ix_(idx, idx)])
    return out


def test_empirical_full_and_diagonal_blocks_equal_their_definition():
    loss, logits, variables, x, y = _mlp(generic=True)
    reference = _loop_empirical(logits, variables, x, y)
    est = kg.FisherEstimator(loss, estimation_mode="empirical",
                             approximations={"dense": "full", "generic": "full"})
    est.update(x, y)
    layers = est.registration.layers
    assert [layer.kind for layer in layers] == ["dense", "generic", "dense"]
    assert all(isinstance(b, fisher.NaiveFullBlock) for b in est.blocks)
    for layer, block, want in zip(layers, est.blocks, _blocks_of(reference, variables, layers)):
        np.testing.assert_allclose(block.full_matrix(), want, rtol=1e-9, atol=1e-12,
                                   err_msg=layer.name)
    default = kg.FisherEstimator(loss, estimation_mode="empirical")
    default.update(x, y)
    generic_block = default.blocks[1]
    assert isinstance(generic_block, fisher.NaiveDiagonalBlock)
    np.testing.assert_allclose(generic_block.full_matrix(),
                               np.diag(np.diag(_blocks_of(reference, variables, layers)[1])),
                               rtol=1e-9, atol=1e-12)


def test_sampled_converges_to_exact():
    loss, _, _, x, y = _mlp(seed=1, batch=24)
    exact = kg.FisherEstimator(loss, estimation_mode="exact")
    exact.update(x, y)
    errors = []
    for samples in (1, 40):
        est = kg.FisherEstimator(loss, estimation_mode="sampled", num_samples=samples, seed=3)
        est.update(x, y)
        errors.append(max(np.linalg.norm(b.full_matrix() - e.full_matrix())
                          / np.linalg.norm(e.full_matrix())
                          for b, e in zip(est.blocks, exact.blocks)))
    # 24 and 960 draws per block (fixed seed): Monte Carlo errors of order
    # 1/sqrt(24) and 1/sqrt(960).
    assert errors[1] < 0.1 < errors[0], errors


def test_sampled_seed_advances_and_reproduces():
    loss, _, _, x, y = _mlp(seed=2)
    make = lambda: kg.FisherEstimator(loss, num_samples=1, seed=7, cov_ema_decay=0.0)
    first, again = make(), make()
    first.update(x, y)
    g1 = first.blocks[1].full_matrix().numpy()
    first.update(x, y)  # decay 0: only the second batch's samples
    again.update(x, y)
    np.testing.assert_array_equal(again.blocks[1].full_matrix(), g1)
    assert not np.allclose(first.blocks[1].full_matrix(), g1)


def test_debiased_average_of_two_batches():
    loss, _, _, x, y = _mlp(seed=3)
    x2, y2 = x[::-1] * 2.0, y[::-1]
    opts = {"estimation_mode": "exact", "approximations": {"dense": "full"}}
    est, one, two = (kg.FisherEstimator(loss, **opts) for _ in range(3))
    est.update(x, y)
    est.update(x2, y2)
    one.update(x, y)
    two.update(x2, y2)
    d = 0.95
    for b, f1, f2 in zip(est.blocks, one.blocks, two.blocks):
        want = (d * (1 - d) * f1.full_matrix() + (1 - d) * f2.full_matrix()) / (d * (1 - d) + 1 - d)
        np.testing.assert_allclose(b.full_matrix(), want, rtol=1e-10)


def _vectors(layer, rng):
    return [tf.constant(rng.normal(size=tuple(v.shape))) for v in layer.variables]


def test_multiply_inverse_after_update_inverses_solves_the_damped_block():
    rng = np.random.default_rng(4)
    w1 = tf.Variable(rng.normal(size=(3, 4)), name="w1")
    b1 = tf.Variable(rng.normal(size=(4,)), name="b1")
    w2 = tf.Variable(rng.normal(size=(3, 4)), name="w2")  # stored [out, in]

    def loss(x, y):
        h = tf.tanh(tf.matmul(x, w1) + b1)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, tf.matmul(h, w2, transpose_b=True)))

    x = tf.constant(rng.normal(size=(5, 3)))
    y = tf.constant([0, 1, 2, 1, 0])
    lam = 0.1
    for approx, kron in (({"dense": "full"}, False), ({}, True)):
        est = kg.FisherEstimator(loss, estimation_mode="exact", damping=lam,
                                 approximations=approx)
        est.update(x, y)
        est.update_inverses()
        for layer, block in zip(est.registration.layers, est.blocks):
            vs = _vectors(layer, rng)
            flat = _flat([v.numpy() for v in vs])
            if kron:
                # The numpy transcription of tensorflow/kfac's pi-damping, on
                # the [d_in, d_out] factors; a stored-transposed kernel is
                # permuted to its own row-major order.
                inner = getattr(block, "block", block)
                a, g = inner.input_factor.value().numpy(), inner.output_factor.value().numpy()
                pi = np.sqrt((np.trace(a) / len(a)) / (np.trace(g) / len(g)))
                r = np.sqrt(lam)
                damped = np.kron(a + pi * r * np.eye(len(a)), g + r / pi * np.eye(len(g)))
                if inner is not block:
                    d_out, d_in = layer.variables[0].shape
                    perm = np.arange(d_in * d_out).reshape(d_in, d_out).T.ravel()
                    damped = damped[np.ix_(perm, perm)]
            else:
                damped = block.full_matrix().numpy() + lam * np.eye(len(flat))
            np.testing.assert_allclose(_flat(block.multiply_inverse(vs)),
                                       np.linalg.solve(damped, flat), rtol=1e-8)
            np.testing.assert_allclose(_flat(block.multiply(vs)), damped @ flat, rtol=1e-8)
        both = est.multiply_inverse([tf.ones_like(v) for v in est.registration.variables])
        assert [tuple(t.shape) for t in both] == [tuple(v.shape) for v in est.registration.variables]


def test_blocks_align_with_layers_and_approximations_by_name():
    loss, _, _, x, y = _mlp(generic=True)
    probe = kg.FisherEstimator(loss)
    probe.build(x, y)
    last = probe.registration.layers[2].name
    est = kg.FisherEstimator(loss, approximations={"dense": "diagonal", last: fisher.NaiveFullBlock})
    est.update(x, y)
    layers = est.registration.layers
    assert len(est.blocks) == len(layers) == 3
    for layer, block in zip(layers, est.blocks):
        assert block.var_shapes == tuple(tuple(v.shape) for v in layer.variables)
    assert [type(b) for b in est.blocks] == [fisher.FullyConnectedDiagonalBlock,
                                            fisher.NaiveDiagonalBlock, fisher.NaiveFullBlock]
    est.update(x[:4], y[:4])  # another input signature, same layers and blocks
    with pytest.raises(ValueError, match="not available"):
        kg.FisherEstimator(loss, approximations={"generic": "kron"}).build(x, y)
    with pytest.raises(ValueError, match="estimation_mode"):
        kg.FisherEstimator(loss, estimation_mode="fast")


def _small_model():
    """conv, dense, layer norm over channels, a generic sin(a), dense."""
    keras.utils.set_random_seed(5)
    conv = keras.layers.Conv2D(2, 2, dtype="float64")
    dense = keras.layers.Dense(4, activation="tanh", dtype="float64")
    norm = keras.layers.LayerNormalization(dtype="float64")
    head = keras.layers.Dense(3, dtype="float64")
    a = tf.Variable(np.linspace(0.5, 1.5, 4), name="a")

    def loss(x, y):
        h = tf.reshape(conv(x), [-1, 18])
        h = norm(dense(h)) * tf.sin(a)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, head(h)))

    rng = np.random.default_rng(6)
    return loss, tf.constant(rng.normal(size=(4, 4, 4, 1))), tf.constant([0, 1, 2, 1])


def _state(est):
    out = [b.full_matrix().numpy() for b in est.blocks]
    vs = [tf.ones_like(v) for v in est.registration.variables]
    return out + [t.numpy() for t in est.multiply_inverse(vs)]


@pytest.mark.parametrize("mode", ["exact"] + [  # the others: -m slow
    pytest.param(m, marks=pytest.mark.slow) for m in ("empirical", "sampled")])
def test_eager_function_and_xla_agree(mode):
    loss, x, y = _small_model()
    states = []
    for how in ("eager", "function", "xla"):
        est = kg.FisherEstimator(loss, estimation_mode=mode, num_samples=2, damping=0.1)

        def step(x, y, est=est):
            est.update(x, y)  # the first update builds the blocks in here
            est.update_inverses()

        if how == "eager":
            step(x, y)
        else:
            tf.function(step, jit_compile=how == "xla")(x, y)
        states.append(_state(est))
    kinds = [layer.kind for layer in est.registration.layers]
    assert kinds == ["conv2d", "dense", "scale_and_shift", "generic", "dense"]
    # XLA's stateless random kernels draw other samples than TF's for the
    # same seed: sampled mode under XLA is compared for shapes only.
    # XLA's eigh (Jacobi) is less precise in float64: eigenvalues to ~1e-12,
    # the damped inverses to ~1e-7 relative.
    n = len(est.blocks)
    compare = states[1:] if mode != "sampled" else states[1:2]
    for other in compare:
        for i, (got, want) in enumerate(zip(other, states[0])):
            rtol = 1e-9 if i < n or other is states[1] else 1e-5
            np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-12)
    for got, want in zip(states[2], states[0]):
        assert got.shape == want.shape and np.all(np.isfinite(got))
