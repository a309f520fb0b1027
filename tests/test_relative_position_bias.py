"""Relative-position bias tables (``passes/patterns_relative.py``): T5 looks
its table ``[buckets, H]`` up by bucket ids ``[q, k]`` that do not depend on
the data, transposes the rows to ``[1, H, q, k]`` and adds them to every
example's scores (or first to their padding mask). An embedding whose
output is that sum: its ids broadcast over the batch, its output gradient
read back in the lookup's layout (``grad_perm``). Before, the table was
generic ("no example axis"). Checked in float64 against a loop of
one-example gradients and the brute-force Fisher."""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_checks import block_matrix
from fisher_reference import brute_fisher, softmax_fisher
from per_example_reference import assert_matches_loop

B, T, D, H, C = 3, 4, 4, 2, 2


def _attention(masked):
    rng = np.random.RandomState(0)
    table = tf.Variable(rng.normal(size=(2 * T - 1, H)), name="relative_bias")
    wq = tf.Variable(rng.normal(size=(D, D)), name="wq")
    head = tf.Variable(rng.normal(size=(D, C)), name="head")
    buckets = tf.constant(np.arange(T)[None, :] - np.arange(T)[:, None] + T - 1)  # [q, k]

    def logits(params, x, keep):
        table, wq = params
        q = tf.reshape(x @ wq, [-1, T, H, D // H])
        scores = tf.einsum("bqnd,bknd->bnqk", q, q)
        bias = tf.transpose(tf.gather(tf.identity(table), buckets), [2, 0, 1])[None]
        if masked:  # the padding mask first, as T5 adds it
            bias = bias + (1.0 - tf.cast(keep, bias.dtype))[:, None, None, :] * -1e9
        weights = tf.nn.softmax(scores + bias, axis=-1)
        out = tf.reshape(tf.einsum("bnqk,bknd->bqnd", weights, q), [-1, T, D])
        return tf.reduce_mean(out, axis=1) @ head

    @kg.auto_register
    def loss_fn(x, keep, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, logits([table, wq], x, keep)))

    keep = np.ones((B, T))
    keep[1, -1] = 0
    args = (tf.constant(rng.normal(size=(B, T, D))), tf.constant(keep), tf.constant([0, 1, 1]))
    return loss_fn, logits, [table, wq], args


@pytest.mark.parametrize("masked", [False, True])
def test_relative_position_bias(masked):
    loss_fn, logits, params, args = _attention(masked)
    reg = loss_fn.registration(*args)
    (layer,) = [layer for layer in reg.layers if layer.variables[0] is params[0]]
    assert (layer.kind, layer.use_attrs[0]["grad_perm"]) == ("embedding", (0, 2, 3, 1)), (
        reg.summary())
    assert_matches_loop(loss_fn, args)
    want = brute_fisher(lambda p, x: logits([p[0], params[1]], x, args[1]), [params[0]],
                        args[0], softmax_fisher)
    np.testing.assert_allclose(block_matrix(loss_fn, args, layer, "embedding", "full"), want,
                               rtol=1e-6, atol=1e-12)
    # the default Kronecker block runs
    assert np.all(np.isfinite(block_matrix(loss_fn, args, layer, "embedding",
                                           estimation_mode="sampled")))


@pytest.mark.slow
def test_keras_hub_t5():
    """keras-hub's T5 from a tiny config, float64: its two relative
    attention tables (encoder's and decoder's, each shared by every layer
    of its stack) register as embeddings; no variable is generic;
    per-example gradients equal a loop; ``kg.verify`` passes."""
    keras = pytest.importorskip("keras")
    keras_hub = pytest.importorskip("keras_hub")
    keras.config.set_floatx("float64")  # conftest restores the dtypes
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.T5Backbone(vocabulary_size=40, num_layers=2, hidden_dim=16,
                                           intermediate_dim=32, num_heads=2)
    head = keras.layers.Dense(3)

    @kg.auto_register
    def loss_fn(x, y):
        out = backbone({k: tf.ones_like(x) if "mask" in k else x for k in backbone.input})
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, head(tf.reduce_mean(out["decoder_sequence_output"], axis=1))))

    args = (tf.constant(np.random.RandomState(1).randint(1, 40, (B, 5))), tf.constant([0, 1, 2]))
    reg = loss_fn.registration(*args)
    assert not [layer for layer in reg.layers if layer.kind == "generic"], reg.summary()
    assert sum(layer.kind == "embedding" and "grad_perm" in layer.use_attrs[0]
               for layer in reg.layers) == 2, reg.summary()
    assert_matches_loop(loss_fn, args, rtol=1e-6, atol=1e-10)
    assert kg.verify(loss_fn, *args).passed
