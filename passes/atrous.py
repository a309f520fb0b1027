"""Atrous convolutions: the dilated convolution that TensorFlow writes as
``SpaceToBatchND -> conv -> BatchToSpaceND`` (Keras's Conv1D, DepthwiseConv1D,
DepthwiseConv2D, SeparableConv1D/2D and, on some paths, Conv2D and Conv3D
with ``dilation_rate > 1``; ``tf.nn.atrous_conv2d``; ``tf.nn.convolution`` with
dilations).

Math, per spatial axis with block ``d``: SpaceToBatchND pads the input ``x``
(length ``L``) by its constant ``paddings`` ``(p0, p1)`` and deals the padded
positions out to ``d`` phases (``d*B`` rows); the conv runs on every phase
with dilation 1, stride 1 and its own padding ``(q0, q1)``; BatchToSpaceND
interleaves the phases back and crops ``(c0, c1)``. Output ``j`` then reads

    out[j] = sum_t w[t] x[j + d*t - (p0 - c0 + d*q0)],

which is the convolution with dilation ``d`` and EXPLICIT padding
``(p0 - c0 + d*q0, p1 - c1 + d*q1)`` on ``x`` itself (batch B): its output
length ``L + pads - d*(k-1)`` is BatchToSpaceND's. A negative pad (the crop
eats into ``x``) has no such convolution.

Contract: ``atrous_attrs(g, roles, x) -> dict`` for a match of the atrous
patterns (roles ``s2b``, ``op``, ``b2s``; ``x`` the tensor SpaceToBatchND
reads): the use attributes of that dilated convolution in the op's NHWC
(Conv3D: NDHWC) layout (``dilations``, ``strides``, ``padding``, ``explicit_paddings``,
``data_format``, ``input_shape``, ``output_shape``), or
``{"unsupported": reason}`` (one line) for a form it cannot state exactly;
the layer then falls back to ``"generic"`` with that reason. A 1-D block
(Conv1D: the conv sees ``[d*B, 1, L', C]``, the phases' ExpandDims seen
through) maps to the one spatial axis of the op that is not a unit axis
added there.
"""
from __future__ import annotations

import networkx as nx
import numpy as np

from passes import ir


class Unsupported(Exception):
    """A form of the atrous pattern with no exact dilated convolution."""


def atrous_attrs(g: nx.DiGraph, roles, x: str) -> dict:
    try:
        return _attrs(g, roles, x)
    except Unsupported as why:
        return {"unsupported": f"dilated convolution by SpaceToBatchND/BatchToSpaceND "
                               f"(op {roles['op']}): {why}"}


def _const(g, node, slot, what):
    tensor = ir.resolve(g, g.nodes[node]["raw_inputs"][slot])
    if ir.split_tensor(tensor)[0] not in g:  # (folded away: read what the op reads now)
        tensor = g.nodes[node]["inputs"][slot]
    value = ir.const_value(g, tensor)
    if value is None:
        raise Unsupported(f"its {what} not constant")
    return value.astype(int).tolist()


def _paddings_and_crops(g, s2b, b2s):
    """SpaceToBatchND's paddings and BatchToSpaceND's crops; where they are
    computed from a size known at run time only (an input of any size,
    padded to a multiple of the block and cropped back), the paddings less
    the crops, the same under every probe (``passes.shape_probe``), with no
    crops: only that difference enters the convolution's padding."""
    try:
        return _const(g, s2b, 2, "paddings are"), _const(g, b2s, 2, "crops are")
    except Unsupported:
        probed = g.graph.get("probed_values", {})
        pads, crops = probed.get(s2b), probed.get(b2s)
        if not pads or not crops or len(pads) != len(crops):
            raise
    net = {tuple(map(tuple, np.subtract(p, c).tolist())) for p, c in zip(pads, crops)}
    if len(net) != 1:
        raise Unsupported("its paddings less its crops vary with its input's size")
    (net,) = net
    return [list(pair) for pair in net], [[0, 0] for _ in net]


def _attrs(g, roles, x) -> dict:
    s2b, op, b2s = roles["s2b"], roles["op"], roles["b2s"]
    block = _const(g, s2b, 1, "block shape is")
    paddings, crops = _paddings_and_crops(g, s2b, b2s)
    if block != _const(g, b2s, 1, "block shape is"):
        raise Unsupported("SpaceToBatchND and BatchToSpaceND have different block shapes")
    attrs = g.nodes[op]["attrs"]
    kernel = ir.shape_of(g, g.nodes[op]["raw_inputs"][1])
    inner = ir.shape_of(g, g.nodes[op]["raw_inputs"][0])
    x_shape, y_shape = ir.shape_of(g, x), g.nodes[b2s]["shapes"][0]
    if (None in (kernel, inner, x_shape, y_shape) or len(kernel) not in (4, 5)
            or len(inner) != len(kernel)):
        raise Unsupported("its shapes are not known while tracing")
    n = len(kernel) - 2  # the op's spatial axes
    fmt = "NHWC" if n == 2 else "NDHWC"
    if attrs.get("data_format", fmt) != fmt:
        raise Unsupported(f"the conv's data format is {attrs['data_format']}")
    if any(v != 1 for v in tuple(attrs.get("strides", ())) + tuple(attrs.get("dilations", ()))):
        raise Unsupported("the conv itself is strided or dilated")
    axes = _spatial_axes(len(block), len(x_shape), inner, ir.shape_of(g, ir.tensor_name(s2b)),
                         kernel)
    own = _own_padding(attrs, kernel)
    dilations, pads = [1] * n, [(0, 0)] * n
    for i, axis in enumerate(axes):
        d, (p0, p1), (c0, c1) = block[i], paddings[i], crops[i]
        q0, q1 = own[axis]
        dilations[axis] = d
        pads[axis] = (p0 - c0 + d * q0, p1 - c1 + d * q1)
    if any(p < 0 for pair in pads for p in pair):
        raise Unsupported(f"its crops exceed its paddings (explicit padding {pads} on the input)")
    for axis in set(range(n)) - set(axes):
        pads[axis] = own[axis]
    in_shape, out_shape = _nhwc(x_shape, axes), _nhwc(y_shape, axes)
    for axis in range(n):
        size, want = in_shape[axis + 1], out_shape[axis + 1]
        span = dilations[axis] * (kernel[axis] - 1)
        if None not in (size, want) and size + sum(pads[axis]) - span != want:
            raise Unsupported("its output size is not that of a dilated convolution")
    explicit = (0, 0, *(p for pair in pads for p in pair), 0, 0)
    return {"dilations": (1, *dilations, 1), "strides": (1,) * (n + 2), "data_format": fmt,
            "padding": "EXPLICIT" if any(explicit) else "VALID",
            "explicit_paddings": explicit if any(explicit) else (),
            "input_shape": in_shape, "output_shape": out_shape}


def _spatial_axes(m, rank, inner, phases, kernel) -> tuple:
    """The op's spatial axes (0: H, 1: W; Conv3D: 0: D, 1: H, 2: W) that the
    block's axes are."""
    if m == rank - 2 == len(kernel) - 2:
        return tuple(range(m))
    if m == 1 and rank == 4:  # a block on H only (the conv's W undilated)
        return (0,)
    if m == 1 and rank == 3 and phases is not None:  # Conv1D: a unit axis added by the op
        for unit in (0, 1):
            if (inner[unit + 1] == 1 and kernel[unit] == 1
                    and _same(inner[:unit + 1] + inner[unit + 2:], phases)):
                return (1 - unit,)
    raise Unsupported(f"a {m}-D block on a rank-{rank} input is not a 1-D, 2-D or 3-D "
                      f"convolution's")


def _same(a, b) -> bool:
    return len(a) == len(b) and all(u is None or v is None or u == v for u, v in zip(a, b))


def _own_padding(attrs, kernel) -> list:
    """The conv's own ``(before, after)`` padding per spatial axis (stride 1)."""
    padding, n = attrs.get("padding", "VALID"), len(kernel) - 2
    if padding == "SAME":
        return [((k - 1) // 2, k - 1 - (k - 1) // 2) for k in kernel[:n]]
    if padding == "EXPLICIT":
        p = attrs.get("explicit_paddings", ())
        return [(p[2 * i], p[2 * i + 1]) for i in range(1, n + 1)]
    return [(0, 0)] * n


def _nhwc(shape, axes) -> tuple:
    """A rank-3 ``[B, L, C]`` shape as the op's ``[B, H, W, C]`` (a unit axis
    where the op added one); a rank-4 or rank-5 shape as it is."""
    shape = tuple(shape)
    if len(shape) != 3:
        return shape
    return (shape[0], shape[1], 1, shape[2]) if axes == (0,) else (shape[0], 1, shape[1], shape[2])
