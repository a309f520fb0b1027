"""The gradient of a grouped `Conv2D` in the re-imported graph.

A grouped convolution (kernel `[kh, kw, cg, Cout]` on `Cin = G*cg` input
channels; Keras `Conv2D(groups=G)`, `Conv1D(groups=G)`) runs forward on
TensorFlow's CPU kernels, but its gradients do not ("Gradients for grouped
convolutions are not supported on CPU"); Keras gets around it by compiling
the op with XLA, which the graph the taps re-import (`taps.py`) no longer
does. So the taps mark every grouped `Conv2D` they import (`mark`) with the
gradient `NAME`: the gradient of the same convolution written as one
depthwise convolution,

    y[..., j*og + o] = sum_c depthwise(x, D)[..., (j*cg + c)*og + o],
    D[p, q, j*cg + c, o] = W[p, q, c, j*og + o],

(channel multiplier og = Cout/G; the same multiply-adds as the grouped
convolution, with a `cg` times wider intermediate), whose gradients, and
their gradients (the exact Fisher's double backward pass), the CPU has.
Dilations are written into the kernel as zeros (TF's CPU depthwise kernels
reject dilations), EXPLICIT padding as a `tf.pad`, unequal strides (a
strided Conv1D; the CPU kernel rejects them too) as stride 1 and a strided
slice, NCHW by transposes. Only the gradient is built from these ops; the
forward stays the graph's own. Ungrouped convolutions stay unmarked, with
TensorFlow's own gradient.
"""
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from kfac_graph.layers import conv_geometry as cg_lib

NAME = "KfacGraphConv2D"


def _attr(op, name, default=None):
    try:
        value = op.get_attr(name)
    except ValueError:
        return default
    return value.decode() if isinstance(value, bytes) else value


def dilate_kernel(w, dilations):
    """`w [kh, kw, ...]` with `d - 1` zero rows (columns) between taps: the
    undilated kernel of the same convolution."""
    for axis, d in enumerate(dilations):
        if d == 1:
            continue
        shape = w.shape.as_list()
        spread = tf.concat([tf.expand_dims(w, axis + 1),
                            tf.zeros(shape[:axis + 1] + [d - 1] + shape[axis + 1:], w.dtype)],
                           axis + 1)
        merged = tf.reshape(spread, shape[:axis] + [shape[axis] * d] + shape[axis + 1:])
        w = tf.gather(merged, tf.range((shape[axis] - 1) * d + 1), axis=axis)
    return w


def grouped_conv2d(x, w, strides, padding, explicit_paddings=(), dilations=(1, 1)):
    """The grouped convolution of NHWC `x` by `w [kh, kw, cg, Cout]` as one
    depthwise convolution (module docstring); `strides`, `dilations`: `(h, w)`;
    `padding` "SAME", "VALID" or "EXPLICIT" with NHWC `explicit_paddings`.
    TF's CPU depthwise kernel takes equal strides only: unequal ones (a strided
    Conv1D) run at stride 1 on the padded input, then keep every s-th output."""
    cin, (_, _, cg, cout) = x.shape[-1], w.shape.as_list()
    groups = cin // cg
    og = cout // groups
    w = dilate_kernel(w, dilations)
    kh, kw = w.shape[0], w.shape[1]
    if padding == "SAME" and strides[0] != strides[1]:
        pads = [cg_lib.output_and_padding(x.shape[1 + i], w.shape[i], strides[i], 1, "SAME")[1]
                for i in range(2)]
        padding, explicit_paddings = "EXPLICIT", (0, 0, *pads[0], *pads[1], 0, 0)
    if padding == "EXPLICIT":
        p = list(explicit_paddings)
        x = tf.pad(x, [[0, 0], p[2:4], p[4:6], [0, 0]])
        padding = "VALID"
    strides = tuple(strides)
    step = strides if strides[0] == strides[1] else (1, 1)
    depthwise = tf.reshape(tf.transpose(tf.reshape(w, [kh, kw, cg, groups, og]), [0, 1, 3, 2, 4]),
                           [kh, kw, cin, og])
    y = tf.raw_ops.DepthwiseConv2dNative(input=x, filter=depthwise,
                                         strides=[1, step[0], step[1], 1], padding=padding)
    if step != strides:
        y = y[:, ::strides[0], ::strides[1], :]
    if cg == 1:
        return y
    lead = tf.shape(y)[:3]
    split = tf.reshape(y, tf.concat([lead, [groups, cg, og]], 0))
    return tf.reshape(tf.reduce_sum(split, axis=-2), tf.concat([lead, [cout]], 0))


def is_grouped(op):
    """Whether ``op`` is a `Conv2D` whose kernel reads a share of its input's
    (static) channels."""
    if op.type != "Conv2D":
        return False
    x, w = op.inputs
    channels = x.shape[1 if _attr(op, "data_format", "NHWC") == "NCHW" else -1]
    return channels is not None and w.shape[2] is not None and channels != w.shape[2]


def mark(operations):
    """Gives every grouped `Conv2D` among ``operations`` the gradient `NAME`."""
    for op in operations:
        if is_grouped(op):
            op._set_attr("_gradient_op_type",  # noqa: SLF001
                         attr_value_pb2.AttrValue(s=NAME.encode()))


@tf.RegisterGradient(NAME)
def _grouped_conv2d_gradient(op, dy):
    """A grouped `Conv2D`'s gradient: the input's by a grouped convolution of
    `dy` (`input_gradient`), the kernel's by the depthwise form (module
    docstring)."""
    x, w = op.inputs
    nchw = _attr(op, "data_format", "NHWC") == "NCHW"
    hw = (2, 3) if nchw else (1, 2)
    strides, dilations = _attr(op, "strides"), _attr(op, "dilations", [1, 1, 1, 1])
    explicit = list(_attr(op, "explicit_paddings", []) or [])
    if nchw and explicit:
        explicit = explicit[:2] + explicit[4:8] + explicit[2:4]
    to_nhwc = (lambda t: tf.transpose(t, [0, 2, 3, 1])) if nchw else (lambda t: t)
    xs = to_nhwc(x)
    strides_hw, dilations_hw = [strides[i] for i in hw], [dilations[i] for i in hw]
    y = grouped_conv2d(xs, w, strides_hw, _attr(op, "padding"), explicit, dilations_hw)
    dy_nhwc = to_nhwc(dy)
    dx = input_gradient(dy_nhwc, w, xs.shape, strides_hw, _attr(op, "padding"), explicit,
                        dilations_hw)
    if dx is None:
        return tf.gradients(y, [x, w], grad_ys=dy_nhwc)
    dx = tf.transpose(dx, [0, 3, 1, 2]) if nchw else dx
    return dx, tf.gradients(y, w, grad_ys=dy_nhwc)[0]


def input_gradient(dy, w, x_shape, strides, padding, explicit=(), dilations=(1, 1)):
    """`dL/dx [B, H, W, Cin]` of the grouped convolution of NHWC `x` by
    `w [kh, kw, cg, Cout]`, given `dy`, as one grouped `Conv2D` forward (which
    the CPU runs about 10x faster than the depthwise form's input gradient):

        dx[i] = sum_q dyz_pad[i + q] W'[q],   W'[q, o, j*cg + c] = W[k-1-q, c, j*og + o],

    per spatial axis, where `dyz` is `dy` with `s - 1` zeros between rows
    (stride `s`) and `dyz_pad` pads it by `k - 1 - before` rows in front and
    `H + before - 1 - (Ho - 1) s` behind (`before`: the forward's leading
    padding). The new op carries this module's gradient (`mark`), so the
    double backward pass works too. None (use the depthwise form) for
    dilations, unknown spatial sizes or a negative padding."""
    if tuple(dilations) != (1, 1) or None in tuple(x_shape[1:3]) or None in dy.shape[1:3]:
        return None
    (kh, kw, cg, cout), cin = w.shape.as_list(), x_shape[-1]
    groups, og = cin // cg, cout // (cin // cg)
    pads = []
    for axis, k in enumerate((kh, kw)):
        size, out, s = x_shape[1 + axis], dy.shape[1 + axis], strides[axis]
        _, (before, _) = cg_lib.output_and_padding(size, k, s, 1, padding,
                                                   tuple(explicit[2 + 2 * axis:4 + 2 * axis]))
        pads.append((k - 1 - before, size + before - 1 - (out - 1) * s))
    if min(min(p) for p in pads) < 0:
        return None
    dyz = _insert_zeros(dy, strides)
    kernel = tf.reshape(tf.transpose(tf.reshape(tf.reverse(w, [0, 1]), [kh, kw, cg, groups, og]),
                                     [0, 1, 4, 3, 2]), [kh, kw, og, cin])
    dyz = tf.pad(dyz, [[0, 0], list(pads[0]), list(pads[1]), [0, 0]])
    dx = tf.raw_ops.Conv2D(input=dyz, filter=kernel, strides=[1, 1, 1, 1], padding="VALID")
    mark([dx.op])
    return dx


def _insert_zeros(t, strides):
    """NHWC `t` with `s - 1` zero rows (columns) between its rows (columns)."""
    for axis, s in ((1, strides[0]), (2, strides[1])):
        if s == 1:
            continue
        shape = tf.unstack(tf.shape(t))
        spread = tf.concat([tf.expand_dims(t, axis + 1),
                            tf.zeros(shape[:axis + 1] + [s - 1] + shape[axis + 1:], t.dtype)],
                           axis + 1)
        merged = tf.reshape(spread, shape[:axis] + [shape[axis] * s] + shape[axis + 1:])
        t = merged[:, :(t.shape[1] - 1) * s + 1] if axis == 1 else merged[:, :, :(t.shape[2] - 1) * s + 1]
    return t
