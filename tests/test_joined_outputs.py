"""A loss over several outputs (a model with two heads, each with its loss)
gets the Gauss-Newton curvature of all of them.

The pass finds one output per term (a likelihood's logits, or a Huber
term's output, ``passes/loss_output.py``), checks that together they cut
the variables from the loss, and joins them into one ``[B, N]`` tensor the
heads read through (``passes/joined_outputs.py``). One output may feed
another: a VAE's encoder output ``[mu, log var]`` is read by the KL term
and, through the sampled code, by the decoder, whose logits the
reconstruction term reads. The curvature is the Hessian of each example's summed
loss over the joined output: checked against a brute-force ``J^T H J`` from
GradientTape Jacobians and Hessians. Before, such a loss was opaque (the
empirical Fisher only) or, beside one likelihood, the other head's layers
got no curvature at all (a VAE's KL term: its encoder blocks were the
reconstruction's alone, and K-FAC's default steps jumped from a loss of 5.3
to 17).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from joined_reference import assert_joined_blocks, block, brute_blocks, brute_group_blocks
from per_example_reference import assert_matches_loop

B, D = 6, 4


@pytest.fixture
def float64():
    keras.config.set_floatx("float64")  # (conftest restores both)
    keras.config.set_dtype_policy("float64")


def _two_heads(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((D,))
    h = keras.layers.Dense(5, activation="tanh", name="trunk")(inputs)
    return keras.Model(inputs, [keras.layers.Dense(3, name="label")(h),
                                keras.layers.Dense(2, name="value")(h)])


def _data(seed=1):
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.normal(size=(B, D))), tf.constant(rng.integers(0, 3, B)),
            tf.constant(rng.normal(size=(B, 2))))


def _sum_of_heads(model, second):
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def one(x, y, t):
        a, b = model(x)
        return sce(y, a) + 0.5 * second(t, b)
    return one


def _head_loss(second):
    """The summed loss as a function of the two outputs."""
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return lambda zs, x, y, t: sce(y, zs[0]) + 0.5 * second(t, zs[1])


def test_two_heads_are_joined_and_their_blocks_are_brute_force(float64):
    for second in (keras.losses.MeanSquaredError(), keras.losses.Huber()):
        model, args = _two_heads(), _data()
        fn = kg.auto_register(_sum_of_heads(model, second))
        reg = assert_matches_loop(fn, args, rtol=1e-10)
        assert (reg.loss.kind, reg.loss.output) == ("ggn", "kfac_joined_outputs:0")
        est = kg.FisherEstimator(fn, estimation_mode="exact", cov_ema_decay=0.0,
                                 approximations={"dense": "full"})
        est.update(*args)
        names = ("trunk", "value")  # both blocks from one brute-force pass
        wants = brute_blocks([model.get_layer(n) for n in names], lambda x, y, t: model(x),
                             _head_loss(second), args)
        for name, want in zip(names, wants):
            np.testing.assert_allclose(block(reg, est, name), want, rtol=1e-8,
                                       atol=1e-12)
        assert kg.verify(fn, *args, estimation_mode="exact").passed


@pytest.mark.slow  # fit on joined outputs: the brute-force tests in the fast set
def test_keras_fit_with_a_loss_per_output_trains_with_the_defaults():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, D)).astype("float32")
    labels = np.argmax(x @ rng.normal(size=(D, 3)), axis=1)
    values = (x @ rng.normal(size=(D, 2))).astype("float32")
    kmodel = kg.KFACModel(_two_heads(), loss={
        "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "value": "huber"})
    kmodel.compile()
    history = kmodel.fit(x, {"label": labels, "value": values}, batch_size=16, epochs=5,
                         verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses


@pytest.mark.slow  # fit on joined outputs: the brute-force tests above in the fast set
def test_keras_fit_with_sample_weights_per_output(float64):
    """``fit(..., sample_weight={"label": w1, "value": w2})``: each output's
    loss takes its own weights (before, KFACModel refused sample weights
    with a loss per output). The registered loss's per-example gradients
    equal one-example tapes; a value head weighted zero everywhere gets no
    gradient."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, D))
    labels, values = rng.integers(0, 3, 32), rng.normal(size=(32, 2))
    weights = {"label": rng.uniform(size=32), "value": (rng.uniform(size=32) > 0.4) * 1.0}
    kmodel = kg.KFACModel(_two_heads(), loss={
        "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "value": keras.losses.Huber()}, momentum_type="regular", learning_rate=0.1)
    kmodel.compile()
    losses = kmodel.fit(x, {"label": labels, "value": values}, sample_weight=weights,
                        batch_size=8, epochs=4, verbose=0).history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    args = (tf.constant(x[:B]), {"label": tf.constant(labels[:B]),
                                 "value": tf.constant(values[:B])},
            {k: tf.constant(w[:B]) for k, w in weights.items()})
    reg = assert_matches_loop(kmodel.loss_fn, args, rtol=1e-10)
    assert reg.loss.kind == "ggn" and reg.loss.weighted, reg.loss
    zero = (*args[:2], {"label": args[2]["label"], "value": tf.zeros(B, tf.float64)})
    grads = kg.per_example_gradients(kmodel.loss_fn, *zero)
    head = kmodel.model.get_layer("value").kernel
    index = next(k for k, v in enumerate(reg.variables) if v is head.value or v is head)
    assert not np.any(grads[index]) and np.any(grads[0])


def _rawblock(reg, est, variable):
    return next(b for layer, b in zip(reg.layers, est.blocks)
                if any(v is variable for v in layer.variables)).full_matrix().numpy()


def test_an_output_that_feeds_another_is_joined(float64):
    """Class logits that are also the regression head's input: the
    cross-entropy's head reads the joined output, the regression layer the
    logits themselves. Before, the loss was opaque ("feeds another")."""
    rng = np.random.default_rng(0)
    w, v = tf.Variable(rng.normal(size=(D, 3))), tf.Variable(rng.normal(size=(3, 2)))
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def outputs(x, y, t):
        h = tf.tanh(x @ w)
        return [h, h @ v]

    def on_outputs(zs, x, y, t):
        return sce(y, zs[0]) + 0.5 * tf.reduce_mean(tf.square(zs[1] - t))

    fn = kg.auto_register(lambda x, y, t: on_outputs(outputs(x, y, t), x, y, t))
    args = _data()
    reg = assert_matches_loop(fn, args, rtol=1e-10)
    assert (reg.loss.kind, reg.loss.output) == ("ggn", "kfac_joined_outputs:0"), reg.loss
    est = kg.FisherEstimator(fn, estimation_mode="exact", cov_ema_decay=0.0,
                             approximations={"dense": "full"})
    est.update(*args)
    for variable, want in zip((w, v), brute_group_blocks([[w], [v]], outputs, on_outputs,
                                                         args)):
        np.testing.assert_allclose(_rawblock(reg, est, variable), want, rtol=1e-8, atol=1e-12)


def test_a_gaussian_with_a_predicted_scale_is_joined(float64):
    """``log s + ((y - mu) / s)^2 / 2``, ``s = softplus(o_1)``, ``mu = o_0``:
    the squared term reads as a normal likelihood of ``(y - mu) / s``,
    whose divisor ``s`` the log term's head reads too. Before the copies
    read the output ``(y - mu) / s`` itself, the run stopped on a cycle."""
    model = keras.Sequential([keras.Input((D,)),
                              keras.layers.Dense(5, activation="tanh", name="hidden"),
                              keras.layers.Dense(2, name="out")])

    def scaled(o, t):
        return (t[:, 0] - o[:, 0]) / (tf.nn.softplus(o[:, 1]) + 1e-3)

    def outputs(x, y, t):
        o = model(x)
        return [scaled(o, t), o]

    def on_outputs(zs, x, y, t):
        return tf.reduce_mean(tf.math.log(tf.nn.softplus(zs[1][:, 1]) + 1e-3)
                              + 0.5 * tf.square(zs[0]))

    @kg.auto_register
    def fn(x, y, t):  # one scale, read by both terms
        o = model(x)
        s = tf.nn.softplus(o[:, 1]) + 1e-3
        return tf.reduce_mean(tf.math.log(s) + 0.5 * tf.square((t[:, 0] - o[:, 0]) / s))

    args = _data()
    reg = assert_matches_loop(fn, args, rtol=1e-10)
    assert (reg.loss.kind, reg.loss.output) == ("ggn", "kfac_joined_outputs:0"), reg.loss
    est = kg.FisherEstimator(fn, estimation_mode="exact", cov_ema_decay=0.0,
                             approximations={"dense": "full"})
    est.update(*args)
    for layer, want in zip(model.layers, brute_blocks(model.layers, outputs, on_outputs, args)):
        np.testing.assert_allclose(block(reg, est, layer.name), want, rtol=1e-8, atol=1e-12)
    opt = kg.KFAC(fn)
    losses = [float(opt.step(*args)) for _ in range(6)]
    assert int(opt.skipped_steps) == 0 and losses[-1] < losses[0], losses


def _two_layer_gaussian(seed=0):
    """A heteroscedastic regression: the mean and the log variance each from
    a layer of its own, so no one output dominates the loss."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((D,))
    h = keras.layers.Dense(5, activation="tanh", name="trunk")(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(1, name="mean")(h),
                                 keras.layers.Dense(1, name="log_var")(h)])

    def on_outputs(zs, x, y, t):
        mean, log_var = zs
        return tf.reduce_mean(0.5 * log_var + 0.5 * tf.square(t[:, :1] - mean)
                              / tf.exp(log_var))
    return model, on_outputs


def test_outputs_of_two_layers_are_joined(float64):
    """Before: opaque ("no single model output feeds the loss")."""
    model, on_outputs = _two_layer_gaussian()
    fn = kg.auto_register(lambda x, y, t: on_outputs(model(x), x, y, t))
    args = _data()
    reg = assert_matches_loop(fn, args, rtol=1e-10)
    assert (reg.loss.kind, reg.loss.output) == ("ggn", "kfac_joined_outputs:0"), reg.loss
    est = kg.FisherEstimator(fn, estimation_mode="exact", cov_ema_decay=0.0,
                             approximations={"dense": "full"})
    est.update(*args)
    names = ("trunk", "mean", "log_var")  # the three blocks from one brute-force pass
    wants = brute_blocks([model.get_layer(n) for n in names], lambda x, y, t: model(x),
                         on_outputs, args)
    for name, want in zip(names, wants):
        np.testing.assert_allclose(block(reg, est, name), want, rtol=1e-8, atol=1e-12)


def test_a_loss_that_falls_below_zero_is_not_capped_at_zero(float64):
    """The quadratic model's cap shortens a step that promises more than the
    whole loss, which a likelihood of the pass's kinds cannot lose; a
    Gaussian with a learned variance can go below zero. Before, its steps
    were held at a loss of exactly 0.0 (3 of the first 12)."""
    model, on_outputs = _two_layer_gaussian()
    fn = kg.auto_register(lambda x, y, t: on_outputs(model(x), x, y, t))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, D))
    t = np.sin(x[:, :2]) + 0.3 * rng.normal(size=(64, 2))
    args = (tf.constant(x), tf.zeros(64, tf.int64), tf.constant(t))
    opt = kg.KFAC(fn)
    losses = [float(opt.step(*args)) for _ in range(12)]
    assert sum(abs(v) < 1e-3 for v in losses) <= 1 and min(losses) < -0.5, losses


@pytest.mark.slow
def test_kfac_under_xla_trains_two_heads():
    """The joined output is split again by a SplitV, whose gradients XLA
    differentiates twice (a Slice's XLA gradient has no gradient)."""
    rng = np.random.default_rng(2)
    x = tf.constant(rng.normal(size=(32, D)), tf.float32)
    y = tf.constant(np.argmax(x.numpy() @ rng.normal(size=(D, 3)), axis=1))
    t = tf.constant(x.numpy() @ rng.normal(size=(D, 2)), tf.float32)
    fn = kg.auto_register(_sum_of_heads(_two_heads(), keras.losses.Huber()))
    opt = kg.KFAC(fn, jit_compile=True)
    losses = [float(opt.step(x, y, t)) for _ in range(8)]
    assert int(opt.skipped_steps) == 0 and losses[-1] < 0.5 * losses[0], losses



def test_a_per_token_head_beside_a_per_example_head_is_joined(float64):
    """A masked-LM head over ``[B, T, V]`` plus a next-sentence head over
    ``[B, 2]`` (BERT's pre-training loss) joins two outputs whose Hessian
    needs each example's own loss. The per-token head's terms come flattened
    to ``[B T]``, which the joined output ``[B, N]`` does not lay out by
    example: ``kg.KFAC`` stopped on "the per-example loss terms ... have
    leading axis 15" (the empirical Fisher on TensorFlow's "None values not
    supported"). Each terms tensor is now laid out by its own head's output
    (``Registration.term_outputs``): per-example gradients equal a loop of
    one-example tapes, the exact blocks the brute-force Gauss-Newton ones,
    and the defaults train."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((None,), dtype="int32")
    h = keras.layers.Dense(6, activation="tanh", name="trunk")(
        keras.layers.Embedding(7, 4)(ids))
    model = keras.Model(ids, [keras.layers.Dense(7, name="tokens")(h),
                              keras.layers.Dense(2, name="pair")(h[:, 0])])
    ce = tf.nn.sparse_softmax_cross_entropy_with_logits

    def on_outputs(zs, x, y):
        return tf.reduce_mean(ce(y, zs[0])) + tf.reduce_mean(ce(y[:, 0] % 2, zs[1]))

    loss = kg.auto_register(lambda x, y: on_outputs(model(x), x, y))
    rng = np.random.default_rng(0)
    args = tuple(tf.constant(rng.integers(0, 7, (3, 5)), tf.int32) for _ in range(2))
    assert_joined_blocks(loss, args, [model.get_layer(n) for n in ("trunk", "tokens", "pair")],
                         lambda x, y: model(x), on_outputs)
    opt = kg.KFAC(loss)
    losses = [float(opt.step(*args)) for _ in range(5)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses
    empirical = kg.KFAC(loss, estimation_mode="empirical", momentum_type="regular",
                        learning_rate=0.1, damping=0.1)
    assert np.isfinite(float(empirical.step(*args)))


def test_three_heads_added_in_turn_are_all_joined(float64):
    """``a + b + c`` adds in turn, ``(a + b) + c``: the inner sum's heads are
    the outer one's too. Before, the two classifiers' sum was one opaque
    term beside the regression's likelihood, so the loss read as that
    likelihood alone and the classifiers' layers got no curvature."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((D,))
    h = keras.layers.Dense(5, activation="tanh", name="trunk")(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(3, name="label")(h),
                                 keras.layers.Dense(2, name="parity")(h),
                                 keras.layers.Dense(1, name="value")(h)])
    ce = tf.nn.sparse_softmax_cross_entropy_with_logits

    def heads(zs, x, y, t):
        return (tf.reduce_mean(ce(y, zs[0])) + tf.reduce_mean(ce(y % 2, zs[1]))
                + tf.reduce_mean(tf.square(zs[2][:, 0] - t[:, 0])))
    fn = kg.auto_register(lambda x, y, t: heads(model(x), x, y, t))
    reg = assert_joined_blocks(fn, _data(), [model.get_layer(n) for n in (
        "trunk", "label", "parity", "value")], lambda x, y, t: model(x), heads)
    assert len(reg.per_example_extras) == 2, reg.summary()
