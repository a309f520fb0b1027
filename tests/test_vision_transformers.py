"""Vision transformers as keras-hub writes them.

ViT looks its position embeddings up by ids ``[1, T]`` (a unit axis where
the batch goes) and adds them to ``[B, T, d]`` patches: a position
embedding, like ids ``[T]`` (before: generic, "no example axis"). Its class
token, tiled over the batch and concatenated before the patches, is a shift
of the tiled copy (``tests/test_tiled_weights.py``). Checked in float64
against a loop of one-example gradients and the brute-force Fisher of the
position table. DINOv2 (register tokens, layer scale, SwiGLU; ``-m slow``)
and SegFormer (MiT and its decoder, whose batch norm couples the examples
unless called with ``training=False``) as keras-hub writes them."""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_reference import brute_fisher, softmax_fisher
from per_example_reference import assert_matches_loop

B, T, D, C = 3, 4, 3, 2


def test_position_ids_with_a_unit_batch_axis():
    rng = np.random.RandomState(0)
    table = tf.Variable(rng.normal(size=(T, D)), name="positions")
    head = tf.Variable(rng.normal(size=(D, C)), name="head")

    def logits(params, x):
        table, head = params
        h = tf.tanh(x + tf.gather(table, tf.range(T)[None]))
        return tf.reduce_mean(h, axis=1) @ head

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, logits([table, head], x)))

    args = (tf.constant(rng.normal(size=(B, T, D))), tf.constant([0, 1, 1]))
    reg = loss_fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == ["embedding", "dense"], reg.summary()
    assert_matches_loop(loss_fn, args)
    want = brute_fisher(lambda p, x: logits([p[0], head], x), [table], args[0], softmax_fisher)
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact",
                             approximations={"embedding": "full"})
    est.update(*args)
    np.testing.assert_allclose(est.blocks[0].full_matrix(), want, rtol=1e-6, atol=1e-12)


def _classifier(backbone, pool=lambda out: out[:, 0]):
    """A registered loss classifying ``pool(backbone(x))`` into C classes with
    a Dense head (the class token's output by default), and a batch of B
    8 x 8 images in the floatx of the test."""
    import keras
    head = keras.layers.Dense(C)

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, head(pool(backbone(x)))))

    x = np.random.RandomState(1).normal(size=(B, 8, 8, 3)).astype(keras.config.floatx())
    return loss_fn, (tf.constant(x), tf.constant([0, 1, 1]))


def test_keras_hub_vit(keras_float64):
    keras = pytest.importorskip("keras")
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(8, 8, 3), patch_size=4, num_layers=2, num_heads=2, hidden_dim=8,
        mlp_dim=16)
    loss_fn, args = _classifier(backbone)
    reg = loss_fn.registration(*args)
    kinds = {layer.name.split("/")[-1]: layer.kind for layer in reg.layers}
    assert kinds["position_embedding_1"] == "embedding", reg.summary()
    assert not [layer for layer in reg.layers if layer.kind == "generic"], reg.summary()
    (token,) = [layer for layer in reg.layers if "class_token" in layer.variables[0].name]
    assert token.kind == "scale_and_shift", reg.summary()
    assert_matches_loop(loss_fn, args)


@pytest.mark.slow  # about 15 s: the pass, a loop of one-example tapes and 20 K-FAC steps
def test_keras_hub_dinov2_with_register_tokens_and_swiglu(keras_float64):
    """DINOv2: a class token and register tokens tiled over the batch, its
    position table interpolated to the image, layer scale after attention
    and MLP, the SwiGLU MLP. Every variable the loss reads registers in a
    non-generic layer (the mask token is not read), the per-example
    gradients equal one-example tapes (float64), and ``kg.KFAC``'s defaults
    lower the loss in 20 steps with no step skipped."""
    keras = pytest.importorskip("keras")
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.DINOV2Backbone(
        patch_size=4, num_layers=2, hidden_dim=8, num_heads=2, intermediate_dim=16,
        num_register_tokens=2, use_swiglu_ffn=True, image_shape=(8, 8, 3),
        position_embedding_shape=(12, 12, 3))
    loss_fn, args = _classifier(backbone)
    reg = loss_fn.registration(*args)
    assert not reg.generic_variables and not reg.coupling, reg.summary()
    assert len(reg.variables) == len(backbone.trainable_variables) + 2 - 1, reg.summary()
    assert not [v.name for v in reg.variables if "mask_token" in v.name]
    assert_matches_loop(loss_fn, args, rtol=1e-9)
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(20)]
    assert losses[-1] < 0.5 * losses[0] and int(opt.skipped_steps) == 0, losses


@pytest.mark.parametrize("training", [None, False])
def test_keras_hub_segformer_decoder_couples_only_in_training_mode(training):
    """SegFormer's decoder ends in a ``keras.Sequential`` whose
    BatchNormalization runs in training mode when the backbone is called
    without ``training=``: the pass lists its batch moments as where the
    examples meet (DP-SGD refuses the loss); with ``training=False`` none."""
    keras = pytest.importorskip("keras")
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    encoder = keras_hub.models.MiTBackbone(
        layerwise_depths=[1, 1], num_layers=2, layerwise_num_heads=[1, 2],
        layerwise_sr_ratios=[2, 1], max_drop_path_rate=0.0, layerwise_patch_sizes=[3, 3],
        layerwise_strides=[2, 2], hidden_dims=[4, 8], image_shape=(8, 8, 3))
    segformer = keras_hub.models.SegFormerBackbone(image_encoder=encoder, projection_filters=4)

    def backbone(x):
        return segformer(x) if training is None else segformer(x, training=training)

    loss_fn, args = _classifier(backbone, pool=lambda out: tf.reduce_mean(out, axis=[1, 2]))
    reg = loss_fn.registration(*args)
    assert not reg.generic_variables, reg.summary()
    moments = [op for op in reg.coupling if "batch_normalization" in op]
    if training is None:
        assert moments and len(moments) == len(reg.coupling), reg.coupling
    else:
        assert not reg.coupling, reg.coupling
        assert_matches_loop(loss_fn, args, rtol=1e-3, atol=1e-6)
