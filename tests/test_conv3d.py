"""Conv3D: the kind "conv3d", the conv rule and blocks over three spatial axes.

References, all independent of the code under test (float64):
- the rule against one-example GradientTape gradients of `tf.nn.conv3d`
  (a dilated kernel written as a zero-dilated one: TF's CPU Conv3D has no
  dilations), every kernel ("taps", "gather", "im2col"), NDHWC and NCDHW;
- Keras models (every layer dtype="float64") against a loop of one-example
  gradients of the model, `kg.verify` in exact mode, and three K-FAC steps;
- the Kronecker block's factors against 3-D patches cut by hand in numpy,
  its full matrix against T (A (x) G).

Grouped Conv3D (`Conv3D(groups=G)`): tests/test_grouped_conv3d.py.
"""
import hypothesis
from hypothesis import strategies as st
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import fisher
from kfac_graph.layers import conv
from fisher_reference import F64, brute_fisher, same_pads
from per_example_reference import assert_close, brute_force, one_example_loop, run_rule

RTOL = 1e-6


def _zero_dilated(kernel, d):
    """`kernel [kd, kh, kw, ...]` with `d - 1` zeros between taps."""
    if d == 1:
        return kernel
    k = kernel.shape[:3]
    index = [[r * d, p * d, q * d] for r in range(k[0]) for p in range(k[1]) for q in range(k[2])]
    shape = [(n - 1) * d + 1 for n in k] + kernel.shape[3:].as_list()
    return tf.scatter_nd(index, tf.reshape(kernel, [-1] + shape[3:]), shape)


def _pads(size, k, s, d, padding):
    return same_pads(size, k, s, d) if padding == "SAME" else (0, 0)


def _out(size, k, s, d, padding):
    span = (k - 1) * d + 1
    return -(-size // s) if padding == "SAME" else -(-(size - span + 1) // s)


def _spec(kernel, stride, dilation, padding, fmt="NDHWC", bias=True, cin=2, cout=3):
    one = lambda v: [1, 1, v, v, v] if fmt == "NCDHW" else [1, v, v, v, 1]  # noqa: E731
    return conv.ConvSpec.from_attrs(
        (kernel,) * 3 + (cin, cout),
        dict(strides=one(stride), dilations=one(dilation), padding=padding, data_format=fmt),
        has_bias=bias)


def _check_rule(kernel, stride, dilation, padding, fmt, bias, methods=("auto",), size=5):
    """Every `method` of the conv rule against the one-example loop."""
    spec = _spec(kernel, stride, dilation, padding, fmt, bias)
    out = _out(size, kernel, stride, dilation, padding)
    if out < 1:
        return

    def op(a, w, *b):
        pads = [[0, 0]] + [list(_pads(size, kernel, stride, dilation, padding))] * 3 + [[0, 0]]
        y = tf.nn.conv3d(tf.pad(a, pads), _zero_dilated(w, dilation),
                         [1, stride, stride, stride, 1], "VALID")
        return y + b[0] if b else y

    rng = np.random.default_rng(kernel * 100 + stride * 10 + dilation)
    a = tf.constant(rng.normal(size=(3, size, size, size, 2)), F64)
    c = tf.constant(rng.normal(size=(3, out, out, out, 3)), F64)
    weights = [tf.constant(rng.normal(size=(kernel,) * 3 + (2, 3)), F64)]
    weights += [tf.constant(rng.normal(size=(3,)), F64)] if bias else []
    want, want_sq = brute_force(op, weights, [(a, c)])
    ncdhw = lambda t: tf.transpose(t, [0, 4, 1, 2, 3]) if fmt == "NCDHW" else t  # noqa: E731
    for method in methods:
        for norm_method in ("gram", "materialize"):
            rule = conv.ConvRule(method=method, norm_method=norm_method)
            got, got_sq = run_rule(rule, [(ncdhw(a), ncdhw(c))], spec, "eager")
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert g.shape == w.shape
                assert_close(g, w, RTOL, f"{method}")
            assert_close(got_sq, want_sq, RTOL, f"{method} {norm_method} norms")


@pytest.mark.parametrize("stride,dilation,padding,bias", [
    (1, 1, "SAME", True), (2, 1, "SAME", False), (1, 2, "SAME", True), (2, 1, "VALID", True),
    (1, 2, "VALID", False)])
def test_rule_matches_one_example_loop(stride, dilation, padding, bias):
    _check_rule(2, stride, dilation, padding, "NDHWC", bias, methods=("taps", "gather", "im2col"))


def test_rule_channels_first():
    _check_rule(2, 2, 1, "SAME", "NCDHW", True)


@hypothesis.settings(max_examples=6, deadline=None, database=None)
@hypothesis.given(kernel=st.integers(1, 3), stride=st.integers(1, 2), dilation=st.integers(1, 2),
                  padding=st.sampled_from(["SAME", "VALID"]), bias=st.booleans())
def test_rule_property(kernel, stride, dilation, padding, bias):
    _check_rule(kernel, stride, dilation, padding, "NDHWC", bias, size=4)


def test_grouped_kernel_is_2d_only():
    spec = _spec(2, 1, 1, "SAME")
    a, g = tf.zeros([1, 3, 3, 3, 2], F64), tf.zeros([1, 3, 3, 3, 3], F64)
    with pytest.raises(ValueError, match="2-D only"):
        conv.ConvRule(method="grouped").per_example_grads((a, g), spec)


# -- Keras models --------------------------------------------------------------------


def _model(padding="same", strides=1, dilation=1, bias=True, keras_model=False):
    keras.utils.set_random_seed(0)
    f64 = dict(dtype="float64")
    model = keras.Sequential([
        keras.Input((5, 5, 5, 2), dtype="float64"),
        keras.layers.Conv3D(3, 2, strides=strides, padding=padding, dilation_rate=dilation,
                            use_bias=bias, activation="tanh", **f64),
        keras.layers.Conv3D(2, 2, strides=2, padding="same", **f64),
        keras.layers.Flatten(**f64), keras.layers.Dense(3, **f64)])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    x = tf.random.stateless_normal([3, 5, 5, 5, 2], seed=[1, 2], dtype=tf.float64)
    args = (x, tf.constant([0, 1, 2]))
    return (loss_fn, args, model) if keras_model else (loss_fn, args)


@pytest.mark.parametrize("padding,strides,dilation,bias", [
    ("valid", 2, 1, False), ("same", 1, 2, True),
    pytest.param("same", 1, 1, True, marks=pytest.mark.slow),
    pytest.param("valid", 1, 2, True, marks=pytest.mark.slow)])
def test_keras_per_example_gradients(padding, strides, dilation, bias):
    loss_fn, args = _model(padding, strides, dilation, bias)
    reg = loss_fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == ["conv3d", "conv3d", "dense"]
    assert [len(layer.variables) for layer in reg.layers][0] == (2 if bias else 1)
    want = one_example_loop(loss_fn, args, reg.variables)
    got = kg.per_example_gradients(loss_fn, *args)
    for g, w in zip(got, want):
        assert_close(g.numpy(), w.numpy(), RTOL)
    norms = np.sqrt(sum(np.sum(np.reshape(w.numpy(), [3, -1]) ** 2, 1) for w in want))
    assert_close(kg.per_example_gradient_norms(loss_fn, *args).numpy(), norms, RTOL)


def test_keras_verifies_and_trains():
    loss_fn, args = _model("same", 2)
    report = kg.verify(loss_fn, *args, estimation_mode="exact")
    assert report.passed, report.table()
    opt = kg.KFAC(loss_fn, learning_rate=0.1, damping=1e-2)
    losses = [float(opt.step(*args)) for _ in range(3)]
    assert all(np.isfinite(losses)) and int(opt.skipped_steps) == 0
    assert losses[-1] < losses[0]


# -- the Kronecker block against numpy patches --------------------------------------


def np_patches_3d(x, k, s, d, padding):
    """Patches `[B, T, k^3*C]` of an NDHWC array, by explicit loops."""
    pad = [_pads(n, k, s, d, padding) for n in x.shape[1:4]]
    xp = np.pad(x, [(0, 0), *pad, (0, 0)])
    span = (k - 1) * d + 1
    starts = [range(0, n - span + 1, s) for n in xp.shape[1:4]]
    return np.stack([xp[:, z:z + span:d, y:y + span:d, v:v + span:d, :].reshape(len(x), -1)
                     for z in starts[0] for y in starts[1] for v in starts[2]], axis=1)


@pytest.mark.parametrize("stride,dilation,padding", [(1, 1, "SAME"), (2, 1, "VALID"),
                                                     (1, 2, "SAME")])
def test_kron_block_factors_are_patch_covariances(stride, dilation, padding):
    rng = np.random.default_rng(stride + 10 * dilation)
    spec = _spec(2, stride, dilation, padding, cin=2, cout=3)
    out = _out(5, 2, stride, dilation, padding)
    x, g = rng.normal(size=(3, 5, 5, 5, 2)), rng.normal(size=(3, out, out, out, 3))
    attrs = dict(strides=spec.strides, dilations=spec.dilations, padding=padding,
                 data_format="NDHWC")
    block = fisher.ConvKroneckerBlock([(2, 2, 2, 2, 3), (3,)], attrs, dtype=F64, ema_decay=0.0)
    block.update([(tf.constant(x), tf.constant(g))])
    patches = np_patches_3d(x, 2, stride, dilation, padding)
    rows = np.concatenate([patches.reshape(-1, patches.shape[-1]),
                           np.ones([patches.shape[0] * patches.shape[1], 1])], 1)
    a_np = rows.T @ rows / len(rows)
    g_rows = g.reshape(-1, 3)
    g_np = g_rows.T @ g_rows / len(g_rows)
    np.testing.assert_allclose(block.input_factor.value(), a_np, rtol=RTOL, atol=1e-12)
    np.testing.assert_allclose(block.output_factor.value(), g_np, rtol=RTOL, atol=1e-12)
    np.testing.assert_allclose(block.full_matrix(), out ** 3 * np.kron(a_np, g_np),
                               rtol=RTOL, atol=1e-12)



def test_full_and_diagonal_blocks_match_brute_force_fisher():
    """Exact mode: the full block is the brute-force Fisher (1/B) sum_i
    J_i^T F_i J_i of the first Conv3D's kernel and bias; the diagonal block
    its diagonal."""
    loss_fn, (x, y), model = _model("same", 2, keras_model=True)
    reg = loss_fn.registration(x, y)
    params = list(reg.layers[0].variables)

    def categorical_fisher(z):
        p = tf.nn.softmax(z)
        return tf.linalg.diag(p) - p[:, :, None] * p[:, None, :]

    want = brute_fisher(lambda _, xs: model(xs), params, x, categorical_fisher)
    for mode, expect in (("full", want), ("diagonal", np.diag(np.diag(want)))):
        est = kg.FisherEstimator(loss_fn, estimation_mode="exact", approximations={"conv3d": mode})
        est.update(x, y)
        np.testing.assert_allclose(est.blocks[0].full_matrix(), expect, rtol=RTOL, atol=1e-12)


# -- Conv3DTranspose: kind "conv3d_transpose" ----------------------------------------


def _transpose_model(padding="same", strides=2, bias=True):
    keras.utils.set_random_seed(0)
    f64 = dict(dtype="float64")
    model = keras.Sequential([
        keras.Input((3, 3, 3, 2), dtype="float64"),
        keras.layers.Conv3DTranspose(3, 2, strides=strides, padding=padding, use_bias=bias,
                                     activation="tanh", **f64),
        keras.layers.GlobalAveragePooling3D(**f64), keras.layers.Dense(3, **f64)])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    x = tf.random.stateless_normal([3, 3, 3, 3, 2], seed=[3, 4], dtype=tf.float64)
    return loss_fn, (x, tf.constant([0, 1, 2])), model


@pytest.mark.parametrize("padding,strides,bias", [("same", 2, True), ("valid", 1, False)])
def test_transpose_per_example_gradients(padding, strides, bias):
    loss_fn, args, _ = _transpose_model(padding, strides, bias)
    reg = loss_fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == ["conv3d_transpose", "dense"]
    want = one_example_loop(loss_fn, args, reg.variables)
    for g, w in zip(kg.per_example_gradients(loss_fn, *args), want):
        assert_close(g.numpy(), w.numpy(), RTOL)


def test_transpose_blocks_verify_and_train():
    """The full and diagonal blocks against the brute-force Fisher; kg.verify;
    three K-FAC steps (the default KFC block)."""
    loss_fn, (x, y), model = _transpose_model()
    reg = loss_fn.registration(x, y)

    def categorical_fisher(z):
        p = tf.nn.softmax(z)
        return tf.linalg.diag(p) - p[:, :, None] * p[:, None, :]

    want = brute_fisher(lambda _, xs: model(xs), list(reg.layers[0].variables), x,
                        categorical_fisher)
    for mode, expect in (("full", want), ("diagonal", np.diag(np.diag(want)))):
        est = kg.FisherEstimator(loss_fn, estimation_mode="exact",
                                 approximations={"conv3d_transpose": mode})
        est.update(x, y)
        np.testing.assert_allclose(est.blocks[0].full_matrix(), expect, rtol=RTOL, atol=1e-12)
    report = kg.verify(loss_fn, x, y, estimation_mode="exact")
    assert report.passed, report.table()
    opt = kg.KFAC(loss_fn, learning_rate=0.1, damping=1e-2)
    losses = [float(opt.step(x, y)) for _ in range(3)]
    assert all(np.isfinite(losses)) and int(opt.skipped_steps) == 0
    assert losses[-1] < losses[0]


def test_spec_reads_the_rank_from_its_lists():
    spec = conv.ConvSpec((2, 3, 1, 2, 4), strides=(1, 2, 1, 3, 1), padding=b"SAME")
    assert spec.rank == 3 and spec.data_format == "NDHWC" and spec.dilations == (1,) * 5
    assert (spec.kernel_hw, spec.strides_hw) == ((2, 3, 1), (2, 1, 3))
    first = conv.ConvSpec((2, 2, 2, 1, 1), strides=(1, 1, 2, 1, 3), data_format="NCDHW",
                          padding="EXPLICIT", explicit_paddings=(0, 0, 0, 0, 1, 2, 3, 4, 5, 6))
    assert first.strides_hw == (2, 1, 3) and first.explicit_paddings_hw == ((1, 2), (3, 4), (5, 6))
    with pytest.raises(ValueError, match="kernel_shape"):
        conv.ConvSpec((2, 2, 1, 1), strides=(1,) * 5)
    with pytest.raises(ValueError, match="data_format"):
        conv.ConvSpec((2, 2, 1, 1), data_format="NDHWC")
    with pytest.raises(ValueError, match="4 or 5"):
        conv.ConvSpec((2, 1), strides=(1, 1, 1))


@pytest.mark.parametrize("layer,shape", [(keras.layers.Conv3D, (2, 5, 5, 5)),
                                         (keras.layers.Conv2D, (2, 5, 5))])
def test_channels_first_bias_on_the_axis_keras_adds_it(layer, shape):
    """Keras's `add` writes a channels-first bias as an NHWC BiasAdd when the
    channel count equals the last spatial size (here 3): the bias then goes
    along W, and the pass must not take it for the conv's bias (float32:
    TF's CPU Conv3D runs NCDHW only there)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input(shape),
                              layer(3, 2, strides=2, padding="same", data_format="channels_first"),
                              keras.layers.Flatten(), keras.layers.Dense(3)])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    args = (tf.random.stateless_normal((3,) + shape, seed=[1, 2]), tf.constant([0, 1, 2]))
    reg = loss_fn.registration(*args)
    assert reg.layers[0].kind in ("conv2d", "conv3d") and len(reg.layers[0].variables) == 1
    for g, w in zip(kg.per_example_gradients(loss_fn, *args),
                    one_example_loop(loss_fn, args, reg.variables)):
        assert_close(g.numpy(), w.numpy(), 1e-4)
