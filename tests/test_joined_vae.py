"""Variational autoencoders: the KL term's curvature joins the
reconstruction's (``passes/joined_outputs.py``). The encoder's output feeds
the KL term and, through the sampled code, the decoder; each block against
a brute-force ``J^T H J`` (``joined_reference``), under mixed precision
too, and K-FAC with its defaults.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from joined_reference import assert_joined_blocks

B = 6


@pytest.fixture
def float64():
    keras.config.set_floatx("float64")  # (conftest restores both)
    keras.config.set_dtype_policy("float64")


def _keras_vae(seed=0, pixels=6):
    """The Keras VAE example's shape: ``z_mean`` and ``z_log_var`` each from a
    layer of its own, the code sampled from them, the decoder's logits."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((pixels,))
    h = keras.layers.Dense(5, activation="relu", name="enc_hidden")(inputs)
    encoder = keras.Model(inputs, [keras.layers.Dense(2, name="z_mean")(h),
                                   keras.layers.Dense(2, name="z_log_var")(h)])
    decoder = keras.Sequential([keras.Input((2,)),
                                keras.layers.Dense(5, activation="tanh", name="dec_hidden"),
                                keras.layers.Dense(pixels, name="dec_out")])

    def outputs(x, eps):
        z_mean, z_log_var = encoder(x)
        return [decoder(z_mean + tf.exp(0.5 * z_log_var) * eps), z_mean, z_log_var]

    def on_outputs(zs, x, eps):
        logits, z_mean, z_log_var = zs
        reconstruction = tf.reduce_mean(tf.reduce_sum(
            tf.nn.sigmoid_cross_entropy_with_logits(x, logits), axis=1))
        kl = -0.5 * (1 + z_log_var - tf.square(z_mean) - tf.exp(z_log_var))
        return reconstruction + tf.reduce_mean(tf.reduce_sum(kl, axis=1))
    rng = np.random.default_rng(seed + 1)
    args = (tf.constant((rng.uniform(size=(B, pixels)) > 0.5).astype("float64")),
            tf.constant(rng.normal(size=(B, 2))))
    return encoder, decoder, outputs, on_outputs, args


@pytest.mark.slow  # the KL term's blocks: test_vae_kl_term_is_in_the_encoder_blocks (fast)
def test_keras_vae_with_a_layer_per_code_statistic(float64):
    """Before: the KL term had no output (its ``z_mean`` and ``z_log_var``
    meet only below it), so it was in no curvature."""
    encoder, decoder, outputs, on_outputs, args = _keras_vae()
    fn = kg.auto_register(lambda x, eps: on_outputs(outputs(x, eps), x, eps))
    layers = [encoder.get_layer(n) for n in ("enc_hidden", "z_mean", "z_log_var")] + [
        decoder.get_layer(n) for n in ("dec_hidden", "dec_out")]
    assert_joined_blocks(fn, args, layers, outputs, on_outputs)


def _vae(seed=0):
    """A variational autoencoder: the encoder's output ``[mu, log var]``
    feeds the KL term and, through the sampled code, the decoder."""
    keras.utils.set_random_seed(seed)
    encoder = keras.Sequential([keras.Input((7,)),
                                keras.layers.Dense(6, activation="tanh", name="enc_hidden"),
                                keras.layers.Dense(4, name="enc_out")])
    decoder = keras.Sequential([keras.Input((2,)),
                                keras.layers.Dense(6, activation="tanh", name="dec_hidden"),
                                keras.layers.Dense(7, name="dec_out")])

    def outputs(x, eps):
        h = encoder(x)
        code = h[:, :2] + tf.exp(0.5 * h[:, 2:]) * eps
        return [decoder(code), h]

    def on_outputs(zs, x, eps):
        logits, h = zs
        mu, log_var = h[:, :2], h[:, 2:]
        reconstruction = tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(x, logits), -1)
        kl = -0.5 * tf.reduce_sum(1 + log_var - mu ** 2 - tf.exp(log_var), -1)
        return tf.reduce_mean(reconstruction + kl)
    rng = np.random.default_rng(seed + 1)
    args = (tf.constant(rng.uniform(size=(B, 7))), tf.constant(rng.normal(size=(B, 2))))
    return encoder, decoder, outputs, on_outputs, args


def _mixed_vae_traces(policy):
    """The exact Fisher blocks' traces of a VAE built under ``policy`` (the
    decoder's logits in float32, the codes cast to float32 by the loss)."""
    keras.config.set_dtype_policy(policy)  # (conftest restores it)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(5, activation="relu")(inputs)
    encoder = keras.Model(inputs, [keras.layers.Dense(2)(h), keras.layers.Dense(2)(h)])
    decoder = keras.Sequential([keras.Input((2,)), keras.layers.Dense(5, activation="tanh"),
                                keras.layers.Dense(6, dtype="float32")])

    @kg.auto_register
    def loss(x, eps):
        z_mean, z_log_var = (tf.cast(t, tf.float32) for t in encoder(x))
        logits = decoder(z_mean + tf.exp(0.5 * z_log_var) * eps)
        kl = -0.5 * (1 + z_log_var - tf.square(z_mean) - tf.exp(z_log_var))
        return tf.reduce_mean(tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(
            x, logits), 1)) + tf.reduce_mean(tf.reduce_sum(kl, 1))

    rng = np.random.default_rng(0)
    args = (tf.constant((rng.uniform(size=(16, 6)) > 0.5).astype("float32")),
            tf.constant(rng.normal(size=(16, 2)), tf.float32))
    assert loss.registration(*args).loss.kind == "ggn"
    est = kg.FisherEstimator(loss, estimation_mode="exact", cov_ema_decay=0.0)
    est.update(*args)
    return [float(np.trace(b.full_matrix().numpy())) for b in est.blocks]


def test_vae_under_mixed_precision_keeps_the_kl_curvature():
    """Under ``mixed_float16`` the KL head reads the float16 codes through
    casts, which the IR's canonical inputs skip; the head was rewired by
    those, so it kept reading the codes themselves: its Hessian over the
    joined output was zero and the encoder's blocks a tenth of float32's
    (K-FAC's defaults then went from a loss of 4.9 to 1e7)."""
    np.testing.assert_allclose(_mixed_vae_traces("mixed_float16"),
                               _mixed_vae_traces("float32"), rtol=2e-2)


def test_vae_kl_term_is_in_the_encoder_blocks(float64):
    """Before, the KL term's curvature was in no block: the encoder's blocks
    were the reconstruction's alone (0.70 off the brute force, of 0.75)."""
    encoder, decoder, outputs, on_outputs, args = _vae()
    fn = kg.auto_register(lambda x, eps: on_outputs(outputs(x, eps), x, eps))
    layers = [layer for layer in (*encoder.layers, *decoder.layers) if layer.trainable_variables]
    assert_joined_blocks(fn, args, layers, outputs, on_outputs)


def test_vae_trains_with_the_defaults(float64):
    """The quadratic model saw no KL curvature before: its steps went from
    a loss of 5.3 up to 17 and 20 on this fixed code noise."""
    *_, outputs, on_outputs, args = _vae()
    fn = kg.auto_register(lambda x, eps: on_outputs(outputs(x, eps), x, eps))
    opt = kg.KFAC(fn)
    losses = [float(opt.step(*args)) for _ in range(12)]
    assert int(opt.skipped_steps) == 0 and max(losses) <= losses[0], losses
    assert losses[-1] < 0.85 * losses[0], losses
