"""Vision transformers as keras-hub writes them.

ViT looks its position embeddings up by ids ``[1, T]`` (a unit axis where
the batch goes) and adds them to ``[B, T, d]`` patches: a position
embedding, like ids ``[T]`` (before: generic, "no example axis"). Its class
token, tiled over the batch and concatenated before the patches, is a shift
of the tiled copy (``tests/test_tiled_weights.py``). Checked in float64
against a loop of one-example gradients and the brute-force Fisher of the
position table."""
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


def test_keras_hub_vit():
    keras = pytest.importorskip("keras")
    keras_hub = pytest.importorskip("keras_hub")
    keras.config.set_floatx("float64")  # conftest restores the dtypes
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(8, 8, 3), patch_size=4, num_layers=2, num_heads=2, hidden_dim=8,
        mlp_dim=16)
    head = keras.layers.Dense(C)

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, head(backbone(x)[:, 0])))

    rng = np.random.RandomState(1)
    args = (tf.constant(rng.normal(size=(B, 8, 8, 3))), tf.constant([0, 1, 1]))
    reg = loss_fn.registration(*args)
    kinds = {layer.name.split("/")[-1]: layer.kind for layer in reg.layers}
    assert kinds["position_embedding_1"] == "embedding", reg.summary()
    assert not [layer for layer in reg.layers if layer.kind == "generic"], reg.summary()
    (token,) = [layer for layer in reg.layers if "class_token" in layer.variables[0].name]
    assert token.kind == "scale_and_shift", reg.summary()
    assert_matches_loop(loss_fn, args)
