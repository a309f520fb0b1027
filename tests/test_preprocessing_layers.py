"""Keras preprocessing layers inside the model, feeding a dense layer.

``Discretization`` then ``CategoryEncoding`` (multi-hot, one-hot, counts)
give a tensor whose last axis the trace does not know (a bincount's width
is a run-time value), so the Dense after them read ``[B, None]``: the pass
registered it, then per-example norms stopped on ``None + int`` and the
K-FAC statistics on ``reshape(a, [-1, None])``. The width is the kernel's
``d_in``; per-example gradients, the exact Fisher and K-FAC run on it.
Counts run with ``-m slow`` (multi-hot's bincount in the fast set).
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from per_example_reference import assert_matches_loop

B = 6


@pytest.fixture
def float64():
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")


# counts under -m slow: the same ops as multi_hot's (a DenseBincount of run-time
# width, binary_output off), which stays in the fast set beside one_hot's OneHot
@pytest.mark.parametrize("mode", ["multi_hot", "one_hot",
                                  pytest.param("count", marks=pytest.mark.slow)])
def test_dense_on_category_encoding(float64, mode):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    inp = keras.Input((3,) if mode != "one_hot" else (1,))
    bins = keras.layers.Discretization(bin_boundaries=[-0.5, 0.0, 0.5])(inp)
    coded = keras.layers.CategoryEncoding(num_tokens=4, output_mode=mode)(bins)
    h = keras.layers.Concatenate()([keras.layers.Dense(3, activation="tanh")(coded), inp])
    model = keras.Model(inp, keras.layers.Dense(4)(h))

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))
    x = tf.constant(rng.normal(size=(B, inp.shape[-1])))
    y = tf.constant(rng.integers(0, 4, B))
    reg = assert_matches_loop(loss_fn, (x, y), rtol=1e-10, atol=1e-12)
    assert [layer.kind for layer in reg.layers] == ["dense", "dense"], reg.summary()

    grads = kg.per_example_gradients(loss_fn, x, y)
    want = np.sqrt(sum(np.sum(np.reshape(g, (B, -1)) ** 2, axis=1) for g in grads))
    np.testing.assert_allclose(kg.per_example_gradient_norms(loss_fn, x, y), want, rtol=1e-10)
    report = kg.verify(loss_fn, x, y, estimation_mode="exact", examples=2, directions=1)
    assert report.passed and not report.failures, report.table()

    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(x, y)) for _ in range(3)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses
