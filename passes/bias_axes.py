"""Where a dense or convolution layer's bias lies in its output.

``bias_fits(g, m, channel_axis)``: whether the variable ``m["b"]`` that
``m["add"]`` adds to ``m["op"]``'s output is the layer's bias, one entry per
output channel along ``channel_axis``; ``dense_channel_axis(g, m)``: that
axis for a dense op (the last, or where an Einsum puts its outputs).
"""
from __future__ import annotations

from passes import ir
from passes.einsum_2d import einsum_2d_form
from passes.row_axes import axis_in


def var_shape(g, node) -> tuple:
    """The variable's (a part's or an adapter kernel's own) static shape; () when unknown."""
    if g.nodes[node].get("part") is not None or g.nodes[node].get("lora") is not None:
        return g.nodes[node]["shapes"][0]
    return g.graph["variables"][g.nodes[node]["variable"]].shape or ()


def bias_fits(g, m, channel_axis) -> bool:
    """Whether the variable ``m['b']`` added by ``m['add']`` is a bias ``[C]``
    along ``channel_axis`` of ``m['op']``'s output; on the last axis also one
    stored with leading unit axes, ``[1, .., 1, C]`` (raw code's
    ``tf.Variable(tf.zeros([1, d]))``), added by an Add (its per-example
    gradients take the variable's shape, ``invariants.to_variable_shape``).
    An Add broadcasts its raw bias operand right-aligned (``b[:, None]`` on
    ``[B, C, n]``); where it reads the output with unit axes dropped
    (``tf.linalg.matvec``'s ``[B, C, 1]`` squeezed), the channel axis is
    taken where it lies in the output as read."""
    bias_shape = var_shape(g, m["b"])
    out_shape = g.nodes[m["op"]]["shapes"][0]
    if not bias_shape or out_shape is None:
        return False
    if channel_axis != -1:
        out_shape, channel_axis = _as_added(g, m, out_shape, channel_axis)
    if len(bias_shape) > len(out_shape):
        return False
    if len(bias_shape) != 1 and (
            any(d != 1 for d in bias_shape[:-1]) or g.nodes[m["add"]]["op"] == "BiasAdd"
            or channel_axis % len(out_shape) != len(out_shape) - 1):
        return False
    if g.nodes[m["add"]]["op"] == "BiasAdd":
        # the BiasAdd's own channel axis must be the layer's (Keras's `add`
        # writes a channels-first bias as an NHWC BiasAdd when C equals W)
        fmt = g.nodes[m["add"]]["attrs"].get("data_format", "NHWC")
        own = 1 if fmt.startswith("NC") else -1
        if own % len(out_shape) != channel_axis % len(out_shape):
            return False
    elif channel_axis != -1:
        # An Add: the raw bias operand must broadcast along the channel axis.
        raw = [t for t in g.nodes[m["add"]]["raw_inputs"]
               if ir.resolve(g, t) == ir.tensor_name(m["b"])]
        shape = ir.shape_of(g, raw[0]) if raw else None
        rank = len(out_shape)
        if shape is None or len(shape) > rank:
            return False
        axes = [i for i, d in enumerate((1,) * (rank - len(shape)) + tuple(shape)) if d != 1]
        return axes in ([channel_axis % rank], []) and out_shape[channel_axis] in (
            bias_shape[-1], None)
    return out_shape[channel_axis] in (bias_shape[-1], None)


def _as_added(g, m, out_shape, channel_axis):
    """``(shape, axis)``: the op's output as the Add reads it (its operand
    other than the bias) and the channel axis there (-1 when last)."""
    bias = ir.tensor_name(m["b"])
    read = [ir.shape_of(g, t) for t in g.nodes[m["add"]]["raw_inputs"] if ir.resolve(g, t) != bias]
    if len(read) != 1 or read[0] is None or tuple(read[0]) == tuple(out_shape):
        return out_shape, channel_axis
    if [d for d in read[0] if d != 1] != [d for d in out_shape if d != 1]:
        return out_shape, channel_axis
    axis = axis_in(out_shape, read[0], channel_axis % len(out_shape))
    return read[0], -1 if axis == len(read[0]) - 1 else axis


def dense_channel_axis(g, m) -> int:
    """The axis of a dense op's output that holds its outputs: the last, or
    where an Einsum puts them (``"bin,oi->bon"``: 1, ``passes.einsum_2d``)."""
    data = g.nodes[m["op"]]
    form = einsum_2d_form(data["attrs"].get("equation", "")) if data["op"] == "Einsum" else None
    if form is None or form[2] is None:
        return -1
    axis = form[2][-1]
    return -1 if axis == len(form[2]) - 1 else axis
