"""A 2-D convolution's input patches where its spatial size is known at run
time only (a SavedModel's ``[B, None, None, C]``, a Conv1D on sequences of
any length): ``tf.image.extract_patches`` after any EXPLICIT padding.

On an input smaller than the kernel's dilated span, VALID padding leaves no
output location: TensorFlow's convolution returns no convolution's output
there, and the patches would be empty. A run-time check stops first, on one
line naming the layer (``ConvAttrs.layer``), where an einsum's shape error
would stop later."""
from __future__ import annotations

import tensorflow as tf


def patches(x, spec):
    """Input patches ``[B, Ho*Wo, kh*kw*C]`` of the convolution ``spec`` (a
    ``conv_geometry.ConvAttrs``) on ``x`` (NHWC), output locations in
    row-major order, taps and channels in the kernel's ``(p, q, c)`` order."""
    if spec.rank != 2:
        raise ValueError(f"the patches of a {spec.rank}-D convolution need a static spatial "
                         f"size, got {x.shape}")
    padding = spec.padding
    if padding == "EXPLICIT":
        (top, bottom), (left, right) = spec.explicit_paddings_hw
        x = tf.pad(x, [[0, 0], [top, bottom], [left, right], [0, 0]])
        padding = "VALID"
    (kh, kw), (sh, sw), (dh, dw) = spec.kernel_hw, spec.strides_hw, spec.dilations_hw
    if padding == "VALID":
        x = _spanned(x, spec, ((kh - 1) * dh + 1, (kw - 1) * dw + 1))
    out = tf.image.extract_patches(
        x, sizes=[1, kh, kw, 1], strides=[1, sh, sw, 1], rates=[1, dh, dw, 1], padding=padding)
    shape = tf.shape(out)
    return tf.reshape(out, [shape[0], shape[1] * shape[2], kh * kw * x.shape[-1]])


def _spanned(x, spec, span):
    """``x``, once its height and width are checked at run time to hold the
    kernel's dilated ``span`` (module docstring)."""
    check = tf.debugging.assert_greater_equal(
        tf.shape(x)[1:3], tf.constant(span), message=(
            f"{spec.layer or 'a convolution'}: its {span[0]}x{span[1]} kernel span (dilated) is "
            f"larger than its input (VALID padding), where TensorFlow's output is no "
            f"convolution's; feed a larger input or use SAME padding"))
    with tf.control_dependencies([check]):
        return tf.identity(x)
