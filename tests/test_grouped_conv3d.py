"""Grouped Conv3D (Keras `Conv3D(groups=G)`): the kind "conv3d" with `groups`.

References, all independent of the code under test (float64):
- the rule against one-example GradientTape gradients of the convolution
  written as G ungrouped `tf.nn.conv3d`s on channel slices (a dilated
  kernel written as a zero-dilated one), every kernel method;
- the graph that is run (`passes.grouped_conv3d`) against that split
  convolution and against XLA's grouped Conv3D;
- Keras models against a loop of one-example gradients of the model itself
  (Keras runs its grouped Conv3D under XLA), `kg.verify` in exact mode,
  K-FAC steps, with and without XLA;
- the Kronecker block against per-group KFC factors from 3-D patches cut by
  hand in numpy, and against the brute-force Jacobian Fisher (exact where KFC
  is: one example, one output location, within each group); the full and
  diagonal blocks against the brute-force Fisher.
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
from fisher_reference import F64, brute_fisher, cov, homog
from per_example_reference import assert_close, brute_force, one_example_loop, run_rule
from test_conv3d import _out, _pads, _zero_dilated, np_patches_3d

RTOL = 1e-6
SLOW = pytest.mark.slow


def split_conv3d(groups, stride=1, dilation=1, padding="SAME", size=5):
    """The grouped convolution (NDHWC, `k^3` kernel) as G ungrouped `Conv3D`s
    on channel slices, its padding written out."""

    def op(a, kernel, *bias):
        k = kernel.shape[0]
        pads = [[0, 0]] + [list(_pads(size, k, stride, dilation, padding))] * 3 + [[0, 0]]
        a, kernel = tf.pad(a, pads), _zero_dilated(kernel, dilation)
        outs = [tf.nn.conv3d(x, w, [1, stride, stride, stride, 1], "VALID")
                for x, w in zip(tf.split(a, groups, -1), tf.split(kernel, groups, -1))]
        out = tf.concat(outs, -1)
        return out + bias[0] if bias else out

    return op


def _spec(cin, groups, cout, k=2, stride=1, dilation=1, padding="SAME", bias=True):
    one = [1, stride, stride, stride, 1]
    return conv.ConvSpec.from_attrs(
        (k,) * 3 + (cin // groups, cout),
        dict(strides=one, dilations=[1, dilation, dilation, dilation, 1], padding=padding,
             data_format="NDHWC", input_channels=cin), has_bias=bias)


def _check_rule(cin, groups, cout, k=2, stride=1, dilation=1, padding="SAME", bias=True,
                methods=("auto",), size=5, batch=3):
    spec = _spec(cin, groups, cout, k, stride, dilation, padding, bias)
    assert spec.groups == groups
    out = _out(size, k, stride, dilation, padding)
    rng = np.random.default_rng(cin * 100 + groups * 10 + k)
    a = tf.constant(rng.normal(size=(batch, size, size, size, cin)), F64)
    c = tf.constant(rng.normal(size=(batch, out, out, out, cout)), F64)
    weights = [tf.constant(rng.normal(size=spec.kernel_shape), F64)]
    weights += [tf.constant(rng.normal(size=(cout,)), F64)] if bias else []
    want, want_sq = brute_force(split_conv3d(groups, stride, dilation, padding, size), weights,
                                [(a, c)])
    for method in methods:
        for norm_method in ("gram", "materialize"):
            rule = conv.ConvRule(method=method, norm_method=norm_method)
            got, got_sq = run_rule(rule, [(a, c)], spec, "eager")
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape
                assert_close(g, w, RTOL, method)
            assert_close(got_sq, want_sq, RTOL, f"{method} {norm_method} norms")


@pytest.mark.parametrize("cin,groups,cout,stride,dilation,padding,bias", [
    (4, 2, 6, 1, 1, "SAME", True), (4, 4, 8, 2, 1, "VALID", False),
    (8, 4, 4, 1, 2, "SAME", True), (4, 2, 2, 2, 1, "SAME", False)])
def test_rule_matches_split_convolutions(cin, groups, cout, stride, dilation, padding, bias):
    _check_rule(cin, groups, cout, 2, stride, dilation, padding, bias,
                methods=("auto", "taps", "gather", "im2col"))


def test_grouped_kernel_method_is_2d_only():
    a, g = tf.zeros([1, 3, 3, 3, 4], F64), tf.zeros([1, 3, 3, 3, 4], F64)
    with pytest.raises(ValueError, match="2-D only"):
        conv.ConvRule(method="grouped").per_example_grads((a, g), _spec(4, 2, 4))
    assert conv.ConvRule().auto_method(_spec(4, 2, 4)) == "taps"


@hypothesis.settings(max_examples=6, deadline=None, derandomize=True)
@hypothesis.given(groups=st.sampled_from([2, 4]), per_group=st.integers(1, 2),
                  out_per_group=st.integers(1, 2), k=st.integers(1, 2), stride=st.integers(1, 2),
                  dilation=st.integers(1, 2), padding=st.sampled_from(["SAME", "VALID"]),
                  bias=st.booleans())
def test_property_rule_matches_split_convolutions(groups, per_group, out_per_group, k, stride,
                                                  dilation, padding, bias):
    _check_rule(groups * per_group, groups, groups * out_per_group, k, stride, dilation, padding,
                bias, size=4, batch=2)


# -- the graph that is run ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["NDHWC", "NCDHW"])
def test_the_run_graph_splits_a_grouped_conv3d(fmt):
    """The registration's graph has the grouped Conv3D per group (NCDHW
    transposed to NDHWC around them: TF's CPU Conv3D runs NCDHW in float32
    only): the same output as the split reference and as XLA's grouped op,
    the same gradients; an ungrouped NDHWC Conv3D is left as it is."""
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(2, 2, 2, 2, 6)), dtype=F64)
    x = tf.constant(rng.normal(size=(2, 4, 4, 4, 4)), F64)

    def grouped(x):
        first = fmt == "NCDHW"
        y = tf.raw_ops.Conv3D(input=tf.transpose(x, [0, 4, 1, 2, 3]) if first else x, filter=w,
                              strides=[1] * 5, padding="SAME", data_format=fmt)
        return tf.transpose(y, [0, 2, 3, 4, 1]) if first else y

    @kg.auto_register
    def loss_fn(x):
        return tf.reduce_mean(tf.reduce_sum(tf.square(grouped(x)), [1, 2, 3, 4]))

    reg = loss_fn.registration(x)
    assert [layer.kind for layer in reg.layers] == ["conv3d"]
    assert reg.layers[0].attrs["input_channels"] == 4
    convs = [n for n in reg.graph_def.node if n.op == "Conv3D"]
    assert len(convs) == 2 and all("kfac_grouped/group_" in n.name for n in convs)

    def reference(x):
        return tf.reduce_mean(tf.reduce_sum(tf.square(split_conv3d(2, size=4)(x, w)),
                                            [1, 2, 3, 4]))

    tol = 1e-12
    got = kg.per_example_gradients(loss_fn, x)[0].numpy().mean(0)
    values = []
    for fn in (reference, tf.function(loss_fn, jit_compile=True)):  # XLA has grouped Conv3D
        with tf.GradientTape() as tape:
            values.append(fn(x))
        assert_close(got, tape.gradient(values[-1], w), tol * 10)
    np.testing.assert_allclose(values[0], values[1], rtol=tol)

    @kg.auto_register
    def ungrouped(x):
        return tf.reduce_mean(tf.square(tf.nn.conv3d(x, w[..., :4], [1] * 5, "SAME")))

    convs = [n.name for n in ungrouped.registration(x[..., :2]).graph_def.node
             if n.op == "Conv3D"]
    assert len(convs) == 1 and "kfac_grouped" not in convs[0]


# -- Keras models ---------------------------------------------------------------------------


@pytest.fixture
def float64():
    """Keras layers in float64 (floatx and the global policy; tests/conftest.py
    puts both back)."""
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield


def _keras_case(groups=2, padding="same", strides=1, dilation=1, bias=True, cout=4, size=4,
                batch=3):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((size, size, size, 4)),
        keras.layers.Conv3D(cout, 2, groups=groups, strides=strides, padding=padding,
                            dilation_rate=dilation, use_bias=bias, activation="tanh"),
        keras.layers.Flatten(), keras.layers.Dense(3)])

    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    dtype = keras.config.floatx()
    x = tf.random.stateless_normal([batch, size, size, size, 4], [1, 2], dtype=dtype)
    return loss_fn, (x, tf.constant([0, 1, 2, 1][:batch])), model


def _check_per_example(fn, loss_fn, args, rtol=RTOL):
    reg = fn.registration(*args)
    # traced once: eagerly, Keras compiles its grouped op with XLA on every call
    want = one_example_loop(tf.function(loss_fn), args, reg.variables)
    for got, ref, v in zip(kg.per_example_gradients(fn, *args), want, reg.variables, strict=True):
        assert_close(got.numpy(), ref.numpy(), rtol, v.name)
    batch = args[0].shape[0]
    norms = np.sqrt(sum(np.sum(np.reshape(w, (batch, -1)) ** 2, 1) for w in want))
    assert_close(kg.per_example_gradient_norms(fn, *args).numpy(), norms, rtol)


@pytest.mark.parametrize("groups,padding,strides,dilation,bias", [
    (2, "same", 1, 1, True), (4, "valid", 2, 1, False), (2, "same", 1, 2, True),
    pytest.param(4, "same", 2, 1, True, marks=SLOW),
    pytest.param(2, "valid", 1, 2, False, marks=SLOW)])
def test_keras_registration_and_per_example_gradients(groups, padding, strides, dilation, bias,
                                                      float64):
    loss_fn, args, model = _keras_case(groups, padding, strides, dilation, bias)
    fn = kg.auto_register(loss_fn)
    reg = fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == ["conv3d", "dense"]
    conv3d = reg.layers[0]
    assert [v.shape for v in conv3d.variables] == [(2, 2, 2, 4 // groups, 4)] + [(4,)] * bias
    spec = conv.ConvSpec.from_attrs(conv3d.attrs["kernel_shape"], conv3d.attrs, has_bias=bias)
    assert spec.groups == groups and spec.rank == 3
    _check_per_example(fn, loss_fn, args)


@pytest.mark.parametrize("groups", [2, 1])
def test_keras_channels_first(groups, float64):
    """NCDHW in float64 (TF's CPU Conv3D runs channels-first only in float32;
    the graph that is run transposes it, grouped or not)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((4, 4, 4, 4)),
        keras.layers.Conv3D(4, 2, groups=groups, strides=2, padding="same",
                            data_format="channels_first"),
        keras.layers.Flatten(), keras.layers.Dense(3)])

    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    fn = kg.auto_register(loss_fn)
    args = (tf.random.stateless_normal([3, 4, 4, 4, 4], [1, 2], dtype=F64),
            tf.constant([0, 1, 2]))
    reg = fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == ["conv3d", "dense"]
    assert reg.layers[0].attrs.get("input_channels", 4) == 4
    _check_per_example(fn, loss_fn, args)


def test_keras_verifies_and_trains(float64):
    """`kg.verify` in exact mode (the double backward pass through the split
    Conv3Ds), then five K-FAC steps with the default (KFC) block and with
    K-FAC-reduce."""
    loss_fn, args, _ = _keras_case(groups=2, strides=2)
    fn = kg.auto_register(loss_fn)
    report = kg.verify(fn, *args, estimation_mode="exact")
    assert report.passed, report.table()
    for approximations in (None, {"conv3d": "kron_reduce"}):
        opt = kg.KFAC(fn, learning_rate=0.05, damping=1e-2, approximations=approximations,
                      jit_compile=False)
        losses = [float(opt.step(*args)) for _ in range(5)]
        assert np.all(np.isfinite(losses)) and int(opt.skipped_steps) == 0
        assert losses[-1] < losses[0], (approximations, losses)


@pytest.mark.slow
def test_keras_trains_under_xla(float64):
    """The whole step compiled with XLA (the split Conv3Ds, their gradients)."""
    loss_fn, args, _ = _keras_case(groups=4, padding="valid")
    fn = kg.auto_register(loss_fn)
    opt = kg.KFAC(fn, learning_rate=0.05, damping=1e-2, jit_compile=True)
    losses = [float(opt.step(*args)) for _ in range(5)]
    assert np.all(np.isfinite(losses)) and int(opt.skipped_steps) == 0
    assert losses[-1] < losses[0], losses


# -- the Fisher blocks -------------------------------------------------------------------------


@pytest.mark.parametrize("groups,stride,padding,bias", [(2, 1, "SAME", True),
                                                        (4, 2, "VALID", False)])
def test_kronecker_block_is_per_group_kfc(groups, stride, padding, bias):
    """The block diagonal over groups of T (A_j (x) G_j), A_j from group j's
    3-D patches (cut in numpy), at group j's canonical indices."""
    rng = np.random.default_rng(groups + stride)
    cin, cout, k = 4, 4, 2
    out = _out(4, k, stride, 1, padding)
    x, g = rng.normal(size=(3, 4, 4, 4, cin)), rng.normal(size=(3, out, out, out, cout))
    attrs = dict(strides=[1, stride, stride, stride, 1], padding=padding, input_channels=cin,
                 data_format="NDHWC")
    kernel_shape = (k, k, k, cin // groups, cout)
    block = fisher.ConvKroneckerBlock([kernel_shape] + [(cout,)] * bias, attrs, dtype=F64,
                                      ema_decay=0.0)
    assert block.input_factor.groups == groups
    block.update([(tf.constant(x), tf.constant(g))])
    patches = np_patches_3d(x, k, stride, 1, padding)  # [B, T, k^3 * cin], (taps, c)
    t, cg, og = patches.shape[1], cin // groups, cout // groups
    per_tap = patches.reshape(3, t, k ** 3, groups, cg)
    kernel_index = np.arange(k ** 3 * cg * cout).reshape(k ** 3 * cg, cout)
    n = kernel_index.size + cout * bias
    want = np.zeros((n, n))
    for j in range(groups):
        a_j = per_tap[:, :, :, j, :].reshape(3, t, -1)
        a_j = cov(homog(a_j) if bias else a_j)
        g_j = cov(g[..., j * og:(j + 1) * og])
        index = kernel_index[:, j * og:(j + 1) * og]
        if bias:
            index = np.concatenate([index, kernel_index.size + np.arange(j * og, (j + 1) * og)[None]])
        want[np.ix_(index.ravel(), index.ravel())] = t * np.kron(a_j, g_j)
    np.testing.assert_allclose(block.full_matrix(), want, rtol=RTOL, atol=1e-11)


def _categorical_fisher(z):
    p = tf.nn.softmax(z)
    return tf.linalg.diag(p) - p[:, :, None] * p[:, None, :]


def _group_index(groups, bias, taps=8, cin=4, cout=4):
    """Each group's parameters in the canonical order (kernel, then bias)."""
    cg, og = cin // groups, cout // groups
    kernel = np.arange(taps * cg * cout).reshape(taps * cg, cout)
    out = []
    for j in range(groups):
        index = kernel[:, j * og:(j + 1) * og].ravel()
        if bias:
            index = np.concatenate([index, kernel.size + np.arange(j * og, (j + 1) * og)])
        out.append(index)
    return out


@pytest.mark.parametrize("groups", [2, 4])
def test_kronecker_block_is_the_exact_fisher_within_each_group(groups, float64):
    """One example, one output location: within each group the gradient is
    `a_j (x) g_j`, so KFC is the brute-force Jacobian Fisher there; across
    groups the block is zero."""
    loss_fn, (x, y), model = _keras_case(groups, padding="valid", size=2, batch=1)
    fn = kg.auto_register(loss_fn)
    reg = fn.registration(x, y)
    params = list(reg.layers[0].variables)
    want = brute_fisher(lambda _, xs: model(xs), params, x, _categorical_fisher)
    est = kg.FisherEstimator(fn, estimation_mode="exact")
    est.update(x, y)
    got = est.blocks[0].full_matrix().numpy()
    index = _group_index(groups, bias=True)
    for j, rows in enumerate(index):
        for i, cols in enumerate(index):
            expect = want[np.ix_(rows, cols)] if i == j else 0.0
            np.testing.assert_allclose(got[np.ix_(rows, cols)], expect, rtol=RTOL, atol=1e-12)
    assert np.abs(want[np.ix_(index[0], index[1])]).max() > 1e-6  # groups do interact


def test_full_and_diagonal_blocks_match_brute_force_fisher(float64):
    loss_fn, (x, y), model = _keras_case(groups=2, strides=2)
    fn = kg.auto_register(loss_fn)
    params = list(fn.registration(x, y).layers[0].variables)
    want = brute_fisher(lambda _, xs: model(xs), params, x, _categorical_fisher)
    for mode, expect in (("full", want), ("diagonal", np.diag(np.diag(want)))):
        est = kg.FisherEstimator(fn, estimation_mode="exact", approximations={"conv3d": mode})
        est.update(x, y)
        np.testing.assert_allclose(est.blocks[0].full_matrix(), expect, rtol=RTOL, atol=1e-12)


def test_a_dynamic_depth_registers_and_its_rule_is_exact():
    """A grouped Conv3D whose depth and height are known only at run time has
    no static patch geometry: its patches are taken at run time
    (``layers/run_time_patches``), and its rule matches one-example
    gradients of the split reference."""
    rng = np.random.default_rng(2)
    w = tf.Variable(rng.normal(size=(2, 2, 2, 2, 4)))
    x = tf.constant(rng.normal(size=(3, 3, 3, 3, 4)))

    def depth_at_run_time(x):  # tf.where's size is data-dependent
        d = tf.shape(tf.where(tf.reshape(x[0, :, 0, 0, 0], [-1]) > -1e30))[0]
        return tf.reshape(x, tf.stack([tf.shape(x)[0], d, d, 3, 4]))  # two unknown axes

    def loss(conv):
        def loss_fn(x):
            y = conv(depth_at_run_time(x))
            return tf.reduce_mean(tf.reduce_sum(tf.square(y), [1, 2, 3, 4]))
        return loss_fn

    fn = kg.auto_register(loss(lambda x: tf.raw_ops.Conv3D(input=x, filter=w, strides=[1] * 5,
                                                           padding="SAME")))
    reg = fn.registration(x)
    assert [layer.kind for layer in reg.layers] == ["conv3d"]
    want = one_example_loop(loss(lambda x: split_conv3d(2, size=3)(x, w)), (x,), [w])
    assert_close(kg.per_example_gradients(fn, x)[0].numpy(), want[0].numpy(), RTOL)
