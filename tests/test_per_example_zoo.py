"""Per-example gradients and norms on the registration zoo, against a
brute-force loop of one-example GradientTape gradients."""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
import zoo
from per_example_reference import one_example_loop

# Cases where "example i's own gradient" differs from the one-example loop:
# batch norm in training mode couples the examples through the batch
# statistics, and a weight penalty is not part of any example's term.
COUPLED = {"batchnorm_training": "batch statistics couple the examples",
           "weight_penalty": "the penalty belongs to no example"}
CASES = [c for c in zoo.CASES if c.name not in COUPLED]
JIT_CASES = {"seq_mlp", "conv_stride2", "depthwise", "embedding", "tied_transpose_b",
             "rnn_unrolled", "generic_sin", "dense_sequence"}


def _tolerance(case):
    return 3e-2 if case.name == "mixed_float16" else 2e-4


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_per_example_gradients_equal_a_loop(case):
    built = case.build()
    fn = kg.auto_register(built.loss_fn)
    args = built.args
    reg = fn.registration(*args)
    got = kg.per_example_gradients(fn, *args)
    want = one_example_loop(built.loss_fn, args, reg.variables)
    rtol = _tolerance(case)
    assert len(got) == len(reg.variables)
    for g, w, v in zip(got, want, reg.variables):
        assert g.shape == (args[0].shape[0], *v.shape), v.name
        scale = float(tf.reduce_max(tf.abs(w))) + 1e-6
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale, err_msg=v.name)
    norms = kg.per_example_gradient_norms(fn, *args)
    want_norms = np.sqrt(sum(np.sum(np.reshape(w, (w.shape[0], -1)) ** 2, 1) for w in want))
    np.testing.assert_allclose(norms, want_norms, rtol=rtol * 5)
    with tf.GradientTape() as tape:
        loss = built.loss_fn(*args)
    batch = tape.gradient(loss, list(reg.variables))
    combine = np.mean if reg.loss.reduction == "mean" else np.sum
    for g, b in zip(got, batch):
        b = tf.convert_to_tensor(b)
        np.testing.assert_allclose(combine(g, axis=0), b, rtol=rtol,
                                   atol=rtol * (float(tf.reduce_max(tf.abs(b))) + 1e-6))


@pytest.mark.parametrize("case", [c for c in CASES if c.name in JIT_CASES], ids=lambda c: c.name)
def test_per_example_gradients_under_xla(case):
    built = case.build()
    fn = kg.auto_register(built.loss_fn)
    args = built.args
    eager = kg.per_example_gradients(fn, *args)

    @tf.function(jit_compile=True)
    def compiled(*a):
        return kg.per_example_gradients(fn, *a), kg.per_example_gradient_norms(fn, *a)

    grads, norms = compiled(*args)
    for g, e in zip(grads, eager):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-6)
    assert norms.shape == (args[0].shape[0],)


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("name", ["conv_stride2", "raw_mlp_sum_over_batch", "embedding"])
def test_batch_of_one_and_odd(name, batch):
    built = {c.name: c for c in CASES}[name].build()
    fn = kg.auto_register(built.loss_fn)
    args = built.make_args(batch)
    reg = fn.registration(*args)
    got = kg.per_example_gradients(fn, *args)
    for g, w in zip(got, one_example_loop(built.loss_fn, args, reg.variables)):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-6)


def test_float64_matches_to_1e6():
    rng = np.random.default_rng(0)
    conv = tf.Variable(rng.normal(size=(3, 3, 2, 3)), name="conv")
    depth = tf.Variable(rng.normal(size=(3, 3, 3, 2)), name="depth")
    scale = tf.Variable(rng.normal(size=(6,)), name="scale")
    w = tf.Variable(rng.normal(size=(6, 4)), name="w")
    b = tf.Variable(rng.normal(size=(4,)), name="b")

    def loss_fn(x, y):
        h = tf.nn.conv2d(x, conv, 2, "SAME")
        h = tf.nn.depthwise_conv2d(tf.tanh(h), depth, [1, 1, 1, 1], "VALID")
        h = tf.reduce_mean(h, axis=[1, 2]) * scale
        return tf.reduce_sum(tf.math.squared_difference(tf.matmul(h, w) + b, y))

    x = tf.constant(rng.normal(size=(3, 7, 7, 2)))
    y = tf.constant(rng.normal(size=(3, 4)))
    fn = kg.auto_register(loss_fn)
    reg = fn.registration(x, y)
    assert [layer.kind for layer in reg.layers] == ["conv2d", "depthwise_conv2d",
                                                     "scale_and_shift", "dense"]
    got = kg.per_example_gradients(fn, x, y)
    for g, want in zip(got, one_example_loop(loss_fn, (x, y), reg.variables)):
        np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-10)


def test_nchw_bias_is_per_channel():
    rng = np.random.default_rng(1)
    b = tf.Variable(rng.normal(size=(3,)), name="b")

    def loss_fn(x):
        h = tf.nn.bias_add(tf.tanh(x), b, data_format="NCHW")
        return tf.reduce_sum(tf.square(tf.tanh(h)))

    x = tf.constant(rng.normal(size=(3, 3, 2, 2)))
    fn = kg.auto_register(loss_fn)
    reg = fn.registration(x)
    got = kg.per_example_gradients(fn, x)
    for g, want in zip(got, one_example_loop(loss_fn, (x,), reg.variables)):
        np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-10)
