"""Layers whose input leads with another size than the batch's, on rows the
pass does not follow (``passes.unflatten_rows``).

``tf.map_fn`` over the batch runs a layer once per example on ``[1, d]``;
a siamese tower run once on ``concat([x1, x2], 0)`` reads ``[2 B, d]``. The
dense rule read that first axis as the examples and stopped at the first
step ("leading axis 1, expected the batch 3; this layer form is not
supported") with no way out. Such a use is generic now, with a reason that
says what to write instead, and its per-example gradients equal one-example
tapes; K-FAC and DP-SGD train it."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from per_example_reference import assert_matches_loop

L = keras.layers


def _ce(y, z):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, z))


def _mapped():
    hidden, norm, head = L.Dense(5), L.LayerNormalization(), L.Dense(2)
    return lambda x, y: _ce(y, head(tf.map_fn(lambda xi: norm(hidden(xi[None]))[0], x)))


def _siamese():
    tower, out = L.Dense(5, activation="tanh"), L.Dense(3)

    def loss(x1, x2):
        a, b = tf.split(out(tower(tf.concat([x1, x2], 0))), 2, axis=0)
        return tf.reduce_mean(tf.reduce_sum(tf.square(a - b), -1))
    return loss


@pytest.mark.parametrize("name, make, first", [("map_fn", _mapped, 1), ("siamese", _siamese, 6)])
def test_a_layer_on_other_rows_is_generic_and_exact(name, make, first):
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(3, 4)))
    args = (x, tf.constant([0, 1, 1])) if name == "map_fn" else (
        x, tf.constant(rng.normal(size=(3, 4))))
    fn = kg.auto_register(make())
    reg = fn.registration(*args)
    generic = [layer for layer in reg.layers if layer.kind == "generic"]
    assert len(generic) == 4, reg.summary()
    assert all(f"its input's first axis is {first}, not the batch's 3" in layer.reason
               and "call the layer on the batch, once per input" in layer.reason
               for layer in generic), [layer.reason for layer in generic]
    assert_matches_loop(fn, args, rtol=1e-9)
    opt = kg.KFAC(fn, learning_rate=0.05, damping=0.1)
    losses = [float(opt.step(*args)) for _ in range(4)]
    assert losses[-1] < losses[0], losses
    dp = kg.DPSGD(fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=0.5)
    assert np.isfinite(float(dp.step(*args)))
