"""kg.KFAC: one step against a numpy K-FAC update, the periods and burn-in,
XLA, skipped non-finite steps, checkpoints, summaries and a small MLP."""
import glob

import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg

F64 = tf.float64


# -- a tiny dense softmax problem and its numpy K-FAC step --------------------------------
def _dense_problem(seed=0, d_in=3, k=4, batch=8):
    rng = np.random.default_rng(seed)
    w = tf.Variable(rng.normal(size=(d_in, k)), dtype=F64, name="w")
    b = tf.Variable(rng.normal(size=(k,)) * 0.1, dtype=F64, name="b")

    def loss_fn(x, y):
        logits = tf.matmul(x, w) + b
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    batches = [(tf.constant(rng.normal(size=(batch, d_in))),
                tf.constant(rng.integers(0, k, size=batch), tf.int32)) for _ in range(8)]
    return w, b, kg.auto_register(loss_fn), batches


def _softmax(z):
    p = np.exp(z - z.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def _numpy_quantities(v, x, y):
    """Stacked V = [W; b]: gradient, A, G (exact mode) of the mean softmax loss."""
    x, y = np.asarray(x), np.asarray(y)
    abar = np.concatenate([x, np.ones((len(x), 1))], 1)
    p = _softmax(abar @ v)
    onehot = np.eye(v.shape[1])[y]
    grad = abar.T @ (p - onehot) / len(x)
    a = abar.T @ abar / len(x)
    g = np.mean([np.diag(q) - np.outer(q, q) for q in p], 0)
    return grad, a, g, abar, p


def _numpy_precondition(mat, a, g, lam):
    """tensorflow/kfac's damped Kronecker inverse (R = 1)."""
    pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
    da, dg = pi * np.sqrt(lam), np.sqrt(lam) / pi
    return np.linalg.inv(a + da * np.eye(len(a))) @ mat @ np.linalg.inv(g + dg * np.eye(len(g)))


def _stacked(w, b):
    return np.concatenate([w.numpy(), b.numpy()[None]], 0)


@pytest.mark.parametrize("momentum_type,jit", [("regular", False), ("adam", True)])
def test_first_step_is_the_numpy_preconditioned_update(momentum_type, jit):
    w, b, fn, batches = _dense_problem()
    lr, lam = 0.5, 1e-2
    opt = kg.KFAC(fn, learning_rate=lr, damping=lam, momentum=0.9, momentum_type=momentum_type,
                  norm_constraint=None, estimation_mode="exact", jit_compile=jit)
    v0 = _stacked(w, b)
    x, y = batches[0]
    loss = opt.step(x, y)
    assert opt.whole_step_jit == jit
    grad, a, g, _, _ = _numpy_quantities(v0, x, y)
    expected = v0 - lr * _numpy_precondition(grad, a, g, lam)
    # XLA's float64 eigh (the inverse update, compiled with the whole step)
    # is accurate to about 1e-8 only.
    tol = 1e-6 if jit else 1e-9
    np.testing.assert_allclose(_stacked(w, b), expected, rtol=tol, atol=tol)
    _, _, _, abar, p = _numpy_quantities(v0, x, y)
    np.testing.assert_allclose(loss.numpy(), -np.mean(np.log(p[np.arange(len(y)), y])))
    assert int(opt.iterations) == 1 and int(opt.skipped_steps) == 0


def test_second_step_regular_momentum_and_l2_and_kl_clipping():
    w, b, fn, batches = _dense_problem(seed=1)
    lr, lam, mu, l2, c = 0.3, 1e-2, 0.5, 1e-2, 1e-3
    opt = kg.KFAC(fn, momentum_type="regular", adapt_damping=False, learning_rate=lr, damping=lam, momentum=mu, l2_reg=l2, norm_constraint=c,
                  estimation_mode="exact", cov_ema_decay=0.0, inverse_update_period=1,
                  jit_compile=False)
    v = _stacked(w, b)
    velocity = np.zeros_like(v)
    for x, y in batches[:2]:
        grad, a, g, _, _ = _numpy_quantities(v, x, y)
        grad = grad + l2 * v
        p = _numpy_precondition(grad, a, g, lam + l2)
        p *= min(1.0, np.sqrt(c / (lr ** 2 * np.sum(p * grad))))
        velocity = mu * velocity + p
        v = v - lr * velocity
        opt.step(x, y)
        np.testing.assert_allclose(_stacked(w, b), v, rtol=1e-7, atol=1e-12)


def test_burn_in_and_update_periods():
    w, b, fn, batches = _dense_problem(seed=2)
    opt = kg.KFAC(fn, momentum_type="regular", adapt_damping=False, num_burnin_steps=2, cov_update_period=2, inverse_update_period=3,
                  estimation_mode="exact", jit_compile=False)
    opt.build(*batches[0])
    block = opt.estimator.blocks[0]
    factor = block.input_factor.value().numpy()
    cached = block.input_inverse.numpy()
    seen = []
    for t in range(7):
        before = _stacked(w, b)
        opt.step(*batches[t])
        cov = not np.array_equal(block.input_factor.value().numpy(), factor)
        inv = not np.array_equal(block.input_inverse.numpy(), cached)
        moved = not np.array_equal(_stacked(w, b), before)
        seen.append((cov, inv, moved))
        factor = block.input_factor.value().numpy()
        cached = block.input_inverse.numpy()
    # k = t - 2: covariances every step of the burn-in, then on even k;
    # inverses at k = 0, 3; parameters only after the burn-in.
    assert seen == [(True, False, False), (True, False, False), (True, True, True),
                    (False, False, True), (True, False, True), (False, True, True),
                    (True, False, True)]


def test_inverses_are_refreshed_after_each_damping_change():
    """The blocks cache damped inverses: a step that starts with a damping the
    caches were not made for refreshes them first, so every update is
    preconditioned by the cache (never the on-the-fly fallback). Unstaggered:
    staggered refreshes take a damping change at each block's slot
    (test_stagger.py)."""
    w, b, fn, batches = _dense_problem(seed=4)
    opt = kg.KFAC(fn, momentum_type="regular", adapt_damping=True, damping_adaptation_interval=2,
                  inverse_update_period=100, jit_compile=False, stagger_inverses=False)
    opt.build(*batches[0])
    block = opt.estimator.blocks[0]
    changes = 0
    for x, y in batches:
        lam = float(opt.damping) / float(opt.curvature_scale) / float(block.replicas)
        refreshed_for = float(block.inverse_damping)
        opt.step(x, y)
        np.testing.assert_allclose(float(block.inverse_damping), lam, rtol=1e-12)
        changes += refreshed_for != float(block.inverse_damping)
    assert changes >= 2  # the first step's refresh and at least one damping change


def test_non_finite_batch_is_skipped_and_nothing_changes():
    w, b, fn, batches = _dense_problem(seed=3)
    opt = kg.KFAC(fn, momentum_type="regular", momentum=0.9, adapt_damping=True, damping_adaptation_interval=1,
                  jit_compile=True)
    for x, y in batches[:2]:
        opt.step(x, y)
    state = lambda: [v.numpy().copy() for v in
                     [w, b, opt.iterations, opt.damping, *opt.velocities,
                      *opt.estimator.variables]]
    before = state()
    x, y = batches[2]
    bad = tf.tensor_scatter_nd_update(x, [[0, 0]], tf.constant([np.nan], F64))
    loss = opt.step(bad, y)
    assert not np.isfinite(loss.numpy())
    assert int(opt.skipped_steps) == 1
    for old, new in zip(before, state()):
        np.testing.assert_array_equal(old, new)
    assert np.isfinite(opt.step(x, y).numpy())
    assert int(opt.iterations) == 3 and int(opt.skipped_steps) == 1


def _mlp_problem(seed=0):
    """A 2-hidden-layer tanh MLP as raw float32 variables (so a fresh copy
    is easy to make), a teacher's labels, batches of 32."""
    rng = np.random.default_rng(seed)
    sizes = [8, 16, 16, 3]
    params = []
    for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:])):
        params.append(tf.Variable(rng.normal(size=(m, n)).astype(np.float32) / float(np.sqrt(m)),
                                  name=f"w{i}"))
        params.append(tf.Variable(np.zeros(n, np.float32), name=f"b{i}"))

    def loss_fn(x, y):
        h = x
        for i in range(0, len(params), 2):
            h = tf.matmul(h, params[i]) + params[i + 1]
            if i + 2 < len(params):
                h = tf.tanh(h)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h))

    data = np.random.default_rng(100)
    x = data.normal(size=(320, 8)).astype(np.float32)
    teacher = data.normal(size=(8, 3))
    y = np.argmax(x @ teacher, -1).astype(np.int32)
    batches = [(tf.constant(x[i:i + 32]), tf.constant(y[i:i + 32])) for i in range(0, 320, 32)]
    return params, kg.auto_register(loss_fn), batches


def test_checkpoint_resume_is_bitwise_identical(tmp_path):
    options = dict(momentum_type="regular", momentum=0.9, adapt_damping=True,
                   damping_adaptation_interval=2,
                   inverse_update_period=2, estimation_mode="sampled", jit_compile=False)
    params, fn, batches = _mlp_problem()
    opt = kg.KFAC(fn, **options)
    for t in range(6):
        opt.step(*batches[t])
    straight = [p.numpy() for p in params]

    params, fn, batches = _mlp_problem()
    opt = kg.KFAC(fn, **options)
    for t in range(3):
        opt.step(*batches[t])
    path = tf.train.Checkpoint(params=params, opt=opt).save(str(tmp_path / "ckpt"))

    params, fn, batches = _mlp_problem(seed=5)  # other initial values, overwritten
    opt = kg.KFAC(fn, **options)
    opt.build(*batches[0])
    tf.train.Checkpoint(params=params, opt=opt).restore(path).assert_consumed()
    assert int(opt.iterations) == 3
    for t in range(3, 6):
        opt.step(*batches[t])
    for a, b in zip(straight, params):
        np.testing.assert_array_equal(a, b.numpy())


def test_summaries_are_written(tmp_path):
    params, fn, batches = _mlp_problem()
    writer = tf.summary.create_file_writer(str(tmp_path))
    opt = kg.KFAC(fn, momentum_type="regular", adapt_damping=False, summary_writer=writer, summary_period=2, jit_compile=False)
    for t in range(3):
        opt.step(*batches[t])
    writer.flush()
    tags, steps = set(), set()
    for path in glob.glob(str(tmp_path / "events*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                tags.add(value.tag)
                steps.add(event.step)
    assert {"kfac/loss", "kfac/damping", "kfac/learning_rate", "kfac/momentum"} <= tags
    assert any(t.startswith("factors/") and t.endswith("input_trace") for t in tags)
    assert steps == {0, 2}


@pytest.mark.parametrize("options", [{}, {"momentum_type": "regular", "damping": 1e-3,
                                          "adapt_damping": False}],
                         ids=["defaults", "regular"])
def test_small_mlp_trains(options):
    params, fn, batches = _mlp_problem()
    opt = kg.KFAC(fn, **options)
    losses = [float(opt.step(*batches[t % len(batches)])) for t in range(50)]
    assert np.mean(losses[-5:]) < 0.4 * np.mean(losses[:5]), losses


def test_sum_loss_curvature_is_scaled_by_the_batch():
    """For L = sum_i l_i the curvature is B F: the step with damping B lam
    equals the mean loss's step with damping lam."""
    results = []
    for reduce, lam in ((tf.reduce_mean, 1e-2), (tf.reduce_sum, 8e-2)):
        w, b, _, batches = _dense_problem(seed=6)
        fn = kg.auto_register(lambda x, y: reduce(
            tf.nn.sparse_softmax_cross_entropy_with_logits(y, tf.matmul(x, w) + b)))
        opt = kg.KFAC(fn, momentum_type="regular", adapt_damping=False, learning_rate=0.5, damping=lam, norm_constraint=None,
                      estimation_mode="exact", jit_compile=False)
        opt.step(*batches[0])
        results.append(_stacked(w, b))
    np.testing.assert_allclose(results[0], results[1], rtol=1e-9)


def test_conv_model_is_not_compiled_whole_on_the_cpu():
    rng = np.random.default_rng(0)
    k = tf.Variable(rng.normal(size=(3, 3, 2, 4)).astype(np.float32) * 0.3)
    w = tf.Variable(rng.normal(size=(4, 3)).astype(np.float32) * 0.3)

    def loss_fn(x, y):
        h = tf.nn.relu(tf.nn.conv2d(x, k, 1, "SAME"))
        logits = tf.matmul(tf.reduce_mean(h, [1, 2]), w)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    x = tf.constant(rng.normal(size=(4, 6, 6, 2)).astype(np.float32))
    y = tf.constant([0, 1, 2, 0], tf.int32)
    opt = kg.KFAC(kg.auto_register(loss_fn))
    first = float(opt.step(x, y))
    assert opt.whole_step_jit == bool(tf.config.list_physical_devices("GPU"))
    assert np.isfinite(first) and int(opt.iterations) == 1
