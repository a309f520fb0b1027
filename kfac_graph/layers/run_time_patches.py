"""A convolution's input patches where its spatial size is known at run
time only (a SavedModel's ``[B, None, None, C]``, a Conv1D on sequences of
any length, a video's frames): ``tf.image.extract_patches`` after any
EXPLICIT padding. In 3-D (TensorFlow's ``extract_volume_patches`` has no
dilation and no XLA kernel), each depth tap ``r`` reads the depth slab
``r d_d + s_d t`` (``t`` the output depth), padded at run time as the
convolution pads it, and takes the 2-D patches of every slab; the taps are
stacked depth first, so the features are in the kernel's ``(r, p, q, c)``
order and the positions in ``(t, y, x)`` row-major order.

On an input smaller than the kernel's dilated span, VALID padding leaves no
output location: TensorFlow's convolution returns no convolution's output
there, and the patches would be empty. A run-time check stops first, on one
line naming the layer (``ConvAttrs.layer``), where an einsum's shape error
would stop later."""
from __future__ import annotations

import tensorflow as tf

from kfac_graph.layers.conv_padding import output_and_padding


def patches(x, spec):
    """Input patches ``[B, Ho*Wo, kh*kw*C]`` of the convolution ``spec`` (a
    ``conv_geometry.ConvAttrs``) on ``x`` (NHWC), output locations in
    row-major order, taps and channels in the kernel's ``(p, q, c)`` order
    (3-D, on NDHWC: ``[B, Do*Ho*Wo, kd*kh*kw*C]``, module docstring)."""
    padding = spec.padding
    if padding == "EXPLICIT":
        x = tf.pad(x, [[0, 0], *spec.explicit_paddings_hw, [0, 0]])
        padding = "VALID"
    spans = [(k - 1) * d + 1 for k, d in zip(spec.kernel_hw, spec.dilations_hw)]
    if padding == "VALID":
        x = _spanned(x, spec, spans)
    if spec.rank == 2:
        return _image_patches(x, spec, padding)
    (kd, *_), (sd, *_), (dd, *_) = spec.kernel_hw, spec.strides_hw, spec.dilations_hw
    out_depth, depth_pads = output_and_padding(tf.shape(x)[1], kd, sd, dd, padding,
                                               maximum=tf.maximum)
    x = tf.pad(x, [[0, 0], depth_pads, [0, 0], [0, 0], [0, 0]])  # (0, 0) for VALID
    slabs = []
    for r in range(kd):  # [B, To, H, W, C]: depth tap r at every output depth
        slab = x[:, r * dd:r * dd + (out_depth - 1) * sd + 1:sd]
        shape = tf.shape(slab)
        flat = tf.reshape(slab, tf.concat([[shape[0] * shape[1]], shape[2:]], 0))
        flat.set_shape([None, None, None, x.shape[-1]])
        taps = _image_patches(flat, spec, padding)  # [B To, Ho Wo, kh kw C]
        slabs.append(tf.reshape(taps, [shape[0], -1, taps.shape[-1]]))
    return tf.reshape(tf.stack(slabs, axis=2), [tf.shape(x)[0], -1, kd * slabs[0].shape[-1]])


def _image_patches(x, spec, padding):
    """``[N, Ho*Wo, kh*kw*C]``: the patches over ``x``'s last two spatial
    axes (``[N, H, W, C]``) by the kernel's last two."""
    (kh, kw), (sh, sw), (dh, dw) = (t[-2:] for t in (spec.kernel_hw, spec.strides_hw,
                                                      spec.dilations_hw))
    out = tf.image.extract_patches(
        x, sizes=[1, kh, kw, 1], strides=[1, sh, sw, 1], rates=[1, dh, dw, 1], padding=padding)
    shape = tf.shape(out)
    return tf.reshape(out, [shape[0], shape[1] * shape[2], kh * kw * x.shape[-1]])


def _spanned(x, spec, spans):
    """``x``, once its spatial sizes are checked at run time to hold the
    kernel's dilated ``spans`` (module docstring)."""
    check = tf.debugging.assert_greater_equal(
        tf.shape(x)[1:-1], tf.constant(spans), message=(
            f"{spec.layer or 'a convolution'}: its {'x'.join(map(str, spans))} kernel span "
            f"(dilated) is larger than its input (VALID padding), where TensorFlow's output is "
            f"no convolution's; feed a larger input or use SAME padding"))
    with tf.control_dependencies([check]):
        return tf.identity(x)
