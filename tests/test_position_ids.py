"""A lookup of ids that do not depend on the data (``table[range(T)]``)
that the pass does not read as a position embedding (here: a unit batch
axis put in front before the add) has no example axis. With T == B its
rows would pass for examples; it must be generic (exact), never the
embedding rule reading position t as example t."""
import keras
import numpy as np
import tensorflow as tf

import kfac_graph as kg
from tests.per_example_reference import one_example_loop


def test_position_lookup_with_a_unit_axis_is_exact_when_positions_equal_the_batch():
    keras.utils.set_random_seed(0)
    steps = batch = 4
    tok, pos = keras.layers.Embedding(11, 5), keras.layers.Embedding(steps, 5)
    head = keras.layers.Dense(11)

    def loss(x, y):
        h = tok(x) + pos(tf.range(steps))[None]
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, head(h)))

    fn = kg.auto_register(loss)
    x = tf.constant(np.random.default_rng(0).integers(0, 11, (batch, steps)), tf.int32)
    reg = fn.registration(x, x)
    generic = [layer for layer in reg.layers if layer.kind == "generic"]
    assert [tuple(layer.variables[0].shape) for layer in generic] == [(steps, 5)], reg.summary()
    assert "do not depend on the data" in generic[0].reason
    got = kg.per_example_gradients(fn, x, x)
    for g, w in zip(got, one_example_loop(loss, (x, x), reg.variables)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
