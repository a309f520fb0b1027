"""Per-example gradients of `y = scale * xhat (+ shift)` (the affine part of
batch/layer/group normalisation).

Math: with `R` the axes (other than the batch axis 0) along which `scale` is
broadcast against `xhat [B, ...]` (right-aligned, numpy rules),

    dscale_i = sum_{uses} sum_R xhat_i * g_i      shaped like `scale`
    dshift_i = sum_{uses} sum_R g_i

The rule takes `scale` right-aligned; however the graph broadcasts it (over
channels-first `[1, C, 1, 1]`, several axes `[T, C]`, a group norm's
`[G, C/G]`), `operands` lays `xhat` and `g` out as `[B, R..., *scale.shape]`.

Norms are always computed from these materialised gradients: they hold
`B * |scale|` floats, never more than the inputs, and one elementwise pass
over `xhat * g` is needed either way, so a Gram form could only cost more.
"""

import dataclasses

import tensorflow as tf

from kfac_graph.layers import norms, parts
from kfac_graph.layers import uses as uses_lib
from kfac_graph.layers.kind import LayerKind, reshape_like, split_operands, variable_shapes
from kfac_graph.layers.scalars import as_dtype


@dataclasses.dataclass(frozen=True)
class ScaleShiftSpec:
    """`y = scale * xhat (+ shift)`, `scale`/`shift` of shape `scale_shape`.

    `scale_shape` is right-aligned against `xhat [B, ...]` by broadcasting; if
    it has the rank of `xhat` its first entry (the batch axis) must be 1.
    """

    scale_shape: tuple
    has_shift: bool = False

    def __post_init__(self):
        object.__setattr__(self, "scale_shape", tuple(int(d) for d in self.scale_shape))


def _reduce_axes(rank, scale_shape):
    """Axes of a rank-`rank` input that `scale_shape` broadcasts along."""
    if len(scale_shape) > rank:
        raise ValueError(f"scale shape {scale_shape} has more axes than xhat")
    full = (1,) * (rank - len(scale_shape)) + tuple(scale_shape)
    if full[0] != 1:
        raise ValueError("scale must not vary along the batch axis")
    return [i for i in range(1, rank) if full[i] == 1]


def _per_example(t, spec):
    """Sums `t [B, ...]` over the broadcast axes, reshaped to `[B, *scale]`."""
    axes = _reduce_axes(t.shape.rank, spec.scale_shape)
    reduced = tf.reduce_sum(t, axis=axes, keepdims=True) if axes else t
    return tf.reshape(reduced, [-1, *spec.scale_shape])


@dataclasses.dataclass(frozen=True)
class ScaleShiftRule:
    """Rule for kind `"scale_and_shift"` (spec: `ScaleShiftSpec`)."""

    def per_example_grads(self, uses, spec):
        """`[B, *scale_shape]` and, if `spec.has_shift`, the same for the shift."""
        uses = uses_lib.as_uses(uses)
        out = [uses_lib.add_all([_per_example(x * g, spec) for x, g in uses])]
        if spec.has_shift:
            out.append(uses_lib.add_all([_per_example(g, spec) for _, g in uses]))
        return out

    def squared_norms(self, uses, spec):
        """`[B]`: squared norm of each example's gradient over scale (+ shift)."""
        return norms.total_squared_norms(self.per_example_grads(uses, spec))


# -- what the rules read from the graph --------------------------------------------


def spec(layer, use):
    """`ScaleShiftSpec` of the layer's variables. A shift alone (the op has no
    scale, `has_scale` False) is the scale rule on `xhat = 1`, whose scale
    gradient is the shift's: its one variable is treated as a scale."""
    shapes = variable_shapes(layer)
    return ScaleShiftSpec(scale_shape=shapes[0], has_shift=len(shapes) == 2)


def operands(layer, use, tensors, grads, batch=None):
    """`(xhat, [g, ...])` such that the layer computes `xhat * scale + shift`,
    laid out `[B, ..., *scale_shape]` for the rule and the blocks (`batch`:
    the batch, for rows whose count per example is known at run time only).

    Each tensor is first read in the shape the matched op read it
    (`operand_shapes`). `xhat` by the use's `normalizer`: `identity`
    (`xhat = x`), `center_scale` (`(x - mean) * inv_std`, Keras's batch,
    layer and group normalisation), `fused_inference` (`(x - mean) *
    rsqrt(var + eps)`), `exp` (a log-parametrised scale `x * s`, `s = exp(v)`
    or `-exp(v)`: `x * s`, the derivative by `v`), `negated` (`x * -v`: `-x`)
    and `fused_training` (the batch variance FusedBatchNorm outputs is
    Bessel-corrected: multiplied back by
    `(n - 1) / n`); `1` for a shift alone. Then `xhat` (broadcast to the
    output) and each `g` have the axes along which the scale varies
    (`scale_broadcast`, numpy broadcasting: `[1, C, 1, 1]` channels-first,
    `[T, C]`, group norm's `[G, C/G]`) moved last and read as the scale's
    own shape (row-major, as a reshape of the variable lays it out). A use
    of a box of the variable (`parts.py`: a scale or a shift alone, GRU's
    bias rows) reads them as the box's shape, zero-padded to the variable's."""
    attrs = layer.use_attrs[use]
    if "run_time_rows" in attrs:  # rows [k B, ..], k known at run time only
        tensors, grads = split_operands(tensors, grads, 0, batch)
    var_shape = variable_shapes(layer)[0]
    box = parts.part(layer, use, 0)
    shape = parts.box_shape(box) if box is not None else var_shape
    broadcast = tuple(attrs.get("scale_broadcast") or shape)
    grads = [_read_as(g, attrs.get("output_shape")) for g in grads]
    if not attrs.get("has_scale", True):
        xhat = tf.ones_like(grads[0])
    else:
        shapes = tuple(attrs.get("operand_shapes") or ())
        shapes += (None,) * (len(tensors) - len(shapes))
        # a mask the pass saw cast to floats (``tf.cast(ids == k, float) * v``) comes as it was
        tensors = [t if t.dtype.is_floating else tf.cast(t, grads[0].dtype) for t in tensors]
        xhat = _normalised(attrs, [_read_as(t, s) for t, s in zip(tensors, shapes)], broadcast)
        xhat = tf.broadcast_to(xhat, tf.shape(grads[0]))
    lay_out = lambda t: parts.pad_box(_scale_last(t, broadcast, shape), box, var_shape)  # noqa: E731
    return lay_out(xhat), [lay_out(g) for g in grads]


def _read_as(tensor, shape):
    """`tensor` reshaped to a static shape with at most one unknown axis."""
    if shape is None or sum(d is None for d in shape) > 1:
        return tensor
    return reshape_like(tensor, shape)


def _scale_last(t, broadcast, var_shape):
    """`t [B, ...]` with the axes where `broadcast` (right-aligned) is not 1
    moved last (in order) and merged into `var_shape`: `[B, rest, *var_shape]`."""
    rank = t.shape.rank
    full = (1,) * (rank - len(broadcast)) + broadcast[-rank:]
    varying = [i for i in range(1, rank) if full[i] != 1]
    rest = [i for i in range(1, rank) if full[i] == 1]
    if varying != list(range(rank - len(varying), rank)):
        t = tf.transpose(t, [0, *rest, *varying])
    dims = [t.shape[i] if t.shape[i] is not None else tf.shape(t)[i]
            for i in range(1, 1 + len(rest))]
    if t.shape[1 + len(rest):].as_list() == list(var_shape):
        return t
    return tf.reshape(t, [-1, *dims, *var_shape])


def _normalised(attrs, tensors, broadcast):
    normalizer = attrs.get("normalizer", "identity")
    x = tensors[0]
    if normalizer == "identity":
        return x
    if normalizer == "negated":  # x * -v: d/dv = -x (PReLU)
        return -x
    if normalizer == "exp":  # x * s, s = (-)exp(v): d/dv = x * s, s read as the op reads it
        return x * tf.reshape(tf.cast(tensors[1], x.dtype), broadcast)
    if normalizer == "center_scale":
        mean, inv_std = (tf.cast(t, x.dtype) for t in tensors[1:3])
        return (x - mean) * inv_std
    # FusedBatchNorm: mean and variance are [C], laid out as the scale is.
    shape = (1,) * (x.shape.rank - len(broadcast)) + broadcast
    mean, var = (tf.reshape(tf.cast(t, x.dtype), shape) for t in tensors[1:3])
    if normalizer == "fused_training":
        n = tf.cast(tf.size(x), x.dtype) / tf.cast(tf.size(tensors[1]), x.dtype)
        var = var * (n - 1) / tf.maximum(n, 1)
    elif normalizer != "fused_inference":
        raise ValueError(f"unknown normalizer {normalizer!r}")
    return (x - mean) * tf.math.rsqrt(var + as_dtype(attrs.get("epsilon", 1e-3), x.dtype))


KIND = LayerKind(
    name="scale_and_shift",
    rule=ScaleShiftRule(),
    spec=spec,
    operands=operands,
    blocks={"auto": "scale_and_shift_block", "diagonal": "ScaleAndShiftDiagonalBlock",
            "full": "ScaleAndShiftFullBlock"},
    default_block="auto",
    colour="plum",
)
