"""Keras variable constraints (``kernel_constraint=NonNeg()``, ``MaxNorm``;
a ``tf.Variable``'s own ``constraint``): ``kg.KFAC``, ``kg.DPSGD`` and
``KFACModel.fit`` apply them after each update, as Keras's optimizers do
(before, they were ignored: a NonNeg kernel went negative)."""
import keras
import numpy as np
import tensorflow as tf

import kfac_graph as kg

RNG = np.random.default_rng(0)
X = tf.constant(RNG.normal(size=(16, 5)))
Y = tf.constant(RNG.integers(0, 3, 16))


def _model(constrained):
    keras.utils.set_random_seed(0)
    kw = dict(kernel_constraint=keras.constraints.NonNeg()) if constrained else {}
    out = dict(kernel_constraint=keras.constraints.MaxNorm(0.3)) if constrained else {}
    return keras.Sequential([keras.Input((5,), dtype="float64"),
                             keras.layers.Dense(6, activation="tanh", dtype="float64", **kw),
                             keras.layers.Dense(3, dtype="float64", **out)])


def _loss(model):
    return kg.auto_register(lambda x, y: tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x))))


def _projected(values):
    """NonNeg on the first kernel, MaxNorm(0.3) on the columns of the second."""
    out = list(values)
    out[0] = out[0] * (out[0] >= 0)
    norms = np.sqrt(np.sum(out[2] ** 2, axis=0, keepdims=True))
    out[2] = out[2] * np.clip(norms, 0, 0.3) / (1e-7 + norms)
    return out


def test_kfac_step_is_the_unconstrained_step_then_the_projection():
    steps = {}
    for constrained in (False, True):
        model = _model(constrained)
        fn = _loss(model)
        opt = kg.KFAC(fn, estimation_mode="exact", momentum_type="regular", learning_rate=0.5,
                      momentum=0.0, adapt_damping=False, norm_constraint=None)
        opt.step(X, Y)
        steps[constrained] = [v.numpy() for v in model.trainable_variables]
        if constrained:
            assert "constraints applied after each update" in fn.registration(X, Y).summary()
    assert np.min(steps[False][0]) < 0 and np.max(np.linalg.norm(steps[False][2], axis=0)) > 0.3
    for got, want in zip(steps[True], _projected(steps[False])):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_dpsgd_step_is_the_unconstrained_step_then_the_projection():
    steps = {}
    for constrained in (False, True):
        model = _model(constrained)
        opt = kg.DPSGD(_loss(model), learning_rate=2.0, l2_norm_clip=1e6, noise_multiplier=0.0)
        opt.step(X, Y)
        steps[constrained] = [v.numpy() for v in model.trainable_variables]
    assert np.min(steps[False][0]) < 0
    for got, want in zip(steps[True], _projected(steps[False])):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_kfac_model_fit_keeps_the_constraints_and_a_tf_variable_keeps_its_own():
    model = kg.KFACModel(_model(True), loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    model.compile()
    model.fit(X, Y, batch_size=8, epochs=2, verbose=0)
    kernel, _, head, _ = [v.numpy() for v in model.trainable_variables]
    assert np.min(kernel) >= 0 and np.max(np.linalg.norm(head, axis=0)) <= 0.3 + 1e-6

    w = tf.Variable(tf.fill([5, 3], tf.constant(0.05, tf.float64)),
                    constraint=lambda v: tf.clip_by_value(v, -0.1, 0.1))
    fn = kg.auto_register(lambda x, y: tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(y, x @ w)))
    kg.DPSGD(fn, learning_rate=50.0, l2_norm_clip=1e6, noise_multiplier=0.0).step(X, Y)
    assert np.max(np.abs(w.numpy())) == 0.1
