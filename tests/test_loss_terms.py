"""Terms a loss adds beside the likelihood's (`passes/loss_terms.py`).

A weight penalty (Keras's `kernel_regularizer` and `bias_regularizer`, or
`lambda * sum(W^2)` written out) reads no example: example i's gradient,
the gradient of the loss on example i alone, holds its gradient, and DP-SGD
adds it once, neither clipped nor noised. A data-dependent term reduced
over the examples as the likelihood is (Keras's `activity_regularizer`, a
VAE's KL term) is part of each example's own loss, and its curvature joins
the likelihood's where it has an output of its own (``tests/
test_joined_outputs.py``); two likelihoods (two outputs' losses) are
joined, and make the loss opaque where they cannot be (too many values
per example). Each
is checked against a loop of one-example tapes in float64; before these,
the penalty was silently left out of every per-example gradient and of
DP-SGD's update, and the other terms were refused.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from passes.errors import LossNotFoundError
from per_example_reference import assert_matches_loop, one_example_loop

B = 6


@pytest.fixture
def float64():
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")


def _regularised_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(7, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.1),
                           bias_regularizer=keras.regularizers.L1(0.05),
                           bias_initializer="glorot_uniform",
                           activity_regularizer=keras.regularizers.L1(0.01))(inputs)
    h = keras.layers.LayerNormalization(gamma_regularizer="l2")(h)
    outputs = keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L1L2(0.01, 0.02))(h)
    return keras.Model(inputs, outputs)


def _data(seed=1):
    rng = np.random.default_rng(seed)
    return tf.constant(rng.normal(size=(B, 5))), tf.constant(rng.integers(0, 3, B))


def _keras_loss(model):
    @kg.auto_register
    def loss(x, y):
        logits = model(x, training=True)
        ce = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        return tf.reduce_mean(ce) + tf.add_n(model.losses)
    return loss


def test_keras_regularisers_are_in_each_examples_gradient(float64):
    model = _regularised_model()
    loss, args = _keras_loss(model), _data()
    reg = assert_matches_loop(loss, args, rtol=1e-10)
    assert not reg.generic_variables
    # the activity regulariser, |tanh(a)| of the hidden layer's own output a,
    # is curved there: its Hessian joins the cross-entropy's
    assert reg.loss.kind == "ggn" and len(reg.loss.penalties) == 4
    assert len(reg.per_example_extras) == 1
    summary = reg.summary()
    assert "penalties" in summary and "per-example terms added" in summary
    want = one_example_loop(loss, args, reg.variables)
    norms = np.sqrt(sum(np.sum(np.reshape(w, [B, -1]) ** 2, 1) for w in want))
    np.testing.assert_allclose(kg.per_example_gradient_norms(loss, *args), norms, rtol=1e-10)
    # the penalties matter: the likelihood's gradient alone is far from the loop's mean
    x, y = args
    with tf.GradientTape() as tape:
        ce = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            y, model(x, training=True), from_logits=True))
    kernel = reg.variables[0]
    assert np.abs(tape.gradient(ce, kernel) - tf.reduce_mean(want[0], 0)).max() > 1e-2


@pytest.mark.parametrize("where", ["reduced", "each_term"])
def test_a_written_out_penalty_on_a_sum_loss_and_a_generic_variable(where):
    """On the reduced loss, or in every example's term (and so ``B`` times in
    the batch's sum, once in each example's loss)."""
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(4, 2)), name="w")
    t = tf.Variable(rng.normal(size=(2,)), name="temperature")

    @kg.auto_register
    def loss(x, y):
        z = (x @ w) * tf.sin(t)  # sin(t): no layer pattern, a generic variable
        penalty = 0.3 * tf.reduce_sum(tf.square(w)) + 0.2 * tf.reduce_sum(tf.cos(t))
        if where == "each_term":
            return tf.reduce_sum(tf.reduce_sum(tf.square(z - y), axis=1) + penalty)
        return tf.reduce_sum(tf.square(z - y)) + penalty

    args = (tf.constant(rng.normal(size=(B, 4))), tf.constant(rng.normal(size=(B, 2))))
    reg = assert_matches_loop(loss, args, rtol=1e-10)
    assert reg.loss.reduction == "sum" and len(reg.loss.penalties) == 1
    assert len(reg.loss.summed_penalties) == (where == "each_term")
    # in every term, the penalty meets the data: its kernel is generic too (test_weight_paths)
    generic = {"reduced": ["temperature:0"], "each_term": ["w:0", "temperature:0"]}[where]
    assert [v.name for v in reg.generic_variables] == generic


def _vae(latent=2, pixels=12):
    """The Keras VAE example's loss: a Bernoulli reconstruction summed over
    the pixels and averaged over the batch, plus the mean KL term; the noise
    is an argument so that one-example tapes see the same draw."""
    keras.utils.set_random_seed(0)
    encoder = keras.Sequential([keras.layers.Dense(8, activation="relu"),
                                keras.layers.Dense(2 * latent)])
    decoder = keras.Sequential([keras.layers.Dense(8, activation="relu"),
                                keras.layers.Dense(pixels)])

    @kg.auto_register
    def loss(images, noise):
        stats = encoder(images)
        mean, log_var = stats[:, :latent], stats[:, latent:]
        z = mean + tf.exp(0.5 * log_var) * noise
        logits = decoder(z)
        reconstruction = tf.reduce_mean(tf.reduce_sum(
            tf.nn.sigmoid_cross_entropy_with_logits(labels=images, logits=logits), axis=1))
        kl = -0.5 * (1 + log_var - tf.square(mean) - tf.exp(log_var))
        return reconstruction + tf.reduce_mean(tf.reduce_sum(kl, axis=1))

    rng = np.random.default_rng(3)
    images = tf.constant((rng.uniform(size=(B, pixels)) > 0.5).astype("float64"))
    return loss, (images, tf.constant(rng.normal(size=(B, latent))))


def test_a_vae_reads_its_kl_term_beside_the_likelihood(float64):
    loss, args = _vae()
    reg = assert_matches_loop(loss, args, rtol=1e-10)
    # the KL term's curvature joins the reconstruction's (test_joined_vae)
    assert reg.loss.kind == "ggn" and len(reg.per_example_extras) == 1
    assert not reg.generic_variables and not reg.coupling
    opt = kg.KFAC(loss)
    losses = [float(opt.step(*args)) for _ in range(15)]
    assert losses[-1] < losses[0] and np.all(np.isfinite(losses))


@pytest.mark.parametrize("method", ["reweight", "materialize"])
def test_dp_adds_the_penalty_unclipped(float64, method):
    model = _regularised_model()
    loss, args = _keras_loss(model), _data()
    reg = loss.registration(*args)
    variables = list(reg.variables)
    with tf.GradientTape() as tape:
        full = loss.tf_function(*args)
    batch_gradient = tape.gradient(full, variables)
    # no clipping, no noise: the batch gradient itself
    got = kg.dp_gradients(loss, *args, l2_norm_clip=1e6, noise_multiplier=0.0, method=method)
    for v, g, w in zip(variables, got, batch_gradient):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=v.name)
    # clipped: each example's own terms clipped, then the penalty's gradient as it is
    with tf.GradientTape() as tape:
        penalty = tf.add_n([getattr(layer, f"{name}_regularizer")(getattr(layer, name))
                            for layer in model.layers for name in ("kernel", "bias", "gamma")
                            if getattr(layer, f"{name}_regularizer", None)])
    dr = [tf.zeros_like(v) if d is None else d for v, d in
          zip(variables, tape.gradient(penalty, variables))]
    own = [p - d[None] for p, d in zip(kg.per_example_gradients(loss, *args), dr)]
    norms = np.sqrt(sum(np.sum(np.reshape(o, [B, -1]) ** 2, 1) for o in own))
    clip = 0.5 * float(np.median(norms))
    scale = np.minimum(1.0, clip / norms)
    got = kg.dp_gradients(loss, *args, l2_norm_clip=clip, noise_multiplier=0.0, method=method)
    for v, g, o, d in zip(variables, got, own, dr):
        want = np.tensordot(scale, o, axes=1) / B + d
        np.testing.assert_allclose(g, want, rtol=1e-9, atol=1e-12, err_msg=v.name)


def test_terms_the_pass_cannot_give_each_example_are_refused_in_one_line():
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(4, 3)))
    x, y = tf.constant(rng.normal(size=(B, 4))), tf.constant(rng.integers(0, 3, B))

    def register(fn):
        return kg.auto_register(fn).registration(x, y)

    ce = lambda z: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, z))
    with pytest.raises(LossNotFoundError, match="reduced over the examples by a sum") as e:
        register(lambda x, y: ce(x @ w) + tf.reduce_sum(tf.abs(x @ w)))
    assert "\n" not in str(e.value)
    # a term of the batch's statistics is read, and flagged as coupling the examples
    z = lambda x: x @ w
    reg = register(lambda x, y: ce(z(x)) + tf.reduce_mean(
        tf.square(z(x) - tf.reduce_mean(z(x), axis=0))))
    assert reg.coupling and len(reg.per_example_extras) == 1


def _detector(seed=0, anchors=3, classes=3):
    """A one-stage detector's head: class logits and box offsets per anchor,
    a focal loss on every anchor and a smooth L1 loss on the positive ones."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh")(inputs)
    model = keras.Model(inputs, [
        keras.layers.Reshape((anchors, classes))(keras.layers.Dense(anchors * classes)(h)),
        keras.layers.Reshape((anchors, 4))(keras.layers.Dense(anchors * 4)(h))])

    def terms(x, labels, boxes):
        logits, offsets = model(x)
        onehot = tf.one_hot(labels, classes, dtype=logits.dtype)
        p = tf.sigmoid(logits)
        pt = onehot * p + (1 - onehot) * (1 - p)
        focal = tf.reduce_sum((1 - pt) ** 2 * tf.nn.sigmoid_cross_entropy_with_logits(
            onehot, logits), -1)
        diff = tf.abs(offsets - boxes)
        return focal, tf.reduce_sum(tf.where(diff < 1.0, 0.5 * diff ** 2, diff - 0.5), -1)

    rng = np.random.default_rng(seed + 1)
    args = (tf.constant(rng.normal(size=(B, 4))),
            tf.constant(rng.integers(0, classes, (B, anchors))),
            tf.constant(rng.normal(size=(B, anchors, 4))),
            tf.constant((rng.uniform(size=(B, anchors)) > 0.5).astype("float64")))
    return terms, args


def test_a_term_weighted_by_data_beside_another(float64):
    """The box term is masked to the positive anchors, each term a mean over
    the examples: both outputs' curvature, exact per-example gradients."""
    terms, args = _detector()

    @kg.auto_register
    def loss(x, labels, boxes, positive):
        focal, box = terms(x, labels, boxes)
        return tf.reduce_mean(focal) + tf.reduce_mean(tf.reduce_sum(box * positive, -1))

    reg = assert_matches_loop(loss, args, rtol=1e-10)
    assert reg.loss.kind == "ggn" and len(reg.per_example_extras) == 1, reg.loss


@pytest.mark.slow
def test_terms_divided_by_a_count_of_the_batch(float64):
    """Both terms summed over the batch and divided by its count of positive
    anchors (a RetinaNet's normaliser): a sum over the examples, example i's
    own loss its share, read at run time as dL/de_i . e_i. Before, the pass
    refused the sum under the division ("adds a weighted term beside the
    loss's first")."""
    terms, args = _detector()

    @kg.auto_register
    def loss(x, labels, boxes, positive):
        focal, box = terms(x, labels, boxes)
        count = tf.maximum(tf.reduce_sum(positive), 1.0)
        return (tf.reduce_sum(focal) + tf.reduce_sum(box * positive)) / count

    reg = loss.registration(*args)
    assert (reg.loss.kind, reg.loss.reduction) == ("ggn", "sum") and reg.loss.divisors
    focal, box = terms(*args[:3])
    own = (tf.reduce_sum(focal, -1) + tf.reduce_sum(box * args[3], -1)) / tf.reduce_sum(
        args[3])
    from kfac_graph.taps import LayerTaps
    got = tf.function(lambda *a: LayerTaps.build(reg, a).per_example_loss)(*args)
    np.testing.assert_allclose(got, own, rtol=1e-12)
    report = kg.verify(loss, *args, examples=2, directions=1, estimation_mode="exact")
    assert not report.failures, report
    opt = kg.KFAC(loss)
    losses = [float(opt.step(*args)) for _ in range(3)]
    assert int(opt.skipped_steps) == 0 and losses[-1] < losses[0], losses


def test_two_likelihoods_the_pass_cannot_join_are_opaque_with_exact_per_example_gradients():
    """A class head and a regression head that read the same 300 values per
    example: their Hessian there is not formed (300 passes) and no
    likelihood's Fisher alone is it, so there is no one distribution."""
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(4, 300)))

    @kg.auto_register
    def loss(x, y, t):
        h = tf.tanh(x @ w)
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(y, h)
        return tf.reduce_mean(ce) + 0.5 * tf.reduce_mean(tf.square(h - t))

    args = (tf.constant(rng.normal(size=(B, 4))), tf.constant(rng.integers(0, 300, B)),
            tf.constant(rng.normal(size=(B, 300))))
    reg = assert_matches_loop(loss, args, rtol=1e-10)
    assert reg.loss.kind == "opaque" and "2 are likelihoods" in reg.loss.reason
    assert "300 values per example" in reg.loss.reason
    with pytest.raises(Exception, match="2 are likelihoods") as e:
        kg.KFAC(loss).step(*args)
    assert "\n" not in str(e.value)
    opt = kg.KFAC(loss, estimation_mode="empirical", momentum_type="regular")
    losses = [float(opt.step(*args)) for _ in range(5)]
    assert losses[-1] < losses[0]


def _two_output_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    return keras.Model(inputs, [keras.layers.Dense(3, name="label")(h),
                                keras.layers.Dense(2, name="value")(h)])


@pytest.mark.slow
def test_keras_fit_takes_a_loss_per_output():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 5)).astype("float32")
    labels, values = rng.integers(0, 3, 32), rng.normal(size=(32, 2)).astype("float32")
    losses = {"label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              "value": "mse"}
    model = _two_output_model()
    kmodel = kg.KFACModel(model, loss=losses, estimation_mode="empirical",
                          momentum_type="regular", learning_rate=0.05)
    kmodel.compile()
    targets = {"label": labels, "value": values}
    before = float(kmodel.evaluate(x, targets, verbose=0)[0])  # [total, per output...]
    # the registered loss is Keras's own sum of the outputs' losses
    value = kmodel.loss_fn.tf_function(tf.constant(x), {k: tf.constant(v)
                                                        for k, v in targets.items()})
    np.testing.assert_allclose(float(value), before, rtol=1e-5)
    history = kmodel.fit(x, targets, batch_size=16, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    # the default sampled Fisher: the outputs joined (tests/test_joined_outputs.py)
    sampled = kg.KFACModel(_two_output_model(), loss=list(losses.values()))
    sampled.compile()
    assert np.isfinite(sampled.fit(x, (labels, values), batch_size=16, epochs=1,
                                   verbose=0).history["loss"]).all()
    dp = kg.DPModel(_two_output_model(), loss=losses, l2_norm_clip=1.0, noise_multiplier=0.5,
                    num_examples=32, batch_size=16)
    dp.compile(optimizer=keras.optimizers.SGD(0.1))
    assert np.isfinite(dp.fit(x, targets, epochs=2, verbose=0).history["loss"]).all()
