"""Joined heads whose blocks are their likelihoods' Fishers
(``LossSpec.likelihood_blocks``, ``kfac_graph/fisher/ggn_blocks.py``).

BERT's pre-training loss, a masked-LM head over a word-piece vocabulary
beside a next-sentence head, joins two outputs. Their loss Hessian was
formed only from backward passes, ``V`` per masked-LM position's block,
so beyond ``MAX_CLASSES`` (256) classes it had no blocks within the budget:
the loss stayed opaque and ``kg.KFAC`` stopped. A head the loss pass reads
as categorical now takes no pass: its block is ``w_ip (diag(q) - q q^T)``
per position, ``w_ip`` its term's weight in the example's loss. Checked
(float64) against brute-force Gauss-Newton blocks beside a Huber head's
Hessian block, against the Hessian's blocks at ``V = 300`` with Keras's
``sample_weight``, and trained on keras-hub's BERT with its own masked-LM
head."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from joined_reference import assert_joined_blocks
from kfac_graph.fisher.ggn_blocks import block_curvature
from kfac_graph.taps import LayerTaps
from passes import loss_output

ce = tf.nn.sparse_softmax_cross_entropy_with_logits
B = 3


def _model(vocabulary, positions=None):
    keras.utils.set_random_seed(0)
    ids = keras.Input((positions,), dtype="int32")
    h = keras.layers.Dense(5, activation="tanh", name="trunk")(
        keras.layers.Embedding(vocabulary, 4)(ids))
    return keras.Model(ids, [keras.layers.Dense(vocabulary, name="tokens")(h),
                             keras.layers.Dense(2, name="pair")(h[:, 0])])


def _batch(vocabulary, length, seed=0):
    rng = np.random.default_rng(seed)
    ids = tf.constant(rng.integers(0, vocabulary, (B, length)), tf.int32)
    mask = np.ones((B, length))
    mask[1, -1] = mask[2, 0] = 0.0  # padded slots
    return ids, tf.constant(rng.integers(0, vocabulary, (B, length)), tf.int32), tf.constant(mask)


def _keras_loss(zs, x, y, m):
    """Keras's masked-LM loss (``sample_weight``, a mean over every slot)
    plus the next-sentence head's cross-entropy."""
    tokens = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return tokens(y, zs[0], sample_weight=m) + tf.reduce_mean(ce(y[:, 0] % 2, zs[1]))


def _registered(vocabulary, on_outputs=_keras_loss):
    model = _model(vocabulary)
    fn = kg.auto_register(lambda x, y, m: on_outputs(model(x), x, y, m))
    return model, fn


def test_a_word_piece_masked_lm_beside_a_pair_head_is_read_in_likelihood_blocks(keras_float64):
    """``V = 300``: the likelihoods' blocks (no backward pass) equal the
    loss's Hessian blocks formed by 302 passes (products and diagonal); the
    masked slots weigh nothing, and the samples' squares average to them."""
    model, fn = _registered(300)
    args = _batch(300, 2)
    reg = fn.registration(*args)
    assert (reg.loss.kind, reg.loss.blocks) == ("ggn", ((600, 300), (2, 2))), reg.summary()
    assert all(reg.loss.likelihood_blocks)
    assert "in blocks 2x(300x300) categorical, 2x2 categorical" in reg.summary()

    @tf.function
    def both():
        taps = LayerTaps.build(reg, args)
        z, blocks = taps.model_output, reg.loss.blocks
        fisher = block_curvature(taps.per_example_loss, z, blocks, taps.block_weights)
        hessian = block_curvature(taps.per_example_loss, z, blocks)
        v = tf.random.stateless_normal([B, 602], [1, 2], dtype=tf.float64)
        squares = tf.map_fn(lambda s: tf.reduce_sum(
            fisher.sample_cotangent(tf.stack([0, s])) * v, -1) ** 2, tf.range(20000),
            fn_output_signature=tf.float64)
        return (fisher.multiply_fisher(v), hessian.multiply_fisher(v),
                fisher.fisher_diagonal(), hessian.fisher_diagonal(),
                tf.reduce_mean(squares, 0))
    fv, hv, fd, hd, mean_square = (t.numpy() for t in both())
    np.testing.assert_allclose(fv, hv, atol=1e-12)
    np.testing.assert_allclose(fd, hd, atol=1e-12)
    assert fd[1, 300:600].max() == 0 and fd[2, :300].max() == 0 and fd[0].min() > 0  # masked
    v = tf.random.stateless_normal([B, 602], [1, 2], dtype=tf.float64).numpy()
    np.testing.assert_allclose(mean_square, np.sum(v * fv, -1), rtol=0.05)


def test_a_categorical_block_beside_a_hessian_block(keras_float64, monkeypatch):
    """A Huber head's block is its Hessian (one pass), the masked-LM head's
    its Fisher (none); the budget lowered so that 35 + 2 values take blocks."""
    monkeypatch.setattr(loss_output, "MAX_CLASSES", 10)
    huber = keras.losses.Huber()

    def loss(zs, x, y, m):
        tokens = tf.reduce_sum(ce(y, zs[0]) * m) / tf.cast(tf.size(m), m.dtype)
        return tokens + huber(tf.cast(y[:, :2] % 2, zs[1].dtype), zs[1])
    model, fn = _registered(7, loss)
    reg = assert_joined_blocks(
        fn, _batch(7, 5), [model.get_layer(n) for n in ("trunk", "tokens", "pair")],
        lambda x, y, m: model(x), loss, position_columns="separate")
    assert reg.loss.blocks == ((35, 7), (2, 1)), reg.loss
    assert bool(reg.loss.likelihood_blocks[0]) and not reg.loss.likelihood_blocks[1]


def test_kfac_steps_on_likelihood_blocks_equal_those_on_the_whole_hessian(
        keras_float64, monkeypatch):
    """One masked-LM position of 40 classes beside the pair head (42
    values): with the budget at 50 the whole Hessian is formed (42 passes,
    one column per value), at 41 the likelihoods' blocks (none); with no
    positions to share columns, 3 exact-mode default steps agree (float64)."""
    runs = []
    for budget in (50, 41):
        monkeypatch.setattr(loss_output, "MAX_CLASSES", budget)
        model, fn = _registered(40)
        batches = [_batch(40, 1)] * 3
        runs.append((fn.registration(*batches[0]).loss, kg.KFAC(fn, estimation_mode="exact"),
                     model))
        runs[-1] += ([float(runs[-1][1].step(*b)) for b in batches],)
    (whole, _, model_w, losses_w), (blocks, _, model_b, losses_b) = runs
    assert whole.blocks == () and blocks.blocks == ((40, 40), (2, 2))
    np.testing.assert_allclose(losses_b, losses_w, rtol=1e-12)
    for a, b in zip(model_b.trainable_variables, model_w.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-13)
    assert losses_w[-1] < losses_w[0], losses_w


def _distilled(zs, x, y, m):
    """A cross-entropy with the labels beside one with a teacher's soft
    labels, both on the same logits (a distillation at temperature 1)."""
    teacher = tf.nn.softmax(tf.cast(tf.one_hot(x, zs[0].shape[-1]), zs[0].dtype) * 2.0)
    return (tf.reduce_mean(ce(y, zs[0])) + 0.5 * tf.reduce_mean(
        tf.nn.softmax_cross_entropy_with_logits(teacher, zs[0])))


@pytest.mark.parametrize("vocabulary", [7, 300])
def test_two_cross_entropies_on_one_output_weigh_one_block(keras_float64, monkeypatch,
                                                          vocabulary):
    """Both heads read the masked-LM logits: one block, the Fisher with
    their weights summed (before: the Hessian, 300 passes at 300 classes,
    so ``opaque``); at 7 classes (the budget lowered to 10) every exact
    block equals brute force, at 300 the defaults train."""
    monkeypatch.setattr(loss_output, "MAX_CLASSES", 10 if vocabulary == 7 else 256)
    def loss(zs, x, y, m):
        return _distilled(zs, x, y, m) + tf.reduce_mean(ce(y[:, 0] % 2, zs[1]))
    model, fn = _registered(vocabulary, loss)
    args = _batch(vocabulary, 5 if vocabulary == 7 else 2)
    reg = fn.registration(*args)
    assert reg.loss.blocks == ((args[0].shape[1] * vocabulary, vocabulary), (2, 2)), reg.summary()
    assert [len(t) for t in reg.loss.likelihood_blocks] == [2, 1]
    if vocabulary == 7:
        assert_joined_blocks(
            fn, args, [model.get_layer(n) for n in ("trunk", "tokens", "pair")],
            lambda x, y, m: model(x), loss, position_columns="separate")
        return
    opt = kg.KFAC(fn)
    losses = [float(opt.step(*args)) for _ in range(5)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses


@pytest.mark.parametrize("classes", [7, pytest.param(300, marks=pytest.mark.slow)])
def test_a_class_head_whose_logits_feed_a_regression_head(keras_float64, monkeypatch, classes):
    """A class head and a regression head on its logits (before: 302 values
    per example, opaque): the class block is its Fisher, the regression's its
    Hessian; at 7 classes (the budget lowered to 5) both equal brute force,
    at 300 the defaults train."""
    monkeypatch.setattr(loss_output, "MAX_CLASSES", 5 if classes == 7 else 256)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    logits = keras.layers.Dense(classes, activation="tanh", name="classes")(inputs)
    model = keras.Model(inputs, [logits, keras.layers.Dense(2, name="value")(logits)])

    def on_outputs(zs, x, y, t):
        return tf.reduce_mean(ce(y, zs[0])) + 0.5 * tf.reduce_mean(tf.square(zs[1] - t))
    fn = kg.auto_register(lambda x, y, t: on_outputs(model(x), x, y, t))
    rng = np.random.default_rng(0)
    args = (tf.constant(rng.normal(size=(6, 4))), tf.constant(rng.integers(0, classes, 6)),
            tf.constant(rng.normal(size=(6, 2))))
    reg = fn.registration(*args)
    assert reg.loss.blocks == ((classes, classes), (2, 1)), reg.summary()
    assert [bool(t) for t in reg.loss.likelihood_blocks] == [True, False]
    if classes == 7:
        assert_joined_blocks(fn, args, [model.get_layer(n) for n in ("classes", "value")],
                             lambda x, y, t: model(x), on_outputs, position_columns="separate")
        return
    opt = kg.KFAC(fn)
    losses = [float(opt.step(*args)) for _ in range(5)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses


def test_kfac_defaults_train_a_word_piece_pre_training_loss_at_run_time_lengths():
    """``V = 300`` (before: opaque, ``kg.KFAC`` stopped), traced at
    ``[None, None]``: the masked-LM block's positions are read at run time."""
    model = _model(300)
    unknown = [tf.TensorSpec([None, None], tf.int32)] * 2 + [
        tf.TensorSpec([None, None], tf.float64)]
    fn = kg.auto_register(tf.function(lambda x, y, m: _keras_loss(model(x), x, y, m),
                                      input_signature=unknown))
    reg = fn.registration(*unknown)
    assert (reg.loss.kind, reg.loss.blocks) == ("ggn", ((None, 300), (2, 2))), reg.summary()
    opt = kg.KFAC(fn)
    batches = [_batch(300, t, seed=t) for t in (6, 8)]
    first = [float(fn(*b)) for b in batches]
    for _ in range(5):
        for b in batches:
            opt.step(*b)
    assert all(float(fn(*b)) < f for b, f in zip(batches, first)), first
    assert int(opt.skipped_steps) == 0


def test_keras_hub_bert_pre_training_heads(keras_float64):
    """keras-hub's ``BertBackbone`` with its ``MaskedLMHead`` tied to the
    token table (logits gathered at the mask positions, Keras's
    ``sample_weight`` on them) and a next-sentence head on the pooled
    output, over 300 word pieces."""
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    v = 300
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=v, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16,
        max_sequence_length=8, dropout=0.0)
    head = keras_hub.layers.MaskedLMHead(
        vocabulary_size=v, token_embedding=backbone.token_embedding, activation=None)
    pair = keras.layers.Dense(2, name="pair")
    rng = np.random.default_rng(0)
    ids = rng.integers(1, v, (B, 8)).astype("int32")
    positions = np.stack([rng.choice(6, 3, replace=False) for _ in range(B)]).astype("int32")
    weights = np.ones((B, 3))
    weights[1, -1] = 0.0
    x = {"token_ids": tf.constant(ids), "segment_ids": tf.zeros_like(ids),
         "padding_mask": tf.ones_like(ids)}
    tokens = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @kg.auto_register
    def loss(x, positions, y, w, sentence):
        out = backbone(x)
        logits = head(out["sequence_output"], mask_positions=positions)
        return (tokens(y, logits, sample_weight=w)
                + tf.reduce_mean(ce(sentence, pair(out["pooled_output"]))))

    args = (x, tf.constant(positions), tf.constant(np.take_along_axis(ids, positions, 1)),
            tf.constant(weights), tf.constant([0, 1, 1]))
    reg = loss.registration(*args)
    assert (reg.loss.kind, reg.loss.blocks) == ("ggn", ((3 * v, v), (2, 2))), reg.summary()
    assert all(reg.loss.likelihood_blocks)
    opt = kg.KFAC(loss)
    losses = [float(opt.step(*args)) for _ in range(6)]
    assert losses[-1] < 0.8 * losses[0], losses
    assert int(opt.skipped_steps) == 0
