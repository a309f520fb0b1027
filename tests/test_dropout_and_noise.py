"""Losses that draw random numbers: dropout, noise and augmentation layers.

A loss run once draws once; example i's per-example gradient is the gradient
of its own term under that draw (its rows of the batch's masks). The
reference resets the Keras seed generators (variables) before every tape and
selects example i's term of the batch call by a one-hot sample weight times
B, so it sees the same draw; the per-example gradients' mean is that call's
batch gradient. ``kg.verify`` skips what cannot see one draw (a batch of
one draws its own; ops with their state in the kernel draw anew on every
run) instead of failing a correct runtime: before, every dropout model's
report FAILED on one-example (errors ~10), and a seeded tf_keras Dropout's
on the mean too. DP-SGD clips the gradients of the draw it steps on.
Also ``kg.verify`` on a sum loss with a weight penalty added once: each
example's gradient holds dR, so the sum is the batch gradient plus (B - 1) dR
(before: FAILED at 3e-2 on every layer the penalty reads).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg

B = 5
L = keras.layers


def _model(kind):
    keras.utils.set_random_seed(0)
    if kind == "dropout":
        shape, layers = (4, 6), [L.Dense(8, activation="tanh"),
                                 L.Dropout(0.5, noise_shape=(None, 1, 8)),
                                 L.GaussianNoise(0.3), L.Flatten()]
    elif kind == "spatial":
        shape, layers = (6, 6, 2), [L.Conv2D(3, 3, activation="tanh"),
                                    L.SpatialDropout2D(0.5), L.GaussianDropout(0.3),
                                    L.Flatten()]
    else:  # augmentation before a convolution: each example its own transform
        shape, layers = (6, 6, 2), [L.RandomFlip(), L.RandomTranslation(0.2, 0.2),
                                    L.RandomContrast(0.5), L.Conv2D(3, 3, activation="tanh"),
                                    L.AlphaDropout(0.3), L.Flatten()]
    model = keras.Sequential([keras.Input(shape), *layers, L.Dense(3)])
    rng = np.random.default_rng(1)
    return model, tf.constant(rng.normal(size=(B, *shape))), tf.constant(rng.integers(0, 3, B))


def _ce(model, x, y, weights=None):
    ce = keras.losses.sparse_categorical_crossentropy(y, model(x, training=True),
                                                      from_logits=True)
    return tf.reduce_mean(ce if weights is None else ce * weights)


class _Seeds:
    """The model's seed generators' state, put back by ``reset()``."""

    def __init__(self, model):
        self.variables = [v for v in model.variables if "seed_generator" in v.path]
        self.saved = [v.numpy() for v in self.variables]

    def reset(self):
        for v, s in zip(self.variables, self.saved):
            v.assign(s)


def _gradient(variables, loss):
    with tf.GradientTape() as tape:
        value = loss()
    return [tf.convert_to_tensor(g).numpy() for g in tape.gradient(value, variables)]


@pytest.mark.parametrize("kind", ["dropout", "spatial", "augmentation"])
def test_per_example_gradients_are_of_the_batch_calls_draw(keras_float64, kind):
    model, x, y = _model(kind)
    loss = kg.auto_register(lambda x, y: _ce(model, x, y))
    reg = loss.registration(x, y)
    assert not reg.generic_variables
    seeds = _Seeds(model)
    assert seeds.variables
    pxg = [g.numpy() for g in kg.per_example_gradients(loss, x, y)]
    drawn = [v.numpy() for v in seeds.variables]
    assert any(np.any(a != b) for a, b in zip(drawn, seeds.saved))  # it drew (once or more)
    seeds.reset()
    norms = kg.per_example_gradient_norms(loss, x, y).numpy()
    rows = []
    for i in range(B):
        seeds.reset()
        one_hot = tf.one_hot(i, B, dtype=tf.float64) * B  # example i's own term
        rows.append(_gradient(reg.variables, lambda: _ce(model, x, y, one_hot)))
    for k, got in enumerate(pxg):
        want = np.stack([r[k] for r in rows])
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    want_norms = np.sqrt(sum(np.sum(np.reshape(np.stack([r[k] for r in rows]), [B, -1]) ** 2, 1)
                             for k in range(len(pxg))))
    np.testing.assert_allclose(norms, want_norms, rtol=1e-10)
    seeds.reset()
    batch = _gradient(reg.variables, lambda: _ce(model, x, y))
    for got, want in zip(pxg, batch):
        np.testing.assert_allclose(got.mean(0), want, rtol=1e-10, atol=1e-12)


def test_verify_skips_the_batch_of_one_and_checks_the_mean_of_one_draw(keras_float64):
    model, x, y = _model("dropout")
    report = kg.verify(lambda x, y: _ce(model, x, y), x, y, estimation_mode="exact")
    assert report.passed, report.table()
    for row in report.rows:
        assert row.check("mean").status == "pass"
        one = row.check("one-example")
        assert one.status == "skipped" and one.note == "draws random numbers"
        assert row.check("fisher").status == "pass"
    assert any("draws random numbers" in n and "same draw" in n for n in report.notes)


def test_verify_skips_the_mean_where_ops_keep_their_state_in_the_kernel():
    """tf_keras's Dropout with a seed: a stateful RandomUniform, whose next
    run draws anew whatever the variables hold (the mean failed at ~1)."""
    tf_keras = pytest.importorskip("tf_keras")
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.layers.Dense(8, activation="tanh", input_shape=(6,)),
                                 tf_keras.layers.Dropout(0.5, seed=3),
                                 tf_keras.layers.Dense(3)])
    ce = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(0)
    x, y = tf.constant(rng.normal(size=(B, 6)), tf.float32), tf.constant(rng.integers(0, 3, B))
    report = kg.verify(lambda x, y: ce(y, model(x, training=True)), x, y)
    assert report.passed, report.table()
    assert {row.check("mean").note for row in report.rows} == {"draws anew"}
    assert {row.check("norms").status for row in report.rows} == {"pass"}
    assert any("RandomUniform" in n and "kernel" in n for n in report.notes)


@pytest.mark.parametrize("where", ["once", "each_term"])
def test_verify_on_a_sum_loss_with_a_weight_penalty(keras_float64, where):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(
        3, kernel_regularizer=keras.regularizers.L2(0.1), bias_regularizer="l1",
        bias_initializer="glorot_uniform")])
    rng = np.random.default_rng(0)
    x, y = tf.constant(rng.normal(size=(B, 4))), tf.constant(rng.normal(size=(B, 3)))

    def loss(x, y):
        squared = tf.reduce_sum(tf.square(model(x) - y), axis=1)
        if where == "each_term":
            return tf.reduce_sum(squared + tf.add_n(model.losses))
        return tf.reduce_sum(squared) + tf.add_n(model.losses)
    report = kg.verify(loss, x, y)
    assert report.passed, report.table()
    assert report.rows[0].check("sum").status == "pass"
    assert any("(B - 1) dR" in n for n in report.notes) == (where == "once")


def test_dp_sgd_clips_the_gradients_of_the_draw_it_steps_on(keras_float64):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), L.Dense(8, activation="tanh"), L.Dropout(0.5),
                              L.Dense(3)])
    rng = np.random.default_rng(0)
    x, y = tf.constant(rng.normal(size=(B, 6))), tf.constant(rng.integers(0, 3, B))
    loss = kg.auto_register(lambda x, y: _ce(model, x, y))
    reg = loss.registration(x, y)
    seeds = _Seeds(model)
    clip = 0.2
    for method in ("reweight", "materialize"):
        seeds.reset()
        pxg = [g.numpy() for g in kg.per_example_gradients(loss, x, y)]
        norms = np.sqrt(sum(np.sum(np.reshape(g, [B, -1]) ** 2, 1) for g in pxg))
        assert np.all(norms > clip)  # every example clipped
        want = [np.tensordot(clip / norms, g, 1) / B for g in pxg]
        seeds.reset()
        before = [v.numpy() for v in reg.variables]
        kg.DPSGD(loss, learning_rate=1.0, l2_norm_clip=clip, noise_multiplier=0.0,
                 method=method).step(x, y)
        for v, b, w in zip(reg.variables, before, want):
            np.testing.assert_allclose(b - v.numpy(), w, rtol=1e-10, atol=1e-13)
            v.assign(b)
    # K-FAC's defaults: each step draws anew (the seed moves), and none is skipped
    seeds.reset()
    opt = kg.KFAC(loss)
    losses = [float(opt.step(x, y)) for _ in range(3)]
    assert np.all(np.isfinite(losses)) and int(opt.skipped_steps) == 0
    assert int(seeds.variables[0].numpy()[1] - seeds.saved[0][1]) >= 3


@pytest.mark.parametrize("form", ["expand", "reshape"])
def test_a_mean_over_a_unit_axis_of_the_per_example_loss(keras_float64, form):
    """``mean(mean(reshape(ce, [B, -1]), 1))``: canonicalize drops the unit
    axis, and the inner mean's axis 1 was read on the ``[B]`` tensor left,
    as axis 0, the batch's: the loss read as ``1/B`` times a mean. A generic
    variable's per-example gradients came out ``1/B`` of the loop's, and
    DP-SGD's reweighted sum over an RNN cell's uses off by 75%."""
    rng = np.random.default_rng(0)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3, 2)), L.SimpleRNN(4), L.Dense(3)])
    t = tf.Variable(rng.normal(size=(3,)), name="t")  # sin(t): a generic variable
    x, y = tf.constant(rng.normal(size=(B, 3, 2))), tf.constant(rng.integers(0, 3, B))

    def loss(x, y):
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x) * tf.sin(t))
        ce = ce[:, None] if form == "expand" else tf.reshape(ce, [tf.shape(ce)[0], -1])
        return tf.reduce_mean(tf.reduce_mean(ce, 1))
    loss = kg.auto_register(loss)
    reg = loss.registration(x, y)
    assert (reg.loss.reduction, reg.loss.scale, reg.per_example_coefficient) == ("mean", 1, 1)
    pxg = [g.numpy() for g in kg.per_example_gradients(loss, x, y)]
    rows = [_gradient(reg.variables, lambda: loss(x[i:i + 1], y[i:i + 1])) for i in range(B)]
    for k, got in enumerate(pxg):
        np.testing.assert_allclose(got, np.stack([r[k] for r in rows]), rtol=1e-10, atol=1e-13)
    norms = np.sqrt(sum(np.sum(np.reshape(g, [B, -1]) ** 2, 1) for g in pxg))
    want = [np.tensordot(np.minimum(1, 0.05 / norms), g, 1) / B for g in pxg]
    got = kg.dp_gradients(loss, x, y, l2_norm_clip=0.05, noise_multiplier=0.0,
                          method="reweight")
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-10, atol=1e-13)
