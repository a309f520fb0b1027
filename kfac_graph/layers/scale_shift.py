"""Per-example gradients of `y = scale * xhat (+ shift)` (the affine part of
batch/layer/group normalisation).

Math: with `R` the axes (other than the batch axis 0) along which `scale` is
broadcast against `xhat [B, ...]` (right-aligned, numpy rules),

    dscale_i = sum_{uses} sum_R xhat_i * g_i      shaped like `scale`
    dshift_i = sum_{uses} sum_R g_i

Norms are always computed from these materialised gradients: they hold
`B * |scale|` floats, never more than the inputs, and one elementwise pass
over `xhat * g` is needed either way, so a Gram form could only cost more.
"""

import dataclasses

import tensorflow as tf

from kfac_graph.layers import norms, parts
from kfac_graph.layers import uses as uses_lib
from kfac_graph.layers.kind import LayerKind, variable_shapes


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


def operands(layer, use, tensors, grads):
    """`(xhat, [g, ...])` such that the layer computes `xhat * scale + shift`.

    `xhat` by the use's `normalizer`: `identity` (`xhat = x`),
    `center_scale` (`(x - mean) * inv_std`, Keras's batch and layer
    normalisation), `fused_inference` (`(x - mean) * rsqrt(var + eps)`) and
    `fused_training` (the batch variance FusedBatchNorm outputs is
    Bessel-corrected: multiplied back by `(n - 1) / n`); `1` for a shift
    alone. For a vector scale or shift of an `NC...` op (BiasAdd,
    FusedBatchNorm in NCHW) both are moved to channels-last, where the
    rules and blocks broadcast a vector. A use of a box of the variable
    (`parts.py`: a scale or shift alone) has both zero-padded to the whole
    variable's shape."""
    attrs = layer.use_attrs[use]
    vector = len(layer.variables[0].shape) == 1
    box, shape = parts.part(layer, use, 0), layer.variables[0].shape
    grads = [parts.pad_trailing(_channels_last(attrs, g, vector), box, shape) for g in grads]
    if not attrs.get("has_scale", True):
        return tf.ones_like(grads[0]), grads
    xhat = _channels_last(attrs, _normalised(attrs, tensors), vector)
    return parts.pad_trailing(xhat, box, shape), grads


def _channels_last(attrs, tensor, vector):
    fmt = attrs.get("data_format", "NHWC")
    rank = tensor.shape.rank
    if fmt.startswith("NC") and rank and rank >= 3 and vector:
        return tf.transpose(tensor, [0, *range(2, rank), 1])
    return tensor


def _normalised(attrs, tensors):
    normalizer = attrs.get("normalizer", "identity")
    x = tensors[0]
    if normalizer == "identity":
        return x
    if normalizer == "center_scale":
        mean, inv_std = (tf.cast(t, x.dtype) for t in tensors[1:3])
        return (x - mean) * inv_std
    fmt = attrs.get("data_format", "NHWC")
    channel_shape = [1, -1, 1, 1] if fmt.startswith("NC") else [1, 1, 1, -1]
    mean, var = (tf.reshape(tf.cast(t, x.dtype), channel_shape) for t in tensors[1:3])
    if normalizer == "fused_training":
        axes = [0, 2, 3] if fmt.startswith("NC") else [0, 1, 2]
        n = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
        var = var * (n - 1) / tf.maximum(n, 1)
    elif normalizer != "fused_inference":
        raise ValueError(f"unknown normalizer {normalizer!r}")
    return (x - mean) * tf.math.rsqrt(var + tf.cast(attrs.get("epsilon", 1e-3), x.dtype))


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
