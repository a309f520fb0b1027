"""DepthwiseConv1D (any depth multiplier) and SeparableConv1D, which
TensorFlow writes as ExpandDims -> DepthwiseConv2dNative (-> Conv2D) ->
Squeeze, with a kernel variable `[k, C, M]` one unit axis short of the op's
`[1, k, C, M]`; and DepthwiseConv2D with depth multiplier 2.

In float64: per-example gradients and norms against a loop of one-example
GradientTape gradients; the "full" and "diagonal" Fisher blocks against the
brute-force Fisher `(1/B) sum_i J_i^T F_i J_i` from per-example Jacobians;
the Kronecker block against the brute force where it is exact (one example,
one output location) and, in general, entry for entry against the block of
the same layer written as a 2-D DepthwiseConv2D with a `(1, k)` kernel
(whose factors `test_fisher_kron.py` checks against hand-cut patches);
`kg.verify` (its exact Fisher check and `kg.KFAC` training under
`-m slow`).

Keras 3's DepthwiseConv1D and SeparableConv1D have no "causal" padding; the
causal form is written as Keras writes Conv1D's: left zero padding by
`k - 1`, then "valid". Dilated 1-D depthwise convolutions go through
SpaceToBatchND and are not covered here.
"""
import hypothesis
from hypothesis import strategies as st
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_reference import brute_fisher
from kfac_graph import fisher
from per_example_reference import assert_close, one_example_loop

F64 = "float64"
K, LENGTH, CHANNELS, BATCH = 3, 9, 2, 3
RTOL = 1e-6
# (depth multiplier, padding, stride, bias)
FORMS = st.tuples(st.sampled_from([1, 2]), st.sampled_from(["same", "valid", "causal"]),
                  st.sampled_from([1, 2]), st.booleans())


def _depthwise_1d(x, form):
    multiplier, padding, stride, bias = form
    if padding == "causal":
        x = keras.layers.ZeroPadding1D((K - 1, 0), dtype=F64)(x)
        padding = "valid"
    return keras.layers.DepthwiseConv1D(K, strides=stride, padding=padding,
                                        depth_multiplier=multiplier, use_bias=bias,
                                        dtype=F64)(x)


def _registered(body, in_shape=(LENGTH, CHANNELS), seed=0, batch=BATCH):
    """``(loss_fn, args, model)``: ``body(x)`` then a dense head, float64."""
    keras.utils.set_random_seed(seed)
    x = keras.Input(in_shape, dtype=F64)
    h = keras.layers.Activation("tanh", dtype=F64)(body(x))
    logits = keras.layers.Dense(3, dtype=F64)(keras.layers.Flatten(dtype=F64)(h))
    model = keras.Model(x, logits)

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    xs = tf.random.stateless_normal([batch, *in_shape], seed=[seed, 1], dtype=tf.float64)
    ys = tf.constant([0, 1, 2, 1][:batch])
    return loss_fn, (xs, ys), model


def _parallel(forms):
    """One DepthwiseConv1D per form, side by side on one input."""
    def body(x):
        outs = [keras.layers.Flatten(dtype=F64)(_depthwise_1d(x, f)) for f in forms]
        return outs[0] if len(outs) == 1 else keras.layers.Concatenate(dtype=F64)(outs)
    return body


def _check_per_example(loss_fn, args):
    reg = loss_fn.registration(*args)
    want = one_example_loop(loss_fn, args, reg.variables)
    got = kg.per_example_gradients(loss_fn, *args)
    for v, g, w in zip(reg.variables, got, want):
        assert g.shape == (BATCH, *v.shape) and g.dtype == tf.float64
        assert_close(g.numpy(), w.numpy(), RTOL, v.name)
    want_norms = np.sqrt(sum(np.sum(np.reshape(w.numpy(), [BATCH, -1]) ** 2, 1) for w in want))
    assert_close(kg.per_example_gradient_norms(loss_fn, *args).numpy(), want_norms, RTOL)


def _property(forms):
    loss_fn, args, _ = _registered(_parallel(forms))
    reg = loss_fn.registration(*args)
    depthwise = [layer for layer in reg.layers if layer.kind == "depthwise_conv2d"]
    # parallel branches: the layers come in data-flow order, not the forms'
    assert sorted((tuple(layer.variables[0].shape), len(layer.variables)) for layer in depthwise) \
        == sorted(((K, CHANNELS, f[0]), 1 + f[3]) for f in forms)
    assert [layer.kind for layer in reg.layers if layer not in depthwise] == ["dense"]
    _check_per_example(loss_fn, args)


@hypothesis.settings(max_examples=2, deadline=None, derandomize=True)
@hypothesis.given(st.lists(FORMS, min_size=2, max_size=3))
def test_depthwise_conv1d_forms_match_one_example_loop(forms):
    _property(forms)


@pytest.mark.slow
@hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
@hypothesis.given(st.lists(FORMS, min_size=1, max_size=4))
def test_depthwise_conv1d_forms_match_one_example_loop_more(forms):
    _property(forms)


def _keras_fisher(model, variables, x):
    """The exact Fisher of the categorical head w.r.t. ``variables``, brute force."""
    return brute_fisher(lambda p, xx: model(xx), list(variables), x,
                        lambda z: fisher.Categorical(z).fisher()).astype(np.float64)


def _block(loss_fn, args, layer_index, approximation):
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact", cov_ema_decay=0.0,
                             approximations={"depthwise_conv2d": approximation})
    est.update(*args)
    return est.blocks[layer_index]


@pytest.mark.parametrize("approximation", ["full", "diagonal"])
def test_full_and_diagonal_blocks_match_brute_force(approximation):
    form = (2, "same", 2, True)
    loss_fn, args, model = _registered(lambda x: _depthwise_1d(x, form))
    layer = loss_fn.registration(*args).layers[0]
    assert layer.kind == "depthwise_conv2d"
    want = _keras_fisher(model, layer.variables, args[0])
    got = _block(loss_fn, args, 0, approximation).full_matrix().numpy()
    if approximation == "diagonal":
        want = np.diag(np.diag(want))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-12)


def test_kronecker_block_exact_for_one_example_at_one_location():
    """One example, one output location, one channel (the block is diagonal
    over channels): KFC is the exact Fisher."""
    form = (2, "valid", 1, True)
    loss_fn, args, model = _registered(lambda x: _depthwise_1d(x, form), in_shape=(K, 1),
                                       batch=1)
    layer = loss_fn.registration(*args).layers[0]
    want = _keras_fisher(model, layer.variables, args[0])
    block = _block(loss_fn, args, 0, "kron")
    assert isinstance(block, fisher.DepthwiseConvKroneckerBlock)
    np.testing.assert_allclose(block.full_matrix().numpy(), want, rtol=RTOL, atol=1e-12)


@pytest.mark.parametrize("form", [(2, "same", 2, True),
                                  pytest.param((1, "causal", 1, False), marks=pytest.mark.slow)])
def test_kronecker_block_equals_the_2d_block(form):
    """The 1-D block is the 2-D block of the same layer on a unit height:
    same factors, same matrix, same products (vectors keep the variables'
    own rank-3 shapes)."""
    multiplier, padding, stride, bias = form
    loss_1d, args, model_1d = _registered(lambda x: _depthwise_1d(x, form))

    def body_2d(x):
        x = keras.layers.Reshape((1, LENGTH, CHANNELS), dtype=F64)(x)
        if padding == "causal":
            x = keras.layers.ZeroPadding2D(((0, 0), (K - 1, 0)), dtype=F64)(x)
        return keras.layers.DepthwiseConv2D(
            (1, K), strides=stride, padding="valid" if padding == "causal" else padding,
            depth_multiplier=multiplier, use_bias=bias, dtype=F64)(x)

    loss_2d, _, model_2d = _registered(body_2d)
    for v1, v2 in zip(model_1d.weights, model_2d.weights):
        v2.assign(np.reshape(v1.numpy(), v2.shape))
    b1, b2 = _block(loss_1d, args, 0, "kron"), _block(loss_2d, args, 0, "kron")
    assert b1.input_factor.dim == K + bias and b1.output_factor.dim == multiplier
    np.testing.assert_allclose(b1.full_matrix(), b2.full_matrix(), rtol=RTOL, atol=1e-14)
    b1.update_inverses(), b2.update_inverses()
    rng = np.random.default_rng(0)
    variables = loss_1d.registration(*args).layers[0].variables
    vs = [tf.constant(rng.normal(size=v.shape)) for v in variables]
    for name in ("multiply", "multiply_inverse"):
        got = getattr(b1, name)(vs)
        want = getattr(b2, name)([tf.reshape(v, w.shape) for v, w in zip(vs, model_2d.weights)])
        assert [tuple(g.shape) for g in got] == [tuple(v.shape) for v in vs]
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.ravel(g), np.ravel(w), rtol=RTOL, atol=1e-12)
    back = b1.multiply_inverse(b1.multiply(vs))
    for g, v in zip(back, vs):
        np.testing.assert_allclose(g, v, rtol=1e-8, atol=1e-10)


def _stack(x):
    """DepthwiseConv2D (multiplier 2, strides 2), then as a sequence:
    SeparableConv1D (multiplier 2, strides 2) and DepthwiseConv1D."""
    h = keras.layers.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=2,
                                     dtype=F64)(x)
    h = keras.layers.Reshape((9, 2 * CHANNELS), dtype=F64)(h)
    h = keras.layers.SeparableConv1D(4, K, strides=2, padding="same", depth_multiplier=2,
                                     activation="tanh", dtype=F64)(h)
    return _depthwise_1d(h, (2, "same", 1, False))


STACK_KINDS = ["depthwise_conv2d", "depthwise_conv2d", "conv2d", "depthwise_conv2d", "dense"]


def test_separable_and_depthwise_stack_verifies():
    loss_fn, args, _ = _registered(_stack, in_shape=(5, 5, CHANNELS))
    reg = loss_fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == STACK_KINDS
    assert [tuple(v.shape) for v in reg.layers[1].variables] == [(K, 2 * CHANNELS, 2)]
    report = kg.verify(loss_fn, *args)
    assert report.passed, report.table()


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, dict(momentum_type="regular", damping=1e-2)],
                         ids=["defaults", "regular"])
def test_separable_and_depthwise_stack_exact_fisher_and_kfac(options):
    loss_fn, args, _ = _registered(_stack, in_shape=(5, 5, CHANNELS))
    if not options:
        report = kg.verify(loss_fn, *args, estimation_mode="exact")
        assert report.passed, report.table()
    opt = kg.KFAC(loss_fn, **options)
    losses = [float(opt.step(*args)) for _ in range(4)]
    assert all(np.isfinite(losses)) and int(opt.skipped_steps) == 0
    assert losses[-1] < losses[0]
