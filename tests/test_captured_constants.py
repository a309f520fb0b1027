"""A loss that closes over a constant: ``tf.function`` captures an eager
tensor of more than a few elements by reference (a placeholder fed at each
call), and a Keras functional model keeps what it computed at construction
that way. The re-run graph holds the value itself (``passes.frontends.
freeze_captured_constants``): per-example gradients equal a loop of
one-example gradients and K-FAC steps run (before: "You must feed a value
for placeholder tensor").
"""
import keras
import numpy as np
import tensorflow as tf

import kfac_graph as kg
from tests.per_example_reference import one_example_loop

F64 = tf.float64


def test_a_closed_over_tensor_is_part_of_the_rerun_graph():
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(6, 4)), dtype=F64)
    mask = tf.constant(rng.normal(size=(50, 6)), F64)  # > 128 elements: captured

    def loss(x, y):
        h = tf.matmul(x * mask[0], w)
        return tf.reduce_mean(tf.reduce_sum(tf.square(h - y), axis=1))

    fn = kg.auto_register(loss)
    x, y = tf.constant(rng.normal(size=(5, 6)), F64), tf.constant(rng.normal(size=(5, 4)), F64)
    got = kg.per_example_gradients(fn, x, y)
    want = one_example_loop(loss, (x, y), [w])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-10)


def test_a_keras_functional_models_constant():
    keras.utils.set_random_seed(0)
    steps, width = 6, 30
    ids = keras.Input((steps,), dtype="int32")
    h = keras.layers.Embedding(11, width)(ids) + keras.ops.ones((1, steps, width))
    model = keras.Model(ids, keras.layers.Dense(11)(h))

    def loss(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    fn = kg.auto_register(loss)
    x = tf.constant(np.random.default_rng(0).integers(0, 11, (3, steps)), tf.int32)
    reg = fn.registration(x, x)
    assert not reg.generic_variables
    got = kg.per_example_gradients(fn, x, x)
    want = one_example_loop(loss, (x, x), reg.variables)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
    opt = kg.KFAC(fn)
    first = float(opt.step(x, x))
    for _ in range(4):
        last = float(opt.step(x, x))
    assert last < first
