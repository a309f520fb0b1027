"""The quadratic model's step takes one backward pass for its gradients and
its exact Fisher forms: the gradients go through the model output ``z``
(``r = J^T w`` with ``w = dL/dz``, plus the loss's paths that bypass ``z``),
and the forms differentiate that ``r`` again with respect to ``w``
(``exact_fisher.loss_gradients``). Shown on a float64 model with a looked-up
table (its gradient ``IndexedSlices``), a custom-gradient activation and an
L2 penalty that reaches a kernel besides ``z``: the gradients equal
``tf.gradients``', and default steps equal those with a backward pass of
the forms' own."""
import dataclasses

import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import double_backward
from kfac_graph.optimizer import exact_fisher, step_pass

F64 = tf.float64


@tf.custom_gradient
def _soft_sign(x):
    y = x / (1 + tf.abs(x))
    return y, lambda dy: dy / tf.square(1 + tf.abs(x))


def _problem(seed=0, batch=8, vocab=20, width=6, hidden=7, classes=5):
    rng = np.random.default_rng(seed)
    table = tf.Variable(rng.normal(size=(vocab, width)), dtype=F64, name="table")
    w1 = tf.Variable(rng.normal(size=(3 * width, hidden)) * 0.3, dtype=F64, name="w1")
    b1 = tf.Variable(np.zeros(hidden), dtype=F64, name="b1")
    w2 = tf.Variable(rng.normal(size=(hidden, classes)) * 0.3, dtype=F64, name="w2")

    def loss_fn(ids, y):
        e = tf.reshape(tf.gather(table, ids), [-1, 3 * width])
        logits = tf.matmul(_soft_sign(tf.matmul(e, w1) + b1), w2)
        ce = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        return ce + 1e-2 * tf.reduce_sum(tf.square(w1))

    batches = [(tf.constant(rng.integers(0, vocab, (batch, 3)), tf.int32),
                tf.constant(rng.integers(0, classes, batch), tf.int32)) for _ in range(6)]
    return [table, w1, b1, w2], kg.auto_register(loss_fn), batches


def test_gradients_through_the_output_equal_tf_gradients():
    variables, fn, batches = _problem()
    est = kg.FisherEstimator(fn)
    reg = est.build(*batches[0])

    @tf.function(autograph=False)
    def both():
        taps = est.accumulate_taps(*batches[0])
        through = step_pass.dense(exact_fisher.loss_gradients(taps, reg.variables),
                                  reg.variables)
        plain = step_pass.dense(tf.gradients(taps.loss, reg.variables), reg.variables)
        return through, plain, "pullback" in taps.derived

    through, plain, kept = both()
    assert bool(kept)
    for a, b in zip(through, plain):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-15)


def _run(monkeypatch, share, **options):
    if not share:
        monkeypatch.setattr(step_pass, "_gradients",
                            lambda taps, variables, for_forms: tf.gradients(taps.loss, variables))
    pulled = []
    products = double_backward.jacobian_products

    def spy(z, w, variables, vectors, pulled_r=None):
        pulled.append(pulled_r is not None)
        return products(z, w, variables, vectors, pulled_r)

    monkeypatch.setattr(double_backward, "jacobian_products", spy)
    variables, fn, batches = _problem(seed=3)
    opt = kg.KFAC(fn, jit_compile=False, **options)
    before = float(fn(*batches[0]))
    losses = [float(opt.step(*b)) for b in batches * 2]
    monkeypatch.undo()
    assert int(opt.skipped_steps.numpy()) == 0
    assert float(fn(*batches[0])) < before
    return losses, [v.numpy() for v in variables], float(opt.damping.numpy()), pulled


@pytest.mark.parametrize("options", [{}, {"cov_update_period": 3}],
                         ids=["every_step_statistics", "covariance_period_3"])
def test_default_steps_equal_those_with_a_backward_pass_of_the_forms_own(monkeypatch,
                                                                         options):
    shared = _run(monkeypatch, True, **options)
    own = _run(monkeypatch, False, **options)
    assert shared[3] == [True] and own[3] == [False]  # the one trace's forms
    np.testing.assert_allclose(shared[0], own[0], rtol=1e-10)
    for a, b in zip(shared[1], own[1]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)
    assert shared[2] == pytest.approx(own[2], rel=1e-10)


def test_a_loss_that_gathers_from_the_output_pulls_back_a_dense_cotangent():
    """Where the loss reads ``z`` through a gather (its ``dL/dz`` is
    ``IndexedSlices``), the pullback takes that cotangent made dense: the
    gradients equal ``tf.gradients``', and the Jacobian-vector products
    equal those of a pullback of zeros."""
    rng = np.random.default_rng(1)
    w = tf.Variable(rng.normal(size=(6, 5)), dtype=F64, name="w")

    def loss_fn(x, rows, y):
        logits = tf.matmul(x, w)
        picked = tf.gather(logits, rows)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, picked))

    fn = kg.auto_register(loss_fn)
    args = (tf.constant(rng.normal(size=(8, 6))), tf.constant([1, 4, 4, 6], tf.int32),
            tf.constant([0, 2, 3, 1], tf.int32))
    est = kg.FisherEstimator(fn)
    reg = est.build(*args)
    u = [[tf.constant(rng.normal(size=w.shape))]]

    @tf.function(autograph=False)
    def both():
        taps = est.accumulate_taps(*args)
        # the matmul's output, before the loss's gather, as the model output
        before = dataclasses.replace(taps, model_output=taps.outputs[0][0], derived={})
        assert isinstance(tf.gradients(before.loss, before.model_output)[0], tf.IndexedSlices)
        through = exact_fisher.loss_gradients(before, reg.variables)
        plain = tf.gradients(before.loss, reg.variables)
        shared = exact_fisher._jacobian_products(before, before.model_output, reg.variables, u)
        zeros = double_backward.jacobian_products(
            before.model_output, tf.zeros_like(before.model_output), reg.variables, u)
        return through[0], plain[0], shared[0], zeros[0]

    through, plain, shared, zeros = both()
    np.testing.assert_allclose(through.numpy(), plain.numpy(), rtol=1e-12)
    np.testing.assert_allclose(shared.numpy(), zeros.numpy(), rtol=1e-12)
    np.testing.assert_allclose(shared.numpy(), args[0].numpy() @ u[0][0].numpy(), rtol=1e-12)


def test_keras_regularisers_on_a_kernel_and_an_activation(monkeypatch, keras_float64):
    """Keras's ``kernel_regularizer`` and ``activity_regularizer`` add
    penalties whose paths to the variables bypass the output (the second
    through the trunk's activations): default steps equal those with the
    forms' own backward pass."""
    import keras

    def run(share):
        keras.utils.set_random_seed(2)
        model = keras.Sequential([
            keras.Input((5,)),
            keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-2),
                               activity_regularizer=keras.regularizers.L1(1e-2)),
            keras.layers.Dense(4)])

        def loss_fn(x, y):
            logits = model(x, training=True)
            ce = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
            return ce + tf.add_n(model.losses)

        if not share:
            monkeypatch.setattr(step_pass, "_gradients",
                                lambda taps, v, for_forms: tf.gradients(taps.loss, v))
        opt = kg.KFAC(kg.auto_register(loss_fn), jit_compile=False)
        rng = np.random.default_rng(5)
        losses = [float(opt.step(tf.constant(rng.normal(size=(8, 5))),
                                 tf.constant(rng.integers(0, 4, 8), tf.int32)))
                  for _ in range(8)]
        monkeypatch.undo()
        assert int(opt.skipped_steps.numpy()) == 0
        return losses, [v.numpy() for v in model.trainable_variables]

    shared, own = run(True), run(False)
    np.testing.assert_allclose(shared[0], own[0], rtol=1e-10)
    for a, b in zip(shared[1], own[1]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)
