"""Grouped convolutions (Keras `Conv2D(groups=G)`, `Conv1D(groups=G)`; ConvNeXt's
depthwise `Conv2D(groups=channels)`): the conv2d kind with `groups`.

References, all independent of the code under test: per-example gradients
of the rule against one-example GradientTape gradients of the convolution
written as G ungrouped convolutions on channel slices; Keras models against
a loop of one-example gradients of the model itself (Keras runs its grouped
op under XLA); the Kronecker block against per-group KFC factors from
patches cut by hand in numpy, placed at each group's canonical indices.
"""
import hypothesis
from hypothesis import strategies as st
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import fisher
from kfac_graph import per_example as pe
from fisher_reference import (F64, cov, homog, np_patches, operator_matrix, out_size,
                              pi_damped_kron)
from per_example_reference import check, one_example_loop

RTOL = 1e-6


# -- the rule against one-example gradients of G ungrouped convolutions ----------------


def _zero_dilated(kernel, d):
    """`kernel [kh, kw, ...]` with `d - 1` zeros between taps (a plain conv)."""
    if d == 1:
        return kernel
    kh, kw = kernel.shape[0], kernel.shape[1]
    index = [[p * d, q * d] for p in range(kh) for q in range(kw)]
    shape = [(kh - 1) * d + 1, (kw - 1) * d + 1] + kernel.shape[2:].as_list()
    return tf.scatter_nd(index, tf.reshape(kernel, [kh * kw] + shape[2:]), shape)


def split_conv(spec):
    """The grouped convolution as G ungrouped `Conv2D`s on channel slices (NHWC)."""

    def op(a, kernel, *bias):
        kernel = _zero_dilated(kernel, spec.dilations_hw[0])
        outs = [tf.raw_ops.Conv2D(input=x, filter=w, strides=list(spec.strides),
                                  padding=spec.padding,
                                  explicit_paddings=list(spec.explicit_paddings))
                for x, w in zip(tf.split(a, spec.groups, -1), tf.split(kernel, spec.groups, -1))]
        out = tf.concat(outs, -1)
        return out + bias[0] if bias else out

    return op


def _spec(cin, groups, cout, k=3, stride=1, padding="SAME", dilation=1, bias=True, width=None):
    explicit = (0, 0, 1, 0, 0, 2, 0, 0) if padding == "EXPLICIT" else ()
    sh, sw = stride if isinstance(stride, tuple) else (stride, stride)
    return pe.ConvSpec((k, width or k, cin // groups, cout), strides=(1, sh, sw, 1),
                       dilations=(1, dilation, dilation, 1), padding=padding,
                       explicit_paddings=explicit, has_bias=bias, input_channels=cin)


def _check_rule(rule, spec, dtype=tf.float64, mode="eager", size=(6, 7), batch=3):
    explicit = spec.explicit_paddings_hw or ((0, 0), (0, 0))
    span = [(k - 1) * spec.dilations_hw[0] + 1 for k in spec.kernel_hw]
    outs = [out_size(size[i], span[i], spec.strides_hw[i], 1, spec.padding, explicit[i])
            for i in range(2)]
    uses = [((batch, *size, spec.input_channels), (batch, *outs, spec.kernel_shape[3]))]
    shapes = [spec.kernel_shape] + ([(spec.kernel_shape[3],)] if spec.has_bias else [])
    check(rule, spec, split_conv(spec), shapes, uses, dtype, mode)


RULE_CASES = {
    "g2_same": _spec(4, 2, 6),
    "g4_stride2_valid": _spec(8, 4, 4, stride=2, padding="VALID", bias=False),
    "channels_same": _spec(5, 5, 5, k=3),
    "channels_multiplier2_stride2": _spec(3, 3, 6, stride=2),
    "g2_explicit": _spec(4, 2, 4, padding="EXPLICIT", width=2),
    "g2_dilation2": _spec(4, 2, 4, dilation=2, bias=False),
    "g2_conv1d": _spec(4, 2, 6, k=1, width=3),
    "g2_conv1d_stride2": _spec(4, 2, 6, k=1, width=3, stride=(1, 2)),
}


SLOW = pytest.mark.slow


@pytest.mark.parametrize("method", ["taps", "gather", "im2col", "grouped"])
@pytest.mark.parametrize("name", ["g4_stride2_valid", "channels_multiplier2_stride2",
                                  pytest.param("g2_same", marks=SLOW),
                                  pytest.param("g2_explicit", marks=SLOW),
                                  pytest.param("g2_dilation2", marks=SLOW)])
def test_every_kernel_method_matches_one_example_gradients(method, name):
    # the folded filter gradient ("grouped") has a CPU kernel for float32 only
    dtype = tf.float32 if method == "grouped" else tf.float64
    _check_rule(pe.ConvRule(method=method, norm_method="materialize"), RULE_CASES[name], dtype,
                "function")


@pytest.mark.parametrize("name", sorted(RULE_CASES))
def test_auto_rule_and_gram_norms(name):
    spec = RULE_CASES[name]
    _check_rule(pe.ConvRule(), spec)
    _check_rule(pe.ConvRule(norm_method="gram"), spec, size=(4, 5))


def test_rule_under_xla():
    _check_rule(pe.ConvRule(), RULE_CASES["g4_stride2_valid"], tf.float64, "xla")


def test_gram_form_is_chosen_by_the_per_group_widths():
    spec = _spec(16, 4, 16, k=3)  # per group 3*3*4 = 36 inputs, 4 outputs
    rule = pe.ConvRule()
    assert rule.gram_dims(spec) == (36, 4)
    assert rule.use_gram(spec, 3) and not rule.use_gram(spec, 4)


def test_groups_come_from_the_input_channels():
    assert _spec(8, 4, 4).groups == 4
    assert pe.ConvSpec((3, 3, 2, 4)).groups == 1
    with pytest.raises(ValueError, match="do not split into groups"):
        pe.ConvSpec((3, 3, 3, 4), input_channels=8)
    with pytest.raises(ValueError, match="do not split into groups"):
        pe.ConvSpec((3, 3, 2, 3), input_channels=4)
    uses = [(tf.zeros([1, 5, 5, 6]), tf.zeros([1, 5, 5, 4]))]
    with pytest.raises(ValueError, match="the input has 6 channels; the kernel reads 4"):
        pe.ConvRule().per_example_grads(uses, _spec(4, 2, 4))


@hypothesis.settings(max_examples=6, deadline=None, derandomize=True)
@hypothesis.given(groups=st.sampled_from([1, 2, 3]), per_group=st.integers(1, 2),
                  out_per_group=st.integers(1, 2), k=st.integers(1, 3), stride=st.integers(1, 2),
                  padding=st.sampled_from(["SAME", "VALID", "EXPLICIT"]), bias=st.booleans())
def test_property_rule_matches_one_example_gradients(groups, per_group, out_per_group, k, stride,
                                                     padding, bias):
    spec = _spec(groups * per_group, groups, groups * out_per_group, k=k, stride=stride,
                 padding=padding, bias=bias)
    _check_rule(pe.ConvRule(), spec, size=(5, 6), batch=2)


# -- Keras models, end to end -------------------------------------------------------------


def _keras_case(name):
    keras.utils.set_random_seed(0)
    if name == "conv2d":  # groups 2, then groups = channels (ConvNeXt's depthwise form)
        layers = [keras.Input((6, 6, 4)),
                  keras.layers.Conv2D(8, 3, groups=2, padding="same", activation="tanh"),
                  keras.layers.Conv2D(8, 2, groups=8, strides=2, use_bias=False)]
        shape = (6, 6, 4)
    elif name == "conv2d_more":
        layers = [keras.Input((6, 6, 4)),
                  keras.layers.Conv2D(8, 3, groups=2, padding="same", activation="tanh"),
                  keras.layers.Conv2D(8, 2, groups=4, strides=2, use_bias=False,
                                      activation="tanh"),
                  keras.layers.Conv2D(8, 3, groups=8, padding="same")]
        shape = (6, 6, 4)
    elif name == "channels_first":  # Keras runs it with XLA: the CPU's Conv2D is NHWC only
        layers = [keras.Input((4, 6, 6)),
                  keras.layers.Conv2D(8, 3, groups=2, padding="same", activation="tanh",
                                      data_format="channels_first"),
                  keras.layers.Conv2D(8, 2, groups=4, strides=2, data_format="channels_first")]
        shape = (4, 6, 6)
    else:
        layers = [keras.Input((9, 4)),
                  keras.layers.Conv1D(6, 3, groups=2, padding="same", activation="tanh"),
                  keras.layers.Conv1D(4, 2, groups=2, strides=2, use_bias=False)]
        shape = (9, 4)
    model = keras.Sequential(layers + [keras.layers.Flatten(), keras.layers.Dense(3)])

    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    x = tf.random.stateless_normal([4, *shape], [1, 2], dtype=F64)
    y = tf.constant([0, 1, 2, 1])
    return loss_fn, (x, y)


@pytest.fixture
def float64():
    """Keras layers in float64 (floatx and the global policy, which Keras may
    have cached from floatx; tests/conftest.py puts both back)."""
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield


@pytest.mark.parametrize("name", ["conv2d", pytest.param("channels_first", marks=SLOW),
                                  pytest.param("conv2d_more", marks=SLOW),
                                  pytest.param("conv1d", marks=SLOW)])
def test_keras_grouped_convs_verify_and_train(name, float64):
    """Grouped Conv2D and Conv1D: exact per-example gradients, kg.verify, K-FAC
    steps. Channels-first, the graph that is run transposes the grouped
    convolution to NHWC (``passes.grouped_conv3d``; before: "The Conv2D op
    currently only supports the NHWC tensor format on the CPU")."""
    loss_fn, args = _keras_case(name)
    fn = kg.auto_register(loss_fn)
    reg = fn.registration(*args)
    assert [layer.kind for layer in reg.layers][-1] == "dense"
    assert {layer.kind for layer in reg.layers[:-1]} == {"conv2d"}
    # traced once: eagerly, Keras compiles its grouped op with XLA on every call
    want = one_example_loop(tf.function(loss_fn), args, reg.variables)
    for got, ref, v in zip(kg.per_example_gradients(fn, *args), want, reg.variables):
        np.testing.assert_allclose(got, ref, rtol=RTOL, atol=1e-12, err_msg=v.name)
    norms = np.sqrt(sum(np.sum(np.reshape(w, (4, -1)) ** 2, 1) for w in want))
    np.testing.assert_allclose(kg.per_example_gradient_norms(fn, *args), norms, rtol=RTOL)
    report = kg.verify(fn, *args)
    assert report.passed, report.table()
    opt = kg.KFAC(fn, learning_rate=0.05, damping=1e-2)
    losses = [float(opt.step(*args)) for _ in range(3)]
    assert int(opt.skipped_steps) == 0 and np.all(np.isfinite(losses))
    assert losses[-1] < losses[0], losses


@pytest.mark.slow
def test_keras_grouped_convs_verify_the_exact_fisher(float64):
    """The Fisher check takes the double backward pass through the grouped ops."""
    loss_fn, args = _keras_case("conv2d_more")
    report = kg.verify(kg.auto_register(loss_fn), *args, estimation_mode="exact")
    assert report.passed, report.table()


# -- the Fisher blocks against per-group KFC in numpy ----------------------------------

LAM = 0.3
KW = dict(dtype=F64, ema_decay=0.0, damping=LAM)


def _grouped_reference(p, g, kernel_shape, groups, bias, damped):
    """diag_j of T (A_j (x) G_j) (or the damped, pi_j-split form) at group j's
    canonical indices: kernel entries [..., c, j*og + o], then bias [j*og + o]."""
    kh, kw, cg, cout = kernel_shape
    og, t = cout // groups, p.shape[1]
    p5 = p.reshape(p.shape[0], t, kh * kw, groups, cg)
    kernel_index = np.arange(kh * kw * cg * cout).reshape(kh * kw * cg, cout)
    n = kernel_index.size + cout * int(bias)
    full = np.zeros((n, n))
    for j in range(groups):
        a_j = p5[:, :, :, j, :].reshape(p.shape[0], t, -1)
        a_j = cov(homog(a_j) if bias else a_j)
        g_j = cov(g[..., j * og:(j + 1) * og])
        blk = pi_damped_kron(a_j, g_j, LAM, t) if damped else t * np.kron(a_j, g_j)
        index = kernel_index[:, j * og:(j + 1) * og]
        if bias:
            bias_index = kernel_index.size + np.arange(j * og, (j + 1) * og)
            index = np.concatenate([index, bias_index[None]])
        full[np.ix_(index.ravel(), index.ravel())] = blk
    return full


@pytest.mark.parametrize("groups,stride,padding,bias",
                         [(2, 1, "SAME", True), (4, 2, "VALID", False), (4, 1, "SAME", True)])
def test_kronecker_block_is_per_group_kfc(groups, stride, padding, bias):
    rng = np.random.default_rng(groups + stride)
    cin, cout, kh, kw = 4, 4, 2, 2
    x = rng.normal(size=(3, 5, 6, cin))
    p = np_patches(x, kh, kw, (stride, stride), (1, 1), padding)
    oh, ow = (out_size(s, k, stride, 1, padding) for s, k in ((5, kh), (6, kw)))
    g = rng.normal(size=(3, oh, ow, cout))
    attrs = dict(strides=[1, stride, stride, 1], padding=padding, input_channels=cin)
    kernel_shape = (kh, kw, cin // groups, cout)
    shapes = [kernel_shape] + ([(cout,)] if bias else [])
    block = fisher.ConvKroneckerBlock(shapes, attrs, **KW)
    assert block.input_factor.groups == groups and block.output_factor.groups == groups
    block.update([(tf.constant(x), tf.constant(g))])
    np.testing.assert_allclose(block.full_matrix(),
                               _grouped_reference(p, g, kernel_shape, groups, bias, False),
                               atol=1e-11)
    damped = _grouped_reference(p, g, kernel_shape, groups, bias, True)
    np.testing.assert_allclose(operator_matrix(block.multiply, block.var_shapes), damped,
                               rtol=1e-9, atol=1e-10)
    block.update_inverses()
    for refreshed in (False, True):
        inverse = operator_matrix(lambda v: block.multiply_inverse(v, refreshed), block.var_shapes)
        np.testing.assert_allclose(inverse, np.linalg.inv(damped), rtol=1e-7, atol=1e-9)
    chol = operator_matrix(block.multiply_cholesky, block.var_shapes)
    np.testing.assert_allclose(chol @ chol.T, damped, rtol=1e-8, atol=1e-10)


def test_diagonal_block_is_the_diagonal_of_per_example_gradients():
    rng = np.random.default_rng(3)
    spec = _spec(4, 2, 4, stride=2)
    x, g = rng.normal(size=(3, 5, 5, 4)), rng.normal(size=(3, 3, 3, 4))
    attrs = dict(strides=list(spec.strides), padding="SAME", input_channels=4)
    block = fisher.ConvDiagonalBlock([spec.kernel_shape, (4,)], attrs, **KW)
    block.update([(tf.constant(x), tf.constant(g))])
    weights = [tf.zeros(spec.kernel_shape, F64), tf.zeros([4], F64)]
    rows = []
    for i in range(3):
        with tf.GradientTape() as tape:
            tape.watch(weights)
            out = split_conv(spec)(tf.constant(x[i:i + 1]), *weights)
            loss = tf.reduce_sum(out * g[i:i + 1])
        rows.append(np.concatenate([np.ravel(t) for t in tape.gradient(loss, weights)]))
    np.testing.assert_allclose(np.diag(block.full_matrix()), np.mean(np.square(rows), 0),
                               rtol=1e-10)


# -- a real model -------------------------------------------------------------------------


@pytest.mark.slow
def test_convnext_tiny_per_example_norms_and_kfac():
    keras.utils.set_random_seed(0)
    model = keras.applications.ConvNeXtTiny(weights=None, input_shape=(32, 32, 3), classes=10)

    def loss_fn(x, y):
        logits = model(x, training=False)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    fn = kg.auto_register(loss_fn)
    x = tf.random.stateless_normal([2, 32, 32, 3], [3, 4])
    y = tf.constant([1, 7])
    reg = fn.registration(x, y)
    assert "generic" not in {layer.kind for layer in reg.layers}
    grouped = [layer for layer in reg.layers if layer.kind == "conv2d"
               and layer.attrs["input_channels"] != layer.attrs["kernel_shape"][2]]
    assert len(grouped) == 18, [layer.name for layer in grouped]
    want = one_example_loop(tf.function(loss_fn), (x, y), reg.variables)
    want_norms = np.sqrt(sum(np.sum(np.reshape(w, (2, -1)) ** 2, 1) for w in want))
    np.testing.assert_allclose(kg.per_example_gradient_norms(fn, x, y), want_norms, rtol=1e-4)
    opt = kg.KFAC(fn, learning_rate=1e-3, damping=1e-1)
    losses = [float(opt.step(x, y)) for _ in range(3)]
    assert np.all(np.isfinite(losses)) and int(opt.skipped_steps) == 0
    assert losses[-1] < losses[0], losses
