"""kg.KFAC's quadratic model (alpha, mu against a numpy 2x2 solve with the
exact Fisher) and Levenberg-Marquardt damping."""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph.optimizer import damping as damping_lib
from kfac_graph.optimizer import qmodel
from test_optimizer import (_dense_problem, _numpy_precondition, _numpy_quantities, _softmax,
                            _stacked)

F64 = tf.float64


def _exact_fisher_form(u, v, abar, p):
    """u . F v for the dense softmax layer: (1/B) sum_i (a_i U) F_i (a_i V)."""
    ju, jv = abar @ u, abar @ v
    f = np.stack([np.diag(q) - np.outer(q, q) for q in p])
    return np.einsum("bk,bkl,bl->", ju, f, jv) / len(abar)


def test_qmodel_alpha_and_mu_are_the_numpy_2x2_solve():
    w, b, fn, batches = _dense_problem(seed=4)
    lam = 1e-2
    opt = kg.KFAC(fn, momentum_type="qmodel", damping=lam, estimation_mode="exact",
                  cov_ema_decay=0.0, inverse_update_period=1, jit_compile=False)
    prev = np.zeros_like(_stacked(w, b))
    for x, y in batches[:3]:
        theta = _stacked(w, b)
        grad, a, g, abar, p = _numpy_quantities(theta, x, y)
        d = _numpy_precondition(grad, a, g, lam)
        form = lambda u, v: _exact_fisher_form(u, v, abar, p) + lam * np.sum(u * v)
        m = np.array([[form(d, d), form(d, prev)], [form(prev, d), form(prev, prev)]])
        c = np.array([np.sum(grad * d), np.sum(grad * prev)])
        if not prev.any():
            alpha, mu = -c[0] / m[0, 0], 0.0
        else:
            alpha, mu = -np.linalg.solve(m, c)
        opt.step(x, y)
        np.testing.assert_allclose(-opt.learning_rate.numpy(), alpha, rtol=1e-8)
        np.testing.assert_allclose(opt.momentum.numpy(), mu, rtol=1e-8, atol=1e-12)
        np.testing.assert_allclose(_stacked(w, b), theta + alpha * d + mu * prev, rtol=1e-8,
                                   atol=1e-12)
        prev = _stacked(w, b) - theta
    assert opt.momentum.numpy() != 0.0


def test_qmodel_solve_and_model_value():
    m = np.array([[3.0, 1.0], [1.0, 2.0]])
    c = np.array([-1.0, 0.5])
    alpha, mu = qmodel.solve(*(tf.constant(v, F64) for v in (m[0, 0], m[0, 1], m[1, 1], *c)))
    np.testing.assert_allclose([alpha, mu], -np.linalg.solve(m, c))
    value = qmodel.model_value(alpha, mu, *(tf.constant(v, F64) for v in
                                            (m[0, 0], m[0, 1], m[1, 1], *c)))
    np.testing.assert_allclose(value, -0.5 * c @ np.linalg.solve(m, c))
    alpha, mu = qmodel.solve(*(tf.constant(v, F64) for v in (3.0, 0.0, 0.0, -1.0, 0.0)))
    assert (alpha.numpy(), mu.numpy()) == (pytest.approx(1 / 3), 0.0)


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
    opt = kg.KFAC(fn, damping=1.0, learning_rate=0.5, momentum=0.0, norm_constraint=None,
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
    opt = kg.KFAC(fn, damping=1e-3, learning_rate=100.0, momentum=0.0, norm_constraint=None,
                  estimation_mode="exact", adapt_damping=True, damping_adaptation_interval=1,
                  jit_compile=False)
    opt.step(x, y)
    assert opt.rho.numpy() < 0.25
    assert opt.damping.numpy() == pytest.approx(1e-3 / 0.95)
