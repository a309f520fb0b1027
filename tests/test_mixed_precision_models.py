"""Mixed precision on model code this project did not write: a GPT-2
backbone (keras-hub, per-token masked LM loss on its tied table), a
Conv2D + BatchNormalization (inference) net with layer-level
``dtype="mixed_bfloat16"``, and LSTM and GRU classifiers under the global
``mixed_float16`` policy; and ``kg.KFACModel`` / ``kg.DPModel`` ``fit``
under ``mixed_float16`` (tests/test_mixed_precision.py has the mechanics
and the bound against the exact float64 gradients; this file the models).

The truth for each model is a loop of one-example tapes under the same
policy, and the same model (same weights) under the float32 policy. The
16-bit forward and backward passes put an error of a few units of roundoff
on each gradient (bfloat16 2^-8, float16 2^-11): per variable we require
``|ours - truth| <= tol * max(|truth|, 1e-2 |all of truth| / sqrt(n))``
with tol 5e-2 (bfloat16) and 1e-2 (float16); the floor keeps gradients that
are zero in exact arithmetic (a key bias) from dividing roundoff by zero.
The mean of the per-example gradients must equal the batch gradient of
the same policy, and the registration must be the float32 one (no layer
falls to generic under a 16-bit policy).
"""
import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from per_example_reference import one_example_loop

TOL = {"mixed_bfloat16": 5e-2, "mixed_float16": 1e-2}
B = 3


@pytest.fixture
def restore_policy():
    """Restores Keras's global dtype policy after the test."""
    saved = keras.mixed_precision.dtype_policy()
    yield
    keras.mixed_precision.set_dtype_policy(saved)


def _close(got, want, tol, what):
    got, want = ([np.asarray(tf.convert_to_tensor(t), np.float64) for t in ts]
                 for ts in (got, want))  # (an embedding's batch gradient: IndexedSlices)
    total = np.sqrt(sum(np.sum(np.square(w)) for w in want))
    floor = 1e-2 * total / np.sqrt(len(want))
    for g, w, name in zip(got, want, what):
        err = np.linalg.norm(g - w)
        assert err <= tol * max(np.linalg.norm(w), floor), (name, err)


def _gpt2(dtype):
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=8, **({} if dtype is None else {"dtype": dtype}))
    rng = np.random.RandomState(1)
    x = tf.constant(rng.randint(1, 50, (B, 8)), tf.int32)
    mask = tf.constant((np.arange(8)[None] < np.array([[8], [6], [4]])).astype("int32"))

    @kg.auto_register
    def loss_fn(x, mask, y):
        h = backbone({"token_ids": x, "padding_mask": mask})
        logits = tf.cast(backbone.token_embedding(h, reverse=True), tf.float32)
        m = tf.cast(mask, tf.float32)
        per_token = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits) * m
        return tf.reduce_mean(tf.reduce_sum(per_token, 1) / tf.reduce_sum(m, 1))
    return loss_fn, (x, mask, tf.constant(rng.randint(0, 50, (B, 8)), tf.int32))


def _cnn(dtype):
    keras.utils.set_random_seed(0)
    kw = {} if dtype is None else {"dtype": dtype}
    x = keras.Input((12, 12, 3))
    h = keras.layers.Conv2D(8, 3, strides=2, padding="same", **kw)(x)
    h = keras.layers.Activation("relu", **kw)(keras.layers.BatchNormalization(**kw)(h))
    h = keras.layers.Conv2D(8, 3, **kw)(h)
    h = keras.layers.Activation("relu", **kw)(keras.layers.BatchNormalization(**kw)(h))
    model = keras.Model(x, keras.layers.Dense(5, **kw)(keras.layers.Flatten(**kw)(h)))
    return _classifier(model, tf.random.stateless_uniform([B, 12, 12, 3], [1, 2]))


def _recurrent(kind):
    def build(dtype):
        keras.utils.set_random_seed(0)
        kw = {} if dtype is None else {"dtype": dtype}
        rnn = keras.layers.LSTM if kind == "lstm" else keras.layers.GRU
        model = keras.Sequential([keras.Input((6,), dtype="int32"),
                                  keras.layers.Embedding(20, 8, **kw), rnn(8, **kw),
                                  keras.layers.Dense(5, **kw)])
        return _classifier(model, tf.random.stateless_uniform(
            [B, 6], [3, 4], maxval=20, dtype=tf.int32))
    return build


def _classifier(model, x):
    @kg.auto_register
    def loss_fn(x, y):
        logits = tf.cast(model(x), tf.float32)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
    return loss_fn, (x, tf.constant([0, 3, 1]))


def _per_example(build, dtype=None):
    loss_fn, args = build(dtype)
    reg = loss_fn.registration(*args)
    layers = [(layer.kind, tuple(v.shape for v in layer.variables)) for layer in reg.layers]
    got = kg.per_example_gradients(loss_fn, *args)
    loop = one_example_loop(loss_fn, args, reg.variables)
    with tf.GradientTape() as tape:
        loss = loss_fn(*args)
    batch = tape.gradient(loss, list(reg.variables))
    return reg, layers, got, loop, batch


@pytest.mark.parametrize("build,policy,layer_level", [
    (_gpt2, "mixed_float16", False), (_cnn, "mixed_bfloat16", True),
    (_recurrent("lstm"), "mixed_float16", False),
    pytest.param(_recurrent("gru"), "mixed_float16", False, marks=pytest.mark.slow)],
    ids=["gpt2-fp16", "cnn-layer-bf16", "lstm-fp16", "gru-fp16"])
def test_per_example_gradients_under_a_16_bit_policy(build, policy, layer_level,
                                                     restore_policy):
    keras.config.set_dtype_policy("float32")
    _, layers32, _, loop32, _ = _per_example(build)
    if not layer_level:
        keras.config.set_dtype_policy(policy)
    reg, layers, got, loop, batch = _per_example(build, policy if layer_level else None)
    assert layers == layers32 and "generic" not in dict(layers), reg.summary()
    assert all(g.dtype == tf.float32 for g in got)
    names = [v.name for v in reg.variables]
    _close(got, loop, TOL[policy], names)
    _close(got, loop32, TOL[policy], names)
    _close([tf.reduce_mean(g, 0) for g in got], batch, TOL[policy], names)


def _data(n=24):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 6)).astype("float32"), (np.arange(n) % 3).astype("int32")


def _mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3)])


def test_kfac_model_under_mixed_float16_keeps_its_optimizer(restore_policy, tmp_path):
    """Keras's ``compile`` wrapped K-FAC's shim optimizer in a
    ``LossScaleOptimizer`` under mixed_float16: it scaled nothing (the shim
    applies no gradient), hid ``kmodel.optimizer.kfac`` (AttributeError) and
    moved the checkpoint's K-FAC state under ``inner_optimizer``. ``fit``
    trains (2 epochs, no skipped step), as does ``kg.DPModel.fit``."""
    keras.config.set_dtype_policy("mixed_float16")
    x, y = _data()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    km = kg.KFACModel(_mlp(), loss=loss, learning_rate=0.05, damping=1e-2)
    km.compile(metrics=["accuracy"])
    assert isinstance(km.optimizer, kg.keras_optimizer.KFACKerasOptimizer)
    history = km.fit(x, y, batch_size=8, epochs=2, verbose=0).history["loss"]
    assert km.optimizer.kfac is km.kfac and int(km.kfac.skipped_steps) == 0
    assert history[1] < history[0], history
    path = str(tmp_path / "mlp.weights.h5")
    km.save_weights(path)
    again = kg.KFACModel(_mlp(), loss=loss, learning_rate=0.05, damping=1e-2)
    again.compile()
    again.load_weights(path)
    state = km.optimizer.kfac_variables(km.model.variables)
    pending = again.optimizer._pending_kfac_state
    assert pending is not None and len(pending) == len(state)
    for v, p in zip(state, pending):
        np.testing.assert_array_equal(v.numpy(), p)

    dp = kg.DPModel(_mlp(), loss=loss, l2_norm_clip=1.0, noise_multiplier=0.3,
                    num_examples=len(x), batch_size=8)
    dp.compile(optimizer=keras.optimizers.SGD(0.5))
    before = [v.numpy() for v in dp.model.trainable_variables]
    dp.fit(x, y, batch_size=8, epochs=2, verbose=0)
    after = [v.numpy() for v in dp.model.trainable_variables]
    assert all(np.all(np.isfinite(a)) for a in after)
    assert max(np.abs(a - b).max() for a, b in zip(after, before)) > 1e-3
