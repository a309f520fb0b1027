"""Convolution kernels read as parts along their output channels.

Keras's ConvLSTM cells split their kernel `[k, k, Cin, 4F]` (and the
recurrent one) into the four gates' `[k, k, Cin, F]` and convolve with each.
A use of such a part is a use of the whole kernel whose output gradient is
zero outside the part's channels (`kfac_graph/layers/parts.py`): the pass
registers the kernel as a conv2d layer (one use per gate and step) and pads
`g`. Before, both kernels were generic ("no layer pattern matches its use
by Conv2D"). Float64, against a loop of one-example gradients and the
brute-force Fisher; `kg.KFAC` trains ConvLSTM1D and ConvLSTM2D.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_checks import block_matrix
from fisher_reference import brute_fisher, softmax_fisher
from per_example_reference import assert_matches_loop

B, S, CIN, F, C = 3, 5, 2, 2, 2


def _gated():
    """Two gates from one kernel `[3, 3, Cin, 2F]`, split along its outputs."""
    rng = np.random.default_rng(0)
    kernel = tf.Variable(rng.normal(size=(3, 3, CIN, 2 * F)) * 0.5, name="kernel")
    head = tf.Variable(rng.normal(size=(S * S * F, C)) * 0.3, name="head")

    def logits(params, x):
        gate, value = tf.split(params[0], 2, axis=-1)
        h = (tf.sigmoid(tf.nn.conv2d(x, gate, 1, "SAME"))
             * tf.tanh(tf.nn.conv2d(x, value, 1, "SAME")))
        return tf.reshape(h, [-1, S * S * F]) @ head

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, logits([kernel], x)))

    args = (tf.constant(rng.normal(size=(B, S, S, CIN))), tf.constant([0, 1, 1]))
    return loss_fn, logits, kernel, args


@pytest.mark.parametrize("approximation", ["full", "diagonal"])
def test_kernel_parts_match_loop_and_brute_force(approximation):
    loss_fn, logits, kernel, args = _gated()
    reg = assert_matches_loop(loss_fn, args)
    (layer,) = [layer for layer in reg.layers if layer.variables[0] is kernel]
    assert layer.kind == "conv2d" and layer.uses == 2
    assert layer.use_attrs[0]["kernel_shape"] == (3, 3, CIN, 2 * F)
    want = brute_fisher(lambda p, x: logits(p, x), [kernel], args[0], softmax_fisher)
    if approximation == "diagonal":
        want = np.diag(np.diag(want))
    np.testing.assert_allclose(block_matrix(loss_fn, args, layer, "conv2d", approximation),
                               want, rtol=1e-8, atol=1e-12)


# under -m slow; the kernel parts' blocks and rules stay in the fast set
# (test_kernel_parts_match_loop_and_brute_force)
@pytest.mark.slow
@pytest.mark.parametrize("rank", [1, 2])
def test_keras_conv_lstm(rank):
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    layer, shape = ((keras.layers.ConvLSTM1D(3, 3, padding="same"), (4, 6, 2)) if rank == 1
                    else (keras.layers.ConvLSTM2D(2, 3, padding="same", return_sequences=True),
                          (3, 5, 5, 2)))
    model = keras.Sequential([keras.Input(shape), layer, keras.layers.Flatten(),
                              keras.layers.Dense(2)])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    args = (tf.constant(np.random.default_rng(0).normal(size=(3, *shape))),
            tf.constant([0, 1, 1]))
    reg = assert_matches_loop(loss_fn, args)
    kinds = {v.name.split("/")[-1].split(":")[0]: layer.kind
             for layer in reg.layers for v in layer.variables if "conv_lstm" in v.name}
    assert kinds == {"kernel": "conv2d", "recurrent_kernel": "conv2d",
                     "bias": "scale_and_shift"}, reg.summary()
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(4)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses
