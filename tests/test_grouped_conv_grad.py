"""The gradient a grouped Conv2D gets in the re-imported graph
(``kfac_graph.grouped_conv_grad``: TensorFlow's CPU kernels have none), to
first and second order, against the convolution written as G ungrouped
convolutions on channel slices (``test_grouped_conv.split_conv``)."""
import numpy as np
import pytest
import tensorflow as tf

from fisher_reference import F64
from kfac_graph import grouped_conv_grad
from test_grouped_conv import RULE_CASES, _spec, split_conv


# -- the CPU gradient of a grouped Conv2D in the re-imported graph ----------------------


@pytest.mark.parametrize("name", ["g4_stride2_valid", "channels_multiplier2_stride2",
                                  "g2_explicit", "g2_dilation2", "g2_conv1d_stride2"])
def test_depthwise_form_equals_the_grouped_convolution(name):
    spec = RULE_CASES[name]
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(2, 7, 6, spec.input_channels)), F64)
    w = tf.constant(rng.normal(size=spec.kernel_shape), F64)
    pads = [p for pair in (spec.explicit_paddings_hw or ()) for p in pair]
    got = grouped_conv_grad.grouped_conv2d(x, w, spec.strides_hw, spec.padding,
                                           [0, 0, *pads, 0, 0] if pads else (),
                                           spec.dilations_hw)
    np.testing.assert_allclose(got, split_conv(spec)(x, w), rtol=1e-12, atol=1e-12)


def _grads_through(conv, x, w, dy, v):
    """The first-order gradients `(dx, dw)` of `sum(dy * conv(x, w))`, and the
    gradient w.r.t. `w` of `sum(v * dx)` (the double backward pass)."""
    with tf.GradientTape() as outer:
        outer.watch(w)
        with tf.GradientTape() as inner:
            inner.watch([x, w])
            y = conv(x, w)
        dx, dw = inner.gradient(y, [x, w], output_gradients=dy)
        second = tf.reduce_sum(v * dx)
    return dx, dw, outer.gradient(second, w)


@pytest.mark.parametrize("name", ["g2_same", "g4_stride2_valid", "channels_multiplier2_stride2",
                                  "g2_explicit", "g2_dilation2", "g2_conv1d_stride2"])
def test_the_imported_graphs_conv2d_gradient(name):
    """The gradient the taps mark a grouped Conv2D with (`grouped_conv_grad`),
    to first and second order, against G ungrouped convolutions; an
    ungrouped one keeps TensorFlow's."""
    spec = RULE_CASES[name]
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(2, 7, 6, spec.input_channels)), F64)
    w = tf.constant(rng.normal(size=spec.kernel_shape), F64)
    y = split_conv(spec)(x, w)
    dy, v = (tf.constant(rng.normal(size=s), F64) for s in (y.shape, x.shape))

    def grouped(x, w):
        return tf.raw_ops.Conv2D(input=x, filter=w, strides=list(spec.strides),
                                 padding=spec.padding, dilations=list(spec.dilations),
                                 explicit_paddings=list(spec.explicit_paddings))

    @tf.function
    def imported(x, w, dy, v):
        y = grouped(x, w)
        grouped_conv_grad.mark([y.op])
        dx, dw = tf.gradients(y, [x, w], grad_ys=dy)
        return dx, dw, *tf.gradients(tf.reduce_sum(v * dx), [w, dy])

    # d/d(dy) of <v, dx>: the convolution's own forward map applied to v
    wants = (*_grads_through(split_conv(spec), x, w, dy, v), split_conv(spec)(v, w))
    for got, want in zip(imported(x, w, dy, v), wants):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    plain = tf.function(lambda x: tf.nn.conv2d(x, w[:, :, :1], 1, "SAME"))
    ungrouped = plain.get_concrete_function(tf.TensorSpec([1, 5, 5, 1], F64)).graph
    grouped_conv_grad.mark(ungrouped.get_operations())
    assert not [op for op in ungrouped.get_operations()
                if op.type == "Conv2D" and "_gradient_op_type" in op.node_def.attr]


def test_the_imported_graphs_conv2d_gradient_nchw():
    """NCHW (float32: TF's CPU kernels run NCHW Conv2D in float32 only)."""
    rng = np.random.default_rng(2)
    x = tf.constant(rng.normal(size=(2, 4, 7, 6)), tf.float32)
    w = tf.constant(rng.normal(size=(3, 3, 2, 6)), tf.float32)
    dy = tf.constant(rng.normal(size=(2, 6, 4, 6)), tf.float32)
    spec = _spec(4, 2, 6, stride=(2, 1))
    nhwc = lambda t: tf.transpose(t, [0, 2, 3, 1])  # noqa: E731
    nchw = lambda t: tf.transpose(t, [0, 3, 1, 2])  # noqa: E731

    @tf.function
    def imported(x, w, dy):
        y = tf.raw_ops.Conv2D(input=x, filter=w, strides=[1, 1, 2, 1], padding="SAME",
                              data_format="NCHW")
        grouped_conv_grad.mark([y.op])
        return tf.gradients(y, [x, w], grad_ys=dy)

    want_dx, want_dw, _ = _grads_through(lambda a, k: nchw(split_conv(spec)(nhwc(a), k)), x, w,
                                         dy, tf.zeros_like(x))
    got_dx, got_dw = imported(x, w, dy)
    np.testing.assert_allclose(got_dx, want_dx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_dw, want_dw, rtol=1e-4, atol=1e-4)
