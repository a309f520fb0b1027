"""A lookup of ids that do not depend on the data (``table[range(T)]``)
added to every example: read as a position embedding when the pass sees
the rows reach the sum (``pos(range(T))[None]``: the whole-axis slice that
adds the unit axis is transparent), else it has no example axis. With
T == B its rows would pass for examples; a lookup the pass does not read so
must be generic (exact), never the embedding rule reading position t as
example t."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from tests.per_example_reference import one_example_loop


@pytest.mark.parametrize("form", ["unit_axis", "scaled"])
def test_position_lookup_is_exact_when_positions_equal_the_batch(form):
    keras.utils.set_random_seed(0)
    steps = batch = 4
    tok, pos = keras.layers.Embedding(11, 5), keras.layers.Embedding(steps, 5)
    head = keras.layers.Dense(11)

    def loss(x, y):
        rows = pos(tf.range(steps)) if form == "unit_axis" else pos(tf.range(steps)) * 2.0
        h = tok(x) + rows[None]
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, head(h)))

    fn = kg.auto_register(loss)
    x = tf.constant(np.random.default_rng(0).integers(0, 11, (batch, steps)), tf.int32)
    reg = fn.registration(x, x)
    (layer,) = [layer for layer in reg.layers if tuple(layer.variables[0].shape) == (steps, 5)]
    if form == "unit_axis":
        assert layer.kind == "embedding" and layer.use_attrs[0]["ids_broadcast"], reg.summary()
    else:
        assert layer.kind == "generic" and "do not depend on the data" in layer.reason, (
            reg.summary())
    got = kg.per_example_gradients(fn, x, x)
    for g, w in zip(got, one_example_loop(loss, (x, x), reg.variables)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_position_ids_held_in_a_variable():
    """keras-hub's CLIP keeps its position ids in a non-trainable variable
    ``[1, N]``: still ids (not a product of weights), so the table is a
    position embedding; float64 against a loop (ids that are not a range,
    to tell rows apart)."""
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    steps = batch = 4
    pos, head = keras.layers.Embedding(steps, 3), keras.layers.Dense(2)
    ids = tf.Variable([[2, 0, 3, 3]], trainable=False, name="position_ids")

    def loss(x, y):
        h = tf.tanh(x + pos(ids))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, head(tf.reduce_mean(h, axis=1))))

    fn = kg.auto_register(loss)
    x = tf.constant(np.random.default_rng(1).normal(size=(batch, steps, 3)))
    y = tf.constant([0, 1, 1, 0])
    reg = fn.registration(x, y)
    assert [layer.kind for layer in reg.layers] == ["embedding", "dense"], reg.summary()
    assert reg.layers[0].use_attrs[0]["ids_broadcast"]
    got = kg.per_example_gradients(fn, x, y)
    for g, w in zip(got, one_example_loop(loss, (x, y), reg.variables)):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.slow  # a batch of one on keras-hub's PositionEmbedding: test_keras_hub.py's
def test_a_batch_of_one_registers_as_any_other_batch():
    """keras-hub's ``PositionEmbedding`` (``broadcast_to(table[:T], shape(h))``
    added to the token embeddings): on a static batch of one the token
    lookup's ids ``[1, T]`` read as position ids with a unit axis standing
    for the batch (ViT's), so it took the sum from the position table,
    which went generic, and ``KFACModel.fit``'s last batch of one stopped on
    "these arguments register different layers". Ids that are the data's
    are no position ids."""
    keras.utils.set_random_seed(0)
    steps, vocab = 6, 11

    class Positions(keras.layers.Layer):
        def build(self, shape):
            self.table = self.add_weight(shape=(steps, shape[-1]))

        def call(self, h):
            return h + keras.ops.broadcast_to(self.table[:keras.ops.shape(h)[1]],
                                              keras.ops.shape(h))

    ids = keras.Input((steps,), dtype="int32")
    model = keras.Model(ids, keras.layers.Dense(vocab)(
        Positions()(keras.layers.Embedding(vocab, 4)(ids))))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @kg.auto_register
    def loss_fn(x, y):
        return loss(y, model(x))

    x = np.random.default_rng(0).integers(0, vocab, (5, steps)).astype("int32")
    y = np.roll(x, -1, 1)
    kinds = [[layer.kind for layer in loss_fn.registration(tf.constant(x[:b]),
                                                           tf.constant(y[:b])).layers]
             for b in (4, 1)]
    assert kinds[0] == kinds[1] and "generic" not in kinds[0], kinds
    got = kg.per_example_gradients(loss_fn, tf.constant(x[:1]), tf.constant(y[:1]))
    reg = loss_fn.registration(tf.constant(x[:1]), tf.constant(y[:1]))
    for g, w in zip(got, one_example_loop(loss_fn, (tf.constant(x[:1]), tf.constant(y[:1])),
                                          reg.variables)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    fitted = kg.KFACModel(model, loss=loss)
    fitted.compile()
    history = fitted.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
