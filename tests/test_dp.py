"""DP-SGD: clipping and noise against their definitions."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg


def _setup(seed=0, generic=False):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                              keras.layers.Dense(3)])
    extra = tf.Variable(0.5, name="extra")

    @kg.auto_register
    def loss_fn(x, y):
        logits = model(x)
        if generic:
            logits = logits + tf.sin(extra)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    x = tf.random.stateless_normal([7, 6], seed=[seed, 1]) * 3.0
    y = tf.random.stateless_uniform([7], [seed, 2], maxval=3, dtype=tf.int32)
    return model, loss_fn, (x, y)


@pytest.mark.parametrize("method", ["reweight", "materialize"])
def test_huge_clip_and_no_noise_is_the_batch_gradient(method):
    _, loss_fn, args = _setup()
    reg = loss_fn.registration(*args)
    got = kg.dp_gradients(loss_fn, *args, l2_norm_clip=1e9, noise_multiplier=0.0, method=method)
    with tf.GradientTape() as tape:
        loss = loss_fn(*args)
    for g, b in zip(got, tape.gradient(loss, list(reg.variables))):
        np.testing.assert_allclose(g, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize("method", ["reweight", "materialize"])
def test_clipping_matches_its_definition(method, generic):
    _, loss_fn, args = _setup(generic=generic)
    clip = 0.05
    pxg = kg.per_example_gradients(loss_fn, *args)
    norms = np.sqrt(sum(np.sum(np.reshape(g, (7, -1)) ** 2, 1) for g in pxg))
    assert (norms > clip).all()  # every example is clipped
    weights = np.minimum(1.0, clip / norms)
    got = kg.dp_gradients(loss_fn, *args, l2_norm_clip=clip, noise_multiplier=0.0, method=method)
    for g, p in zip(got, pxg):
        np.testing.assert_allclose(g, np.tensordot(weights, p, axes=1) / 7, rtol=1e-4, atol=1e-8)


def test_every_contribution_is_within_the_clip():
    _, loss_fn, (x, y) = _setup()
    clip = 0.05
    for i in range(3):
        one = (x[i:i + 1], y[i:i + 1])
        g = kg.dp_gradients(loss_fn, *one, l2_norm_clip=clip, noise_multiplier=0.0)
        assert np.sqrt(sum(float(tf.reduce_sum(t ** 2)) for t in g)) <= clip * (1 + 1e-5)


def test_noise_has_the_stated_scale_and_follows_the_seed():
    _, loss_fn, args = _setup()
    clip, sigma = 0.1, 2.0
    clean = kg.dp_gradients(loss_fn, *args, l2_norm_clip=clip, noise_multiplier=0.0)
    noisy = kg.dp_gradients(loss_fn, *args, l2_norm_clip=clip, noise_multiplier=sigma, seed=(1, 2))
    again = kg.dp_gradients(loss_fn, *args, l2_norm_clip=clip, noise_multiplier=sigma, seed=(1, 2))
    noise = np.concatenate([np.ravel((n - c) * 7) for n, c in zip(noisy, clean)])
    assert abs(noise.std() - sigma * clip) < 0.25 * sigma * clip  # ~60 draws
    for a, b in zip(noisy, again):
        np.testing.assert_array_equal(a, b)


def test_dpsgd_step_with_huge_clip_is_sgd_and_compiles():
    model, loss_fn, args = _setup()
    reg = loss_fn.registration(*args)
    before = [v.numpy() for v in reg.variables]
    with tf.GradientTape() as tape:
        loss = loss_fn(*args)
    grads = tape.gradient(loss, list(reg.variables))
    opt = kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1e9, noise_multiplier=0.0)
    returned = opt.step(*args)
    np.testing.assert_allclose(returned, loss, rtol=1e-6)
    for v, b, g in zip(reg.variables, before, grads):
        np.testing.assert_allclose(v.numpy(), b - 0.1 * g.numpy(), rtol=1e-5, atol=1e-7)
    assert int(opt.iterations) == 1

    @tf.function(jit_compile=True)
    def compiled(x, y):
        return kg.dp_gradients(loss_fn, x, y, l2_norm_clip=0.1, noise_multiplier=1.0, seed=(0, 3))

    eager = kg.dp_gradients(loss_fn, *args, l2_norm_clip=0.1, noise_multiplier=1.0, seed=(0, 3))
    for a, b in zip(compiled(*args), eager):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_float64_model_steps_at_its_learning_rate_in_float64():
    """The rate was converted to a float32 tensor, then cast: 0.1 became
    0.10000000149, a relative error of 1.5e-8 in every float64 step."""
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    model, loss_fn, (x, y) = _setup(3)
    x = tf.cast(x, tf.float64)
    reg = loss_fn.registration(x, y)
    before = [v.numpy() for v in reg.variables]
    with tf.GradientTape() as tape:
        loss = loss_fn(x, y)
    grads = tape.gradient(loss, list(reg.variables))
    kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1e9, noise_multiplier=0.0).step(x, y)
    for v, b, g in zip(reg.variables, before, grads):
        np.testing.assert_allclose(v.numpy(), b - 0.1 * g.numpy(), rtol=1e-13, atol=1e-15)
