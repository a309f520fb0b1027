"""kg.KFAC's quadratic model (alpha, mu against a numpy 2x2 solve with the
exact Fisher) and Levenberg-Marquardt damping."""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph.optimizer import damping as damping_lib
from kfac_graph.optimizer import exact_fisher
from kfac_graph.optimizer import qmodel
from kfac_graph.optimizer import single_device
from test_optimizer import (_dense_problem, _numpy_precondition, _numpy_quantities,
                            _stacked)

F64 = tf.float64


def _exact_fisher_form(u, v, abar, p):
    """u . F v for the dense softmax layer: (1/B) sum_i (a_i U) F_i (a_i V)."""
    ju, jv = abar @ u, abar @ v
    f = np.stack([np.diag(q) - np.outer(q, q) for q in p])
    return np.einsum("bk,bkl,bl->", ju, f, jv) / len(abar)


@pytest.mark.parametrize("fraction", [1.0, 0.3])
def test_qmodel_alpha_and_mu_are_the_numpy_2x2_solve(fraction):
    """With ``qmodel_batch_fraction`` f the forms are the first ceil(f B)
    examples' (0.3 of 8: 3)."""
    w, b, fn, batches = _dense_problem(seed=4)
    lam = 1e-2
    opt = kg.KFAC(fn, momentum_type="qmodel", damping=lam, estimation_mode="exact",
                  cov_ema_decay=0.0, inverse_update_period=1, jit_compile=False,
                  qmodel_batch_fraction=fraction)
    n = int(np.ceil(fraction * len(batches[0][0])))
    prev = np.zeros_like(_stacked(w, b))
    used_2x2 = capped = 0
    for x, y in batches:
        theta = _stacked(w, b)
        grad, a, g, abar, p = _numpy_quantities(theta, x, y)
        d = _numpy_precondition(grad, a, g, lam)
        form = lambda u, v: _exact_fisher_form(u, v, abar[:n], p[:n]) + lam * np.sum(u * v)
        m = np.array([[form(d, d), form(d, prev)], [form(prev, d), form(prev, prev)]])
        # the first n examples' own model: their gradient and loss with their forms
        grad_n = _numpy_quantities(theta, x[:n], y[:n])[0]
        c = np.array([np.sum(grad_n * d), np.sum(grad_n * prev)])
        alpha, mu = -c[0] / m[0, 0], 0.0
        if prev.any():
            alpha2, mu2 = -np.linalg.solve(m, c)
            if 0 <= mu2 < 1:   # else the 1-D solve (qmodel.py's bound on mu)
                alpha, mu = alpha2, mu2
                used_2x2 += 1
        step = alpha * d + mu * prev  # shortened where the undamped model falls below -L
        linear = np.sum(grad_n * step)
        quadratic = 0.5 * _exact_fisher_form(step, step, abar[:n], p[:n])
        loss = float(fn(x[:n], y[:n]))
        if linear + quadratic < -loss:
            s = (-linear - np.sqrt(linear ** 2 - 4 * quadratic * loss)) / (2 * quadratic)
            alpha, mu = s * alpha, s * mu
            capped += 1
        opt.step(x, y)
        np.testing.assert_allclose(-opt.learning_rate.numpy(), alpha, rtol=1e-8)
        np.testing.assert_allclose(opt.momentum.numpy(), mu, rtol=1e-8, atol=1e-12)
        np.testing.assert_allclose(_stacked(w, b), theta + alpha * d + mu * prev, rtol=1e-8,
                                   atol=1e-12)
        prev = _stacked(w, b) - theta
    assert used_2x2 > 0 and capped > 0, (used_2x2, capped)


def test_fisher_forms_of_the_step_forward_pass_equal_those_of_a_fresh_one():
    """The step differentiates its own forward pass (the statistics pass) for
    the quadratic model's Fisher forms when it can; a separate import gives
    the same forms (and is what runs under a burn-in or a covariance period)."""
    w, b, fn, batches = _dense_problem(seed=5)
    x, y = batches[0]
    est = kg.FisherEstimator(fn, estimation_mode="sampled")
    reg = est.build(x, y)
    rng = np.random.default_rng(0)
    vectors = [[tf.constant(rng.normal(size=v.shape)) for v in reg.variables] for _ in range(2)]

    @tf.function(autograph=False)
    def both():
        taps = est.accumulate_taps(x, y)
        return (tf.stack([tf.stack(r) for r in exact_fisher.quadratic_forms(reg, (x, y), vectors,
                                                                            taps)]),
                tf.stack([tf.stack(r) for r in exact_fisher.quadratic_forms(reg, (x, y), vectors)]))

    shared, fresh = both()
    np.testing.assert_allclose(shared.numpy(), fresh.numpy(), rtol=1e-12)
    x_np, y_np = x.numpy(), y.numpy()
    _, _, _, abar, p = _numpy_quantities(_stacked(w, b), x_np, y_np)
    u, v = (np.concatenate([vs[0].numpy(), vs[1].numpy()[None]], 0) for vs in vectors)
    np.testing.assert_allclose(shared.numpy()[0, 1], _exact_fisher_form(u, v, abar, p),
                               rtol=1e-10)


def _qmodel_run(share, monkeypatch, seed):
    monkeypatch.setattr(single_device, "forms_reuse_forward", lambda opt: share)
    w, b, fn, batches = _dense_problem(seed=seed)
    opt = kg.KFAC(fn, cov_update_period=3, inverse_update_period=2, jit_compile=False)
    losses = [float(opt.step(x, y)) for x, y in batches[:7]]
    assert int(opt.skipped_steps.numpy()) == 0
    return (losses, _stacked(w, b),
            [v.numpy() for v in opt.estimator_state], float(opt.damping.numpy()))


def test_a_covariance_period_shares_the_forward_pass_with_the_same_steps(monkeypatch):
    """With ``cov_update_period > 1`` the quadratic model's step takes its loss,
    gradients and exact Fisher forms from one top-level pass of the registered
    graph, and adds the statistics in a branch on covariance steps: the same
    losses, parameters, factors and damping as the step without sharing
    (its own pass for the forms)."""
    shared = _qmodel_run(True, monkeypatch, seed=6)
    fresh = _qmodel_run(False, monkeypatch, seed=6)
    np.testing.assert_allclose(shared[0], fresh[0], rtol=1e-10)
    np.testing.assert_allclose(shared[1], fresh[1], rtol=1e-10, atol=1e-13)
    for a, b in zip(shared[2], fresh[2]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)
    assert shared[3] == pytest.approx(fresh[3], rel=1e-10)
    assert shared[0][-1] < shared[0][0]


def _solve(m11, m12, m22, c1, c2, dtype=F64):
    alpha, mu = qmodel.solve(*(tf.constant(v, dtype) for v in (m11, m12, m22, c1, c2)))
    return alpha.numpy(), mu.numpy()


def test_qmodel_solve_and_model_value():
    m = np.array([[3.0, 1.0], [1.0, 2.0]])
    c = np.array([-1.0, -0.5])
    alpha, mu = qmodel.solve(*(tf.constant(v, F64) for v in (m[0, 0], m[0, 1], m[1, 1], *c)))
    np.testing.assert_allclose([alpha, mu], -np.linalg.solve(m, c))
    assert 0 <= mu < 1
    value = qmodel.model_value(alpha, mu, *(tf.constant(v, F64) for v in
                                            (m[0, 0], m[0, 1], m[1, 1], *c)))
    np.testing.assert_allclose(value, -0.5 * c @ np.linalg.solve(m, c))
    assert _solve(3.0, 0.0, 0.0, -1.0, 0.0) == (pytest.approx(1 / 3), 0.0)


@pytest.mark.parametrize("m,c", [
    ([[3.0, 1.0], [1.0, 2.0]], [-1.0, 0.5]),    # 2x2 mu = -0.5 < 0
    ([[1.0, 0.0], [0.0, 1.0]], [-1.0, -2.0]),   # 2x2 mu = 2 >= 1
    ([[1.0, 0.0], [0.0, 1.0]], [-1.0, -1.0]),   # 2x2 mu = 1 exactly
    # the measured CNN step (damping 1e-3) whose 2x2 mu was -3.47:
    ([[1.02698353e10, 18926.3516], [18926.3516, 9.73723602]], [367297.594, 34.3235703]),
])
def test_qmodel_solve_falls_back_to_1d_where_mu_is_outside_0_1(m, c):
    m, c = np.array(m), np.array(c)
    unconstrained_mu = -np.linalg.solve(m, c)[1]
    assert not 0 <= unconstrained_mu < 1
    alpha, mu = _solve(m[0, 0], m[0, 1], m[1, 1], *c)
    assert mu == 0.0
    assert alpha == pytest.approx(-c[0] / m[0, 0])


@pytest.mark.parametrize("dtype", [tf.float32, F64])
def test_qmodel_solve_falls_back_to_1d_on_an_ill_conditioned_system(dtype):
    # Delta and delta0 almost parallel in the C metric: det / (m11 m22) = 1e-9,
    # with the 2x2 solution mu = 0.5 in exact arithmetic but dominated by
    # round-off (and in float32 det rounds to 0 or below).
    m11, m22, eps = 4.0, 1.0, 1e-9
    m12 = np.sqrt(m11 * m22 * (1 - eps))
    c1, c2 = -(m11 * 1.0 + m12 * 0.5), -(m12 * 1.0 + m22 * 0.5)   # solution (1, 0.5)
    alpha, mu = _solve(m11, m12, m22, c1, c2, dtype)
    assert mu == 0.0
    assert alpha == pytest.approx(-c1 / m11, rel=1e-6)
    # the same system well conditioned keeps its 2x2 solution
    m12 = 1.0
    c1, c2 = -(m11 + m12 * 0.5), -(m12 + m22 * 0.5)
    alpha, mu = _solve(m11, m12, m22, c1, c2, dtype)
    np.testing.assert_allclose([alpha, mu], [1.0, 0.5], rtol=1e-5)


def test_qmodel_solve_without_positive_curvature_takes_no_step():
    assert _solve(0.0, 0.0, 0.0, -1.0, 0.0) == (0.0, 0.0)
    assert _solve(np.nan, 0.0, 1.0, -1.0, 0.5) == (0.0, 0.0)


@pytest.mark.parametrize("quadratic,linear,objective", [
    (1.0, -10.0, 2.0), (1e-6, -3e6, 17.8), (0.0, -5.0, 1.0), (4.0, -9.0, 4.5)])
def test_qmodel_cap_shortens_to_where_the_undamped_model_meets_minus_the_objective(
        quadratic, linear, objective):
    s = float(qmodel.cap(*(tf.constant(v, F64) for v in (quadratic, linear, objective))))
    assert 0 < s < 1
    assert quadratic * s * s + linear * s == pytest.approx(-objective, rel=1e-10)
    assert quadratic * s * s + linear * s > quadratic + linear  # the first crossing, short of s=1


@pytest.mark.parametrize("quadratic,linear,objective", [
    (1.0, -1.5, 2.0),      # the model stays above -h at s = 1
    (1.0, -10.0, 0.0),     # no positive objective to bound by
    (1.0, -10.0, -3.0),
    (1.0, np.nan, 2.0)])
def test_qmodel_cap_leaves_other_updates_alone(quadratic, linear, objective):
    assert float(qmodel.cap(*(tf.constant(v, F64) for v in (quadratic, linear, objective)))) == 1


def test_qmodel_small_cnn_does_not_diverge_at_the_default_damping():
    """A small CNN (conv, relu, strided conv, dense) on a learnable task with
    the quadratic model at the default damping: before mu was bounded the
    2x2 solve sent mu to -3.5, -11, -5e4 and the loss to 1e29 within four
    steps on the digits CNN."""
    import keras
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    means = rng.normal(size=(4, 8, 8, 1)).astype("float32")
    labels = rng.integers(0, 4, size=512).astype("int32")
    images = means[labels] + rng.normal(size=(512, 8, 8, 1)).astype("float32")
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(16, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(4),
    ])
    fn = kg.auto_register(lambda x, y: tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x))))
    opt = kg.KFAC(fn, momentum_type="qmodel", jit_compile=False)
    losses, mus = [], []
    for step in range(30):
        i = rng.choice(512, 64, replace=False)
        losses.append(float(opt.step(tf.constant(images[i]), tf.constant(labels[i]))))
        mus.append(float(opt.momentum.numpy()))
    assert np.all(np.isfinite(losses)), losses
    assert opt.skipped_steps.numpy() == 0
    assert all(0 <= mu < 1 for mu in mus), mus
    assert max(losses) < 10 * losses[0], losses
    assert np.mean(losses[-5:]) < 0.5 * losses[0], losses


@pytest.mark.parametrize("loss_change,model_change,factor", [
    (-0.9, -1.0, 0.5),      # rho = 0.9 > 3/4: the model is good, damping falls
    (-0.1, -1.0, 2.0),      # rho = 0.1 < 1/4: damping rises
    (0.5, -1.0, 2.0),       # the loss rose: rho < 0
    (-0.5, -1.0, 1.0),      # rho = 1/2: unchanged
    (np.nan, -1.0, 2.0),    # non-finite new loss: rises
    (-0.1, 1.0, 0.5),       # fell where the model predicted a rise (tensorflow/kfac)
])
def test_levenberg_marquardt_rule(loss_change, model_change, factor):
    new, _ = damping_lib.adapt(tf.constant(1.0, F64), loss_change, model_change, 0.5, 1e-8)
    assert new.numpy() == pytest.approx(factor)


def test_lm_damping_falls_where_the_quadratic_model_is_exact():
    """Least squares through one dense layer: the K-FAC block is the exact
    Gauss-Newton matrix and the loss is quadratic, so rho = 1."""
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(3, 2)), dtype=F64)
    x, y = tf.constant(rng.normal(size=(16, 3))), tf.constant(rng.normal(size=(16, 2)))
    fn = kg.auto_register(lambda x, y: tf.reduce_mean(tf.reduce_sum(tf.square(y - x @ w), -1)))
    opt = kg.KFAC(fn, momentum_type="regular", damping=1.0, learning_rate=0.5, momentum=0.0,
                  norm_constraint=None,
                  estimation_mode="exact", adapt_damping=True, damping_adaptation_interval=2,
                  jit_compile=False)
    omega = 0.95 ** 2
    damping = [opt.step(x, y) is not None and opt.damping.numpy() for _ in range(4)]
    np.testing.assert_allclose(damping, [1.0, omega, omega, omega ** 2])
    np.testing.assert_allclose(opt.rho.numpy(), 1.0, rtol=1e-6)


def test_lm_damping_rises_after_a_far_too_long_step():
    rng = np.random.default_rng(1)
    w = tf.Variable(rng.normal(size=(3, 4)) * 0.1, dtype=F64)
    x = tf.constant(rng.normal(size=(64, 3)))
    y = tf.constant(rng.integers(0, 4, size=64), tf.int32)
    fn = kg.auto_register(lambda x, y: tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(y, x @ w)))
    opt = kg.KFAC(fn, momentum_type="regular", damping=1e-3, learning_rate=100.0, momentum=0.0,
                  norm_constraint=None,
                  estimation_mode="exact", adapt_damping=True, damping_adaptation_interval=1,
                  jit_compile=False)
    opt.step(x, y)
    assert opt.rho.numpy() < 0.25
    assert opt.damping.numpy() == pytest.approx(1e-3 / 0.95)


def test_lm_damping_stops_at_its_floor():
    floor = damping_lib.default_min_damping(0.1)
    assert floor == pytest.approx(1e-5)
    lam = tf.constant(0.1, F64)
    for _ in range(200):   # the model always trustworthy: lambda only falls
        lam, _ = damping_lib.adapt(lam, -1.0, -1.0, 0.95 ** 5, floor)
    assert lam.numpy() == pytest.approx(floor)
