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

from kfac_graph.per_example import norms
from kfac_graph.per_example import uses as uses_lib


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
