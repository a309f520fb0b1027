"""Joined outputs beyond ``MAX_CLASSES`` values per example: the loss
Hessian block by block (``passes.loss_output.hessian_blocks``,
``kfac_graph/fisher/ggn_blocks.py``).

The Keras VAE example's shape at 260 pixels (260 Bernoulli logits beside
the KL term's 2 + 2 code statistics, 264 values): before, the outputs were
refused as "beyond the 256 whose loss Hessian is formed", and the KL term
was in no curvature (the encoder's blocks 1.26 off the brute force, in
blocks of size 1.29). Now the Hessian is one 1x1 block per pixel and one
4x4 block for the codes (5 backward passes where the whole would take
264), and every block equals brute force."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from joined_reference import assert_joined_blocks
from kfac_graph.fisher.ggn import GGN, output_hessian
from kfac_graph.fisher.ggn_blocks import block_curvature
from kfac_graph.taps import LayerTaps
from passes import loss_output
from test_joined_vae import _keras_vae


@pytest.fixture
def float64():
    keras.config.set_floatx("float64")  # (conftest restores both)
    keras.config.set_dtype_policy("float64")


def _registered(pixels):
    encoder, decoder, outputs, on_outputs, args = _keras_vae(pixels=pixels)
    fn = kg.auto_register(lambda x, eps: on_outputs(outputs(x, eps), x, eps))
    layers = [encoder.get_layer(n) for n in ("enc_hidden", "z_mean", "z_log_var")] + [
        decoder.get_layer(n) for n in ("dec_hidden", "dec_out")]
    return fn, args, layers, outputs, on_outputs


@pytest.mark.slow  # the blocks against the whole Hessian: test_block_curvature_... (fast)
def test_every_block_is_brute_force(float64, monkeypatch):
    """At 10 pixels with the whole Hessian's budget lowered to 8 values, so
    that the exact Fisher's one column per position and class (14) stays
    cheap: the blocks' code path is the one taken beyond 256 values."""
    monkeypatch.setattr(loss_output, "MAX_CLASSES", 8)
    fn, args, layers, outputs, on_outputs = _registered(10)
    reg = assert_joined_blocks(fn, args, layers, outputs, on_outputs,
                               position_columns="separate")
    assert reg.loss.blocks == ((10, 1), (4, 4))
    assert kg.verify(fn, *args).passed


@pytest.mark.slow  # the blocks: test_every_block_is_brute_force
def test_260_pixels_are_read_in_blocks_and_the_defaults_train_them(float64):
    fn, args, *_ = _registered(260)
    reg = fn.registration(*args)
    assert reg.loss.blocks == ((260, 1), (4, 4))
    assert "in blocks 260x(1x1), 4x4" in reg.summary()
    opt = kg.KFAC(fn)
    losses = [float(opt.step(*args)) for _ in range(6)]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert int(opt.skipped_steps) == 0


def test_block_curvature_equals_the_whole_hessians(float64):
    """Where both can be formed (14 values), the blocks' products, diagonal,
    square root (one column per position and class) and samples are the
    whole Hessian's; the shared columns are one per block and class."""
    fn, args, *_ = _registered(10)
    reg = fn.registration(*args)
    assert reg.loss.blocks == ()  # small enough for the whole Hessian

    @tf.function
    def both():
        taps = LayerTaps.build(reg, args)
        whole = GGN(output_hessian(taps.per_example_loss, taps.model_output))
        blocks = ((10, 1), (4, 4))
        parts = block_curvature(taps.per_example_loss, taps.model_output, blocks)
        v = tf.random.stateless_normal([6, 14], [1, 2], dtype=tf.float64)
        seed = tf.constant([3, 4])
        return (whole.fisher(), parts.fisher(), whole.multiply_fisher(v),
                parts.multiply_fisher(v), whole.fisher_diagonal(), parts.fisher_diagonal(),
                len(parts.sqrt_fisher_columns()), parts.sample_cotangent(seed),
                parts.sample_cotangent(seed))
    f_whole, f_parts, fv_whole, fv_parts, d_whole, d_parts, shared, s1, s2 = both()
    np.testing.assert_allclose(f_parts, f_whole, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(fv_parts, fv_whole, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(d_parts, d_whole, rtol=1e-12, atol=1e-14)
    assert shared == 1 + 4 and s1.shape == (6, 14)
    np.testing.assert_array_equal(s1, s2)  # one key, one draw
