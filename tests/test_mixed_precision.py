"""Mixed precision (Keras policies "mixed_bfloat16" and "mixed_float16"):
float32 variables, each read cast to the 16-bit compute dtype before the op.
The pass sees through the Cast (passes/canonicalize.py: any Cast but one
from a float to an integer or bool, which cuts the gradient); the
runtime casts each layer's 16-bit operands to the variables' dtype
(taps.in_variable_dtype), so per-example gradients, factors, inverses and
preconditioning are float32.

How the per-example gradients are checked, soundly:

1. The mechanics, tightly: float64 variables read and cast to float32 for
   every op (dense, Conv1D, depthwise, scale and shift). The same casts as
   under a Keras mixed policy, but the compute dtype's rounding is float32's,
   so the per-example gradients (float64) must equal a loop of one-example
   gradients at rtol 1e-5: no structural error (a wrong layout, a dropped
   cast, a factor) can hide behind a 16-bit tolerance.
2. The 16-bit policies against the truth: the same Keras model built in
   float64 with the same weights gives, by a one-example loop, the exact
   per-example gradients of the float32 variables' values. The 16-bit
   forward and backward passes put an error of a few units of roundoff
   ``u`` (bfloat16 2^-8, float16 2^-11) on each example's gradient. We
   require ours to be within 16 u of the truth, and no worse than TF's own
   one-example gradient of the mixed model (the loop) plus u: ours reads the
   same 16-bit activations and output gradients and contracts them in
   float32, where the batch gradient contracts in 16 bits. The examples'
   gradients differ from each other by O(1) (relative), far above these
   tolerances, so a mix-up of examples fails.

A static loss scale (``loss * 1024``, what a LossScaleOptimizer does) is read
as the loss's ``scale``: per-example gradients are those of the scaled loss
(1024 times the unscaled ones) and kg.KFAC's curvature is scaled with it.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from per_example_reference import assert_close, one_example_loop

UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
LENGTH, CHANNELS, VOCAB, BATCH = 8, 3, 10, 4
SCALE = 1024.0
KINDS = ["embedding", "conv2d", "depthwise_conv2d", "scale_and_shift", "scale_and_shift",
         "dense"]


@pytest.fixture
def restore_policy():
    """Restores Keras's global dtype policy after the test."""
    saved = keras.mixed_precision.dtype_policy()
    yield
    keras.mixed_precision.set_dtype_policy(saved)


def _data(dtype=tf.float32):
    """``(x, ids, y)``; x drawn in float32 (then cast: the same values in float64)."""
    x = tf.cast(tf.random.stateless_normal([BATCH, LENGTH, CHANNELS], seed=[1, 2]), dtype)
    ids = tf.random.stateless_uniform([BATCH, LENGTH], seed=[3, 4], maxval=VOCAB,
                                      dtype=tf.int32)
    return x, ids, tf.constant([0, 1, 2, 1])


def _keras(dtype=None, scale=1.0):
    """``(loss_fn, model)``: embedding + Conv1D + DepthwiseConv1D (multiplier
    2) + batch norm (inference) + layer norm + dense; ``dtype``: each layer's
    dtype policy (None: the global policy)."""
    keras.utils.set_random_seed(0)
    kw = {} if dtype is None else {"dtype": dtype}
    x = keras.Input((LENGTH, CHANNELS), dtype="float64" if dtype == "float64" else "float32")
    ids = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Add(**kw)([x, keras.layers.Embedding(VOCAB, CHANNELS, **kw)(ids)])
    h = keras.layers.Conv1D(4, 3, padding="same", activation="tanh", **kw)(h)
    h = keras.layers.DepthwiseConv1D(3, depth_multiplier=2, **kw)(h)
    h = keras.layers.BatchNormalization(**kw)(h, training=False)
    h = keras.layers.Activation("tanh", **kw)(keras.layers.LayerNormalization(**kw)(h))
    model = keras.Model([x, ids], keras.layers.Dense(3, **kw)(keras.layers.Flatten(**kw)(h)))

    @kg.auto_register
    def loss_fn(x, ids, y):
        logits = tf.cast(model([x, ids]), x.dtype)
        return scale * tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    return loss_fn, model


def _truth(model):
    """The exact per-example gradients at ``model``'s weights: the same model
    in float64, a one-example loop."""
    loss64, model64 = _keras("float64")
    for w, w64 in zip(model.weights, model64.weights):
        w64.assign(tf.cast(w, tf.float64))
    x, ids, y = _data(tf.float64)
    return one_example_loop(loss64, (x, ids, y), loss64.registration(x, ids, y).variables)


def _relative_errors(got, want):
    """Per example: |got_i - want_i| / |want_i|."""
    got, want = np.reshape(got, [BATCH, -1]), np.reshape(want, [BATCH, -1])
    return np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)


def _check_mixed(loss_fn, model, compute):
    args = _data()
    reg = loss_fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == KINDS
    assert all(tf.as_dtype(v.dtype) == tf.float32 for v in reg.variables)
    got = kg.per_example_gradients(loss_fn, *args)
    loop = one_example_loop(loss_fn, args, reg.variables)
    truth = _truth(model)
    u = UNIT_ROUNDOFF[compute]
    for v, g, mixed, exact in zip(reg.variables, got, loop, truth):
        assert g.dtype == tf.float32 and g.shape == (BATCH, *v.shape), v.name
        ours = _relative_errors(g.numpy(), exact.numpy())
        tf_own = _relative_errors(mixed.numpy(), exact.numpy())
        assert np.all(ours <= 16 * u), (v.name, ours)
        assert np.all(ours <= tf_own + u), (v.name, ours, tf_own)
        # the examples differ by far more than the tolerance
        assert np.min(_relative_errors(exact.numpy()[::-1], exact.numpy())) > 100 * u
    norms = kg.per_example_gradient_norms(loss_fn, *args).numpy()
    want = np.sqrt(sum(np.sum(np.reshape(g.numpy(), [BATCH, -1]) ** 2, 1) for g in got))
    assert_close(norms, want, 1e-5)
    report = kg.verify(loss_fn, *args)
    assert report.passed and compute in report.table(), report.table()


def test_mixed_bfloat16_layers():
    loss_fn, model = _keras("mixed_bfloat16")
    _check_mixed(loss_fn, model, "bfloat16")
    _kfac_trains(loss_fn, _data(), momentum_type="regular", damping=1e-2)


@pytest.mark.slow
def test_mixed_float16_global_policy(restore_policy):
    """kg.KFAC's defaults: the quadratic model's exact Fisher forms too."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    loss_fn, model = _keras()
    _check_mixed(loss_fn, model, "float16")
    _kfac_trains(loss_fn, _data())


def test_float32_compute_on_float64_variables_is_exact():
    """The casts of mixed precision with float32 rounding: rtol 1e-5."""
    rng = np.random.default_rng(0)
    var = lambda *shape: tf.Variable(rng.normal(size=shape) / np.sqrt(shape[0]))  # noqa: E731
    conv, conv_b = var(3, CHANNELS, 4), var(4)
    depthwise, gamma, beta = var(1, 3, 4, 2), var(8), var(8)
    dense, dense_b = var(LENGTH * 8, 3), var(3)
    f32 = lambda v: tf.cast(v, tf.float32)  # noqa: E731

    @kg.auto_register
    def loss_fn(x, y):
        h = tf.tanh(tf.nn.conv1d(x, f32(conv), 1, "SAME") + f32(conv_b))
        h = tf.nn.depthwise_conv2d(h[:, None], f32(depthwise), [1, 1, 1, 1], "SAME")[:, 0]
        h = tf.tanh(h * f32(gamma) + f32(beta))
        logits = tf.matmul(tf.reshape(h, [-1, LENGTH * 8]), f32(dense)) + f32(dense_b)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    x, _, y = _data()
    reg = loss_fn.registration(x, y)
    assert [layer.kind for layer in reg.layers] == [
        "conv2d", "depthwise_conv2d", "scale_and_shift", "dense"]
    got = kg.per_example_gradients(loss_fn, x, y)
    for v, g, w in zip(reg.variables, got, one_example_loop(loss_fn, (x, y), reg.variables)):
        assert g.dtype == tf.float64, v.name
        assert_close(g.numpy(), w.numpy(), 1e-5, v.name)


def test_a_cast_to_integers_is_not_seen_through():
    """A float -> int cast cuts the gradient: a kernel read through
    ``cast(cast(w, int32), float32)`` is no dense layer (generic, zero
    per-example gradients, as the loop), while the float -> float cast of the
    next layer is seen through."""
    w, v = tf.Variable(tf.ones([CHANNELS, 4]) * 1.7), tf.Variable(tf.ones([4, 3]) * 0.5)

    @kg.auto_register
    def loss_fn(x, y):
        h = tf.matmul(x[:, 0], tf.cast(tf.cast(w, tf.int32), tf.float32))
        logits = tf.matmul(tf.tanh(h), tf.cast(tf.cast(v, tf.float64), tf.float32))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    x, _, y = _data()
    reg = loss_fn.registration(x, y)
    assert [layer.kind for layer in reg.layers] == ["generic", "dense"]
    got = kg.per_example_gradients(loss_fn, x, y)
    for g, want in zip(got, one_example_loop(loss_fn, (x, y), reg.variables)):
        assert_close(g.numpy(), want.numpy(), 1e-5)
    assert not np.any(got[0].numpy())


def _kfac_trains(loss_fn, args, **options):
    opt = kg.KFAC(loss_fn, **options)
    losses = [float(opt.step(*args)) for _ in range(4)]
    assert all(np.isfinite(losses)) and int(opt.skipped_steps) == 0, losses
    assert losses[-1] < losses[0], losses
    for block in opt.estimator.blocks:
        assert block.dtype == tf.float32
        for factor in (getattr(block, "input_factor", None), getattr(block, "output_factor", None),
                       getattr(block, "factor", None)):
            if factor is not None:
                assert factor.value().dtype == tf.float32
        for name in ("input_inverse", "output_inverse"):
            cache = getattr(block, name, None)
            if cache is not None:
                assert cache.dtype == tf.float32
    reg = loss_fn.registration(*args)
    step = opt.precondition([tf.ones(v.shape, tf.float32) for v in reg.variables])
    assert all(s.dtype == tf.float32 and np.all(np.isfinite(s)) for s in step)
    assert all(tf.as_dtype(v.dtype) == tf.float32 for v in reg.variables)


def _scaled_pair(dtype=None):
    plain, plain_model = _keras(dtype)
    scaled, scaled_model = _keras(dtype, scale=SCALE)
    return plain, scaled, plain_model, scaled_model


def test_static_loss_scale_is_read_as_the_loss_scale():
    """``loss * 1024`` (a static loss scale): the same distribution with
    scale 1024; per-example gradients are the scaled loss's. A scale held in
    a non-trainable variable (a dynamic loss scale) is a weight read when the
    loss runs: the gradients follow its value without a new trace (it was
    refused in one line before)."""
    plain, scaled, _, scaled_model = _scaled_pair("float64")
    args = _data(tf.float64)
    reg, reg_scaled = plain.registration(*args), scaled.registration(*args)
    assert reg_scaled.loss.scale == SCALE * reg.loss.scale
    assert (reg_scaled.loss.kind, reg_scaled.loss.reduction) == (reg.loss.kind, reg.loss.reduction)
    assert [layer.kind for layer in reg_scaled.layers] == KINDS
    for g, g_scaled in zip(kg.per_example_gradients(plain, *args),
                           kg.per_example_gradients(scaled, *args)):
        assert_close(g_scaled.numpy(), SCALE * g.numpy(), 1e-12)
    dynamic = tf.Variable(SCALE, dtype=tf.float64, trainable=False)

    @kg.auto_register
    def loss_fn(x, ids, y):
        return dynamic * tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(y, scaled_model([x, ids])))

    plain_grads = [g.numpy() for g in kg.per_example_gradients(plain, *args)]
    for value in (SCALE, 3.0 * SCALE):
        dynamic.assign(value)
        for g, g_plain in zip(kg.per_example_gradients(loss_fn, *args), plain_grads):
            assert_close(g.numpy(), value * g_plain, 1e-12)


@pytest.mark.slow
def test_static_loss_scale_kfac_steps():
    """kg.KFAC on ``loss * 1024`` with damping 1024 d takes the unscaled
    loss's steps with damping d (its curvature is 1024 F: the scale is the
    loss's). KL clipping (``norm_constraint``) is in the scaled loss's units,
    so it is off here."""
    plain, scaled, plain_model, scaled_model = _scaled_pair("float64")
    args = _data(tf.float64)
    options = dict(momentum_type="regular", norm_constraint=None)
    opt = kg.KFAC(plain, damping=0.1, **options)
    opt_scaled = kg.KFAC(scaled, damping=0.1 * SCALE, **options)
    for _ in range(3):
        loss, loss_scaled = opt.step(*args), opt_scaled.step(*args)
        assert_close(float(loss_scaled), SCALE * float(loss), 1e-9)
    for v, v_scaled in zip(plain_model.weights, scaled_model.weights):
        assert_close(v_scaled.numpy(), v.numpy(), 1e-6, v.name)


@pytest.mark.slow
def test_mixed_float16_static_loss_scale(restore_policy):
    """Under mixed_float16 the scaled loss's per-example gradients are 1024
    times the unscaled ones up to float16 rounding."""
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    plain, scaled, _, _ = _scaled_pair()
    args = _data()
    for g, g_scaled in zip(kg.per_example_gradients(plain, *args),
                           kg.per_example_gradients(scaled, *args)):
        assert g_scaled.dtype == tf.float32
        assert_close(g_scaled.numpy() / SCALE, g.numpy(), 16 * UNIT_ROUNDOFF["float16"])
