"""A model that reads a lookup table (Keras ``StringLookup`` or
``IntegerLookup`` inside the model, on raw features). The table is a
captured resource other than a variable: the re-run graph captures it too
(before: "You must feed a value for placeholder ... table_handle"), and each
lookup's value is reshaped as its keys (the handle's shape data does not
survive the GraphDef: before, every shape after the lookup was unknown and
the embedding's rule stopped on it, and ``kfac-rewrite`` failed to save).
Per-example gradients equal one-example tapes, and K-FAC, DP-SGD and
``KFACModel.fit`` train."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg

WORDS = np.array([["red", "blue", "?"], ["green", "red", "red"], ["blue", "blue", "green"],
                  ["?", "green", "red"], ["red", "red", "blue"], ["green", "?", "?"]])
LABELS = np.array([0, 1, 1, 0, 0, 1])


def _model():
    keras.utils.set_random_seed(0)
    words = keras.Input((3,), dtype="string")
    sizes = keras.Input((1,), dtype="int64")
    h = keras.layers.Embedding(4, 3)(keras.layers.StringLookup(
        vocabulary=["red", "green", "blue"])(words))
    s = keras.layers.Embedding(4, 2)(keras.layers.IntegerLookup(vocabulary=[3, 7, 9])(sizes))
    h = keras.layers.Concatenate()([keras.layers.GlobalAveragePooling1D()(h),
                                    keras.layers.Flatten()(s)])
    return keras.Model([words, sizes], keras.layers.Dense(2)(h))


def _args():
    return (tf.constant(WORDS), tf.constant([[3], [7], [9], [5], [3], [9]], tf.int64),
            tf.constant(LABELS))


def test_tables_in_the_model_are_read_per_example():
    model = _model()

    @kg.auto_register
    def loss_fn(words, sizes, y):
        logits = model([words, sizes])
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    args = _args()
    reg = loss_fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == ["embedding", "embedding", "dense"]
    report = kg.verify(loss_fn, *args, examples=6)
    assert report.passed, report.table()
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(5)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0
    dp = kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0)
    assert np.isfinite(float(dp.step(*args)))


def test_kfac_model_fit_on_raw_strings():
    model = kg.KFACModel(_model(), loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    model.compile()
    words, sizes, y = _args()
    history = model.fit([words, sizes], y, batch_size=6, epochs=5, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


class _Trainable(tf.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.string),
                                  tf.TensorSpec([None, 1], tf.int64),
                                  tf.TensorSpec([None], tf.int64)])
    def loss(self, words, sizes, y):
        logits = self.model([words, sizes])
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))


def test_rewritten_saved_model_with_tables_trains_without_the_library(tmp_path):
    """``kfac-rewrite`` of a SavedModel whose function reads the tables (the
    lookups inside its called functions, the batch known at run time): the
    rewritten model's per-example gradients equal the in-process ones and
    its K-FAC steps lower the loss."""
    from tools import kfac_rewrite
    model = _model()
    tf.saved_model.save(_Trainable(model), str(tmp_path / "model"))
    kfac_rewrite.main(["kfac-rewrite", "--input", str(tmp_path / "model"), "--function", "loss",
                       "--output", str(tmp_path / "trained")])
    args = _args()
    want = kg.per_example_gradients(kg.auto_register(
        lambda w, s, y: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, model([w, s])))), *args)
    loaded = tf.saved_model.load(str(tmp_path / "trained"))
    for got, w in zip(loaded.per_example_gradients(*args), want):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-7)
    losses = [float(loaded.kfac_step(*args)) for _ in range(4)]
    assert losses[-1] < losses[0]


def test_text_vectorization_in_the_model():
    """``TextVectorization`` (string splitting, a table, ragged ids padded to
    ``output_sequence_length``) on raw text: its ids ``[?, 5]`` lead with the
    examples (the embedding's kind, not generic), and every check passes."""
    texts = tf.constant(["the cat sat", "a dog ran far away", "the dog",
                         "cats and dogs play together now", "sat", "a cat ran"])
    keras.utils.set_random_seed(0)
    vectorize = keras.layers.TextVectorization(max_tokens=20, output_sequence_length=5)
    vectorize.adapt(texts)
    embed, head = keras.layers.Embedding(20, 4), keras.layers.Dense(2)

    @kg.auto_register
    def loss_fn(x, y):
        logits = head(tf.reduce_mean(embed(vectorize(x)), 1))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    args = (texts, tf.constant(LABELS))
    assert [layer.kind for layer in loss_fn.registration(*args).layers] == ["embedding", "dense"]
    report = kg.verify(loss_fn, *args, examples=6)
    assert report.passed, report.table()


def test_text_padded_to_the_batchs_longest_is_refused_by_dp_sgd():
    """``TextVectorization`` without ``output_sequence_length`` pads the ids to
    the batch's longest text: an unmasked mean over the positions then
    divides each example's sum by the others' lengths (example 0's gradient
    alone differs from its gradient in the batch), so clipping bounds no
    one example's influence. The registration names the padding op and
    DP-SGD refuses in one line; with a fixed length it runs."""
    texts = tf.constant(["the cat sat", "a dog ran far away", "the dog",
                         "cats and dogs play together now", "sat", "a cat ran"])
    labels = tf.constant(LABELS)
    for length in (None, 5):
        keras.utils.set_random_seed(0)
        vectorize = keras.layers.TextVectorization(max_tokens=20,
                                                   output_sequence_length=length)
        vectorize.adapt(texts)
        embed, head = keras.layers.Embedding(20, 4), keras.layers.Dense(2)

        def loss(x, y):
            logits = head(tf.reduce_mean(embed(vectorize(x)), 1))
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

        loss_fn = kg.auto_register(loss)
        reg = loss_fn.registration(texts, labels)
        in_batch = kg.per_example_gradients(loss_fn, texts, labels)[1][0]
        alone = kg.per_example_gradients(loss_fn, texts[:1], labels[:1])[1][0]
        dp = kg.DPSGD(kg.auto_register(loss), learning_rate=0.1, l2_norm_clip=1.0,
                      noise_multiplier=0.5)
        if length is None:
            assert [n.split("/")[-1] for n in reg.padded_to_longest] == ["RaggedTensorToTensor"]
            assert "padded to the batch's longest row" in reg.summary()
            report = kg.verify(loss_fn, texts, labels)  # its one-example check fails, and says why
            assert not report.passed and any("pads each example" in n for n in report.notes)
            assert np.max(np.abs(in_batch - alone)) > 1e-3
            with pytest.raises(kg.KfacGraphError, match=r"pads each example to the batch's "
                               r"longest .*output_sequence_length"):
                dp.step(texts, labels)
        else:
            assert reg.padded_to_longest == ()
            np.testing.assert_allclose(in_batch, alone, rtol=1e-5, atol=1e-7)
            assert np.isfinite(float(dp.step(texts, labels)))
