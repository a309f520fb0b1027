"""Training recipes as keras.io and the TensorFlow tutorials write them, each
tiny, in float64, against one-example tapes, the batch gradient, ``kg.verify``
and a few ``kg.KFAC`` and ``kg.DPSGD`` steps.

- Knowledge distillation (Keras's ``Distiller``): ``KLDivergence`` of the
  softened teacher and student, times ``T**2``, plus ``alpha`` times the
  student's cross-entropy. With the teacher under ``tf.stop_gradient`` (its
  variables trainable) it was registered: 2 teacher layers with zero
  per-example gradients, its logits joined to the loss's Gauss-Newton
  output, and K-FAC's third step moved the student 0.016 away from the
  frozen teacher's (``passes/gradient_stops.py``). A CLIP-style trainable
  temperature ``logits * exp(s)`` is a scale used twice.
- WGAN-GP's critic loss ``mean(critic(fake)) - mean(critic(real)) +
  lambda * mean((|d critic(x_hat) / d x_hat| - 1)^2)``, the penalty taken
  with a ``tf.GradientTape`` inside the loss: the difference of two reduced
  terms stopped the loss pass ("cannot read a loss through op 'sub'", a
  ``LossNotFoundError``); it is read as ``a + (-1) b`` now
  (``loss_terms.reduced_difference``). The loss is opaque (no
  distribution): per-example gradients exact, DP-SGD runs, K-FAC's default
  refuses in one line, its empirical Fisher trains.
- A model output of one value per example (``[B]``) beside a generic
  variable (the penalty alone on a conv critic, whose kernel is used by a
  convolution and its transpose; a regression on ``(x @ w)[:, 0] *
  sin(t)``): the Fisher's per-example sources summed ``z * c`` over the
  batch (``[1]``, not ``[B]``), and K-FAC and ``kg.verify``'s Fisher check
  stopped (``kfac_graph/fisher/cotangents.py``).
- A siamese network (one encoder on two inputs, a contrastive margin loss on
  the pair's distance): shared layers with 2 uses, exact. Triplet loss with
  in-batch hardest-negative mining couples the examples (DP-SGD refuses);
  with given triples, exact.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from per_example_reference import assert_matches_loop

L = keras.layers
B = 5


def _batch_mean_matches(fn, args, reg, rtol=1e-10):
    pxg = kg.per_example_gradients(fn, *args)
    with tf.GradientTape() as tape:
        loss = fn(*args)
    for v, g, b in zip(reg.variables, pxg, tape.gradient(loss, list(reg.variables))):
        b = tf.zeros_like(v) if b is None else b
        np.testing.assert_allclose(tf.reduce_mean(g, 0), b, rtol=rtol, atol=1e-12, err_msg=v.name)


def _kfac_runs(fn, args, steps=3, **kwargs):
    opt = kg.KFAC(fn, **kwargs)
    losses = [float(opt.step(*args)) for _ in range(steps)]
    assert int(opt.skipped_steps.numpy()) == 0 and np.all(np.isfinite(losses)), losses
    return losses


def _dp_runs(fn, args):
    dp = kg.DPSGD(fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=0.5, seed=0)
    assert np.isfinite(float(dp.step(*args)))


def _distillation(teacher_mode, temperature="constant"):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    teacher = keras.Sequential([keras.Input((4,)), L.Dense(6, activation="relu"), L.Dense(3)])
    student = keras.Sequential([keras.Input((4,)), L.Dense(5, activation="relu"), L.Dense(3)])
    teacher.trainable = teacher_mode != "frozen"
    kl = keras.losses.KLDivergence()
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    log_scale = tf.Variable(0.5, dtype=tf.float64, name="logit_scale")

    @kg.auto_register
    def loss_fn(x, y):
        t = teacher(x, training=False)
        if teacher_mode == "stop_gradient":
            t = tf.stop_gradient(t)
        z = student(x, training=True)
        if temperature == "trainable":  # CLIP's logit_scale
            soft = kl(tf.nn.softmax(t * tf.exp(log_scale)), tf.nn.softmax(z * tf.exp(log_scale)))
        else:
            soft = kl(tf.nn.softmax(t / 3.0), tf.nn.softmax(z / 3.0)) * 3.0 ** 2
        return 0.9 * soft + 0.1 * ce(y, z)
    args = (tf.constant(rng.normal(size=(B, 4))), tf.constant(rng.integers(0, 3, B)))
    return loss_fn, args, student


@pytest.mark.slow  # a recipe's model; the recipes' one-line cases stay fast
def test_distillation_with_a_teacher_under_stop_gradient_is_the_frozen_teachers(keras_float64):
    runs = {}
    for mode in ("frozen", "stop_gradient"):
        fn, args, student = _distillation(mode)
        reg = assert_matches_loop(fn, args, rtol=1e-10)
        students = {id(v) for w in student.weights for v in (w, getattr(w, "value", w))}
        assert len(reg.layers) == 2 and all(id(v) in students for v in reg.variables), \
            reg.summary()
        assert "kfac_joined_outputs" not in reg.loss.output, reg.summary()
        runs[mode] = _kfac_runs(fn, args, estimation_mode="exact")
        runs[mode + " weights"] = [v.numpy() for v in student.weights]
    np.testing.assert_allclose(runs["stop_gradient"], runs["frozen"], rtol=1e-12)
    for a, b in zip(runs["stop_gradient weights"], runs["frozen weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_distillation_with_a_trainable_temperature(keras_float64):
    fn, args, _ = _distillation("frozen", "trainable")
    reg = assert_matches_loop(fn, args, rtol=1e-10)
    scale = [layer for layer in reg.layers if layer.variables[0].name.startswith("logit_scale")]
    assert [(layer.kind, layer.uses) for layer in scale] == [("scale_and_shift", 2)]
    assert not reg.generic_variables
    assert kg.verify(fn, *args, estimation_mode="exact").passed
    losses = _kfac_runs(fn, args)
    assert losses[-1] < losses[0]
    _dp_runs(fn, args)


def _critic_loss(penalty=True, difference=True):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(3)
    critic = keras.Sequential([keras.Input((4,)), L.Dense(6), L.LeakyReLU(0.2),
                               L.Dense(6, activation="tanh"), L.Dense(1)])

    def gradient_penalty(real, fake, eps):
        x_hat = eps * real + (1 - eps) * fake
        with tf.GradientTape() as tape:
            tape.watch(x_hat)
            pred = critic(x_hat)
        norm = tf.sqrt(tf.reduce_sum(tf.square(tape.gradient(pred, x_hat)), axis=1))
        return tf.reduce_mean((norm - 1.0) ** 2)

    @kg.auto_register
    def loss_fn(real, fake, eps):
        loss = tf.reduce_mean(critic(fake)) - tf.reduce_mean(critic(real))
        return loss + 10.0 * gradient_penalty(real, fake, eps) if penalty else loss
    args = (tf.constant(rng.normal(size=(B, 4))), tf.constant(rng.normal(size=(B, 4)) + 1.0),
            tf.constant(rng.uniform(size=(B, 1))))
    return loss_fn, args


@pytest.mark.parametrize("penalty", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_wgan_critics_difference_of_means_is_read(keras_float64, penalty):
    fn, args = _critic_loss(penalty)
    reg = assert_matches_loop(fn, args, rtol=1e-10)
    assert reg.loss.kind == "opaque" and reg.loss.reduction == "mean" and not reg.coupling
    assert len(reg.per_example_extras) == 1 + penalty
    _batch_mean_matches(fn, args, reg)
    _dp_runs(fn, args)
    if penalty:
        assert kg.verify(fn, *args).passed
        with pytest.raises(kg.KfacGraphError, match="the loss is opaque"):
            kg.KFAC(fn).step(*args)
        losses = _kfac_runs(fn, args, 4, estimation_mode="empirical", momentum_type="regular")
        assert losses[-1] < losses[0], losses


def test_a_difference_of_per_example_tensors_stays_where_the_walk_stops(keras_float64):
    """Below the examples' tensors a ``Sub`` is not split: a triplet loss's
    ``dp - dn`` under a ``maximum`` keeps its Gauss-Newton reading."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(2)
    embed = keras.Sequential([keras.Input((4,)), L.Dense(6, activation="relu"), L.Dense(3)])

    @kg.auto_register
    def loss_fn(a, p, n):
        ea, ep, en = embed(a), embed(p), embed(n)
        dp = tf.reduce_sum(tf.square(ea - ep), -1)
        return tf.reduce_mean(tf.nn.softplus(dp - tf.reduce_sum(tf.square(ea - en), -1)))
    args = tuple(tf.constant(rng.normal(size=(B, 4))) for _ in range(3))
    reg = assert_matches_loop(loss_fn, args, rtol=1e-10)
    assert reg.loss.kind == "ggn" and [layer.uses for layer in reg.layers] == [3, 3]
    _kfac_runs(loss_fn, args)


def _rank1_regression():
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(4, 1)), name="w")
    t = tf.Variable(0.3, dtype=tf.float64, name="t")

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.square((x @ w)[:, 0] * tf.sin(t) - y))
    return loss_fn, (tf.constant(rng.normal(size=(B, 4))), tf.constant(rng.normal(size=(B,))))


def _conv_gradient_penalty():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(3)
    critic = keras.Sequential([keras.Input((4, 4, 1)), L.Conv2D(2, 3, padding="same"),
                               L.Flatten(), L.Dense(1)])

    @kg.auto_register
    def loss_fn(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            pred = critic(x)
        norm = tf.sqrt(tf.reduce_sum(tf.square(tape.gradient(pred, x)), axis=[1, 2, 3]))
        return tf.reduce_mean((norm - 1.0) ** 2)
    return loss_fn, (tf.constant(rng.normal(size=(B, 4, 4, 1))),)


@pytest.mark.parametrize("build", [_rank1_regression, _conv_gradient_penalty],
                         ids=["rank1_regression", "conv_gradient_penalty"])
def test_a_one_value_per_example_output_beside_a_generic_variable(keras_float64, build):
    fn, args = build()
    reg = assert_matches_loop(fn, args, rtol=1e-10)
    assert reg.generic_variables, reg.summary()
    report = kg.verify(fn, *args, estimation_mode="exact")
    assert report.passed, report.table()
    losses = _kfac_runs(fn, args)
    assert losses[-1] < losses[0], losses


def _siamese():
    """keras.io's siamese network with a contrastive loss (its
    BatchNormalization left out: in training mode it couples the examples)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(1)
    inp = keras.Input((5, 5, 1))
    h = L.Flatten()(L.AveragePooling2D(2)(L.Conv2D(2, 3, activation="tanh")(inp)))
    embedding = keras.Model(inp, L.Dense(3, activation="tanh")(h))
    a, b = keras.Input((5, 5, 1)), keras.Input((5, 5, 1))
    distance = L.Lambda(lambda v: keras.ops.sqrt(keras.ops.maximum(keras.ops.sum(
        keras.ops.square(v[0] - v[1]), axis=1, keepdims=True), 1e-7)))([embedding(a), embedding(b)])
    model = keras.Model([a, b], L.Dense(1, activation="sigmoid")(distance))

    @kg.auto_register
    def loss_fn(x1, x2, y):
        pred = model([x1, x2])
        return keras.ops.mean((1 - y) * keras.ops.square(pred)
                              + y * keras.ops.square(keras.ops.maximum(1.0 - pred, 0)))
    args = (tf.constant(rng.normal(size=(B, 5, 5, 1))), tf.constant(rng.normal(size=(B, 5, 5, 1))),
            tf.constant(rng.integers(0, 2, (B, 1)).astype("float64")))
    return loss_fn, args


@pytest.mark.slow
def test_a_siamese_network_shares_its_encoder(keras_float64):
    fn, args = _siamese()
    reg = assert_matches_loop(fn, args, rtol=1e-10)
    assert [layer.uses for layer in reg.layers] == [2, 2, 1] and not reg.generic_variables
    assert not reg.coupling
    assert kg.verify(fn, *args, estimation_mode="exact").passed
    losses = _kfac_runs(fn, args)
    assert losses[-1] < losses[0], losses
    _dp_runs(fn, args)


def test_triplet_loss_with_in_batch_hardest_negatives_couples(keras_float64):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(2)
    embed = keras.Sequential([keras.Input((4,)), L.Dense(6, activation="relu"), L.Dense(3)])

    @kg.auto_register
    def loss_fn(x, labels):
        e = tf.math.l2_normalize(embed(x), axis=1)
        sq = tf.reduce_sum(tf.square(e), 1)
        d = tf.maximum(sq[:, None] - 2.0 * e @ tf.transpose(e) + sq[None, :], 0.0)
        same = tf.cast(tf.equal(labels[:, None], labels[None, :]), d.dtype)
        positive = tf.reduce_max(d * (same - tf.eye(6, dtype=d.dtype)), 1)
        negative = tf.reduce_min(d + tf.reduce_max(d, 1, keepdims=True) * same, 1)
        return tf.reduce_mean(tf.maximum(positive - negative + 0.5, 0.0))
    args = (tf.constant(rng.normal(size=(6, 4))), tf.constant([0, 0, 1, 1, 2, 2]))
    reg = loss_fn.registration(*args)
    assert reg.coupling, reg.summary()
    _batch_mean_matches(loss_fn, args, reg)
    with pytest.raises(kg.KfacGraphError, match="couples the examples"):
        kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=0.5).step(*args)


@pytest.mark.slow  # a recipe's model; the recipes' one-line cases stay fast
def test_a_weight_held_in_a_non_trainable_variable_is_read_when_the_loss_runs(keras_float64):
    """A KL weight annealed by a callback (``beta * kl`` beside the
    likelihood) and a distillation's ``T**2`` held in non-trainable
    variables are weights read at run time, as an argument is: per-example
    gradients equal the loop after the variable changes (no new trace), and
    the ``T**2`` loss trains as with a Python constant. Before, both were
    refused ("multiplies two non-constant tensors, one read from a
    variable")."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    dense, head = L.Dense(5, activation="tanh"), L.Dense(3)
    beta = tf.Variable(0.5, trainable=False, dtype=tf.float64)

    @kg.auto_register
    def annealed(x, y):
        h = dense(x)
        ce = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, head(h)))
        return ce + beta * tf.reduce_mean(tf.reduce_sum(h ** 2, 1))
    args = (tf.constant(rng.normal(size=(B, 4))), tf.constant(rng.integers(0, 3, B)))
    for value in (0.5, 2.0):
        beta.assign(value)
        reg = assert_matches_loop(annealed, args, rtol=1e-10)
    assert [layer.kind for layer in reg.layers] == ["dense", "dense"], reg.summary()
    opt = kg.KFAC(annealed)
    for k in range(4):
        beta.assign(0.25 * k)
        opt.step(*args)
    assert int(opt.skipped_steps) == 0
    _dp_runs(annealed, args)

    runs = []
    for held in ("constant", "variable"):
        fn, args, student = _distillation("frozen")
        square = tf.Variable(9.0, trainable=False, dtype=tf.float64)
        scaled = kg.auto_register(lambda x, y: (fn(x, y) * (square if held == "variable"
                                                            else 9.0)))
        assert_matches_loop(scaled, args, rtol=1e-10)
        runs.append(_kfac_runs(scaled, args))
    np.testing.assert_allclose(runs[0], runs[1], rtol=1e-12)
