"""keras-hub tasks as people fine-tune them: a ``CausalLM`` on padded token
sequences (its padding mask the per-token sample weight), its backbone
adapted by ``enable_lora`` and frozen otherwise, trained through
``kg.KFACModel.fit``; and a ``TextClassifier``.

Tiny configs, random weights, no preprocessor (the token ids are the
input). Shown: the weighted per-token loss's per-example gradients equal
one-example tapes (Keras divides the weighted sum by the token count, not
by ``sum(w)``: a batch of one is the example's own loss), ``fit`` with the
padding mask
lowers the loss with only the adapters moving, and the classifier's
per-example gradients equal the loop.
"""
import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg

B, T, V = 3, 6, 40
M = keras_hub.models


def _tokens(n, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, V, (n, T)).astype("int32")
    pad = np.ones((n, T), "int32")
    pad[::3, -2:] = 0  # every third sequence two tokens shorter
    return ids, pad


def _gpt2_lm():
    keras.utils.set_random_seed(0)
    backbone = M.GPT2Backbone(vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=16,
                              intermediate_dim=32, max_sequence_length=8)
    return M.GPT2CausalLM(backbone, preprocessor=None)


def _assert_matches_loop(loss_fn, args, rtol=2e-5):
    """Per-example gradients against one-example tapes."""
    reg = loss_fn.registration(*args)
    got = kg.per_example_gradients(loss_fn, *args)
    for i in range(B):
        with tf.GradientTape() as tape:
            loss = loss_fn(*tf.nest.map_structure(lambda a: a[i:i + 1], args))
        want = [tf.convert_to_tensor(w).numpy()
                for w in tape.gradient(loss, reg.variables)]
        scale = np.sqrt(sum(np.sum(w ** 2) for w in want))
        for v, g, w in zip(reg.variables, got, want):
            np.testing.assert_allclose(g[i], w, rtol=rtol, atol=1e-5 * scale, err_msg=v.name)
    return reg


def test_causal_lm_padding_mask_and_adapters_fit():
    task = _gpt2_lm()
    task.backbone.enable_lora(2)
    rng = np.random.default_rng(1)
    for v in task.backbone.trainable_variables:  # keras-hub starts B at zero
        if "lora_kernel_b" in v.path:
            v.assign(rng.normal(size=v.shape).astype("float32") * 0.1)
    ids, pad = _tokens(24)
    y, weights = np.roll(ids, -1, axis=1), pad.astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @kg.auto_register
    def loss_fn(x, y, w):
        return loss(y, task(x), sample_weight=w)

    x = {"token_ids": tf.constant(ids[:B]), "padding_mask": tf.constant(pad[:B])}
    reg = _assert_matches_loop(loss_fn, (x, tf.constant(y[:B]), tf.constant(weights[:B])))
    assert reg.loss.weighted and {layer.kind for layer in reg.layers} == {
        "dense", "scale_and_shift"}, reg.summary()
    frozen = [(v, v.numpy()) for v in task.non_trainable_variables
              if "seed_generator" not in v.path]  # (dropout's seeds move)
    km = kg.KFACModel(task, loss=loss, momentum_type="regular", learning_rate=0.05,
                      damping=1e-2)
    km.compile()
    history = km.fit({"token_ids": ids, "padding_mask": pad}, y, sample_weight=weights,
                     batch_size=8, epochs=3, verbose=0).history["loss"]
    assert history[-1] < history[0], history
    for v, value in frozen:
        np.testing.assert_array_equal(v.numpy(), value, err_msg=v.path)


@pytest.mark.slow  # a classifier like the backbone tests; its first K-FAC step, 8-40 s
def test_text_classifier_trains():
    keras.utils.set_random_seed(0)
    backbone = M.BertBackbone(vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=16,
                              intermediate_dim=32, max_sequence_length=8)
    task = M.BertTextClassifier(backbone, num_classes=3, preprocessor=None)
    ids, pad = _tokens(B)
    x = {"token_ids": tf.constant(ids), "segment_ids": tf.zeros_like(ids),
         "padding_mask": tf.constant(pad)}
    y = tf.constant([0, 2, 1])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            y, task(x), from_logits=True))

    reg = _assert_matches_loop(loss_fn, (x, y))
    assert "generic" not in {layer.kind for layer in reg.layers}
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(x, y)) for _ in range(5)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses
