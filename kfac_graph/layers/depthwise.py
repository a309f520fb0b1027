"""Per-example gradients of a depthwise convolution (`DepthwiseConv2dNative`).

Math: output channel `c*M + m` is input channel `c` convolved with
`W[:, :, c, m]`, so with the tap views of `conv_geometry.py`

    dW_i[p, q, c, m] = sum_{uses} sum_{y,x} tap_{p,q}(a_i)[y, x, c] g_i[y, x, c*M + m]
    db_i[c*M + m]    = sum_{uses} sum_{y,x} g_i[y, x, c*M + m]

Kernels (no Python loop over examples):

* `"grouped"`: fold the batch into the channels, `[1, H, W, B*C]`, with the
  output gradient `[1, Ho, Wo, B*C*M]` (channel `(b*C + c)*M + m`, which is
  the natural memory order of `g` after moving the batch next to the channels).
  `DepthwiseConv2dNativeBackpropFilter` then returns `[kh, kw, B*C, M]`: the
  per-example gradients exactly, with no cross-channel waste (unlike folding
  the batch into a dense conv's groups). TF's CPU kernel rejects dilations
  for float64 (and for some float32 VALID cases), so "auto" uses it only for
  dilation 1.
* `"taps"`: for each tap an elementwise product with `g` reduced over the
  positions.

`"auto"`: without XLA "grouped", under XLA (and for dilations > 1) "taps".
Without XLA one oneDNN call beats nine multiply-reduce passes; under XLA the
CPU lowering of the folded filter gradient is very slow, and "taps" fuses.
See README's kernel-choice table, measured by
`python benchmarks/per_example_rules.py --only layers`.

Norms: the per-example gradient `[kh, kw, C, M]` is small, so it is
materialised and squared unless the per-channel Gram form is cheaper, i.e.
`T (kh kw + M) < kh kw M` (`T` output positions over all uses; only for
tiny outputs), in which case
`|dW_i|^2 = sum_c sum_{t,t'} (P_{t,c} . P_{t',c})(g_{t,c} . g_{t',c})`.
"""

import dataclasses

import tensorflow as tf

from kfac_graph.layers import conv_family
from kfac_graph.layers import conv_geometry as cg
from kfac_graph.layers import norms
from kfac_graph.layers import uses as uses_lib
from kfac_graph.layers import xla as xla_lib
from kfac_graph.layers.conv_family import PatchRule
from kfac_graph.layers.kind import LayerKind


@dataclasses.dataclass(frozen=True)
class DepthwiseSpec(cg.ConvAttrs):
    """`DepthwiseConv2dNative`: kernel_shape = (kh, kw, C, M); bias `[C*M]`."""


METHODS = ("taps", "grouped")


def _split_channels(g, channels):
    """`[B, Ho, Wo, C*M]` -> `[B, Ho, Wo, C, M]`."""
    return tf.reshape(g, [-1, g.shape[1], g.shape[2], channels, g.shape[3] // channels])


def taps_kernel_grads(a, g, geo):
    """`[B, kh, kw, C, M]` from per-tap products reduced over positions."""
    c = a.shape[-1]
    gm = _split_channels(g, c)
    per_tap = [tf.reduce_sum(v[..., None] * gm, axis=[1, 2]) for v in cg.tap_views(a, geo)]
    stacked = per_tap[0][:, None] if len(per_tap) == 1 else tf.stack(per_tap, 1)
    return tf.reshape(stacked, [-1, geo.kernel[0], geo.kernel[1], c, g.shape[-1] // c])


def grouped_kernel_grads(a, g, geo):
    """`[B, kh, kw, C, M]` via the depthwise filter gradient, batch in channels."""
    x, dy, strides, dilations, padding = cg.fold_batch_into_channels(a, g, geo)
    batch = uses_lib.batch_size(a)
    c, cm = a.shape[-1], g.shape[-1]
    kh, kw = geo.kernel
    filt = tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
        input=x,
        filter_sizes=tf.stack([kh, kw, batch * c, cm // c]),
        out_backprop=dy,
        strides=strides,
        dilations=dilations,
        padding=padding,
    )
    filt = tf.reshape(filt, [kh, kw, batch, c, cm // c])
    return tf.transpose(filt, [2, 0, 1, 3, 4])


_KERNELS = {"taps": taps_kernel_grads, "grouped": grouped_kernel_grads}


def _channel_gram_norms(nhwc_uses):
    """Per-channel Gram form of `|dW_i|^2` over all uses' positions (channel c
    is a group with one input channel, `norms.grouped_gram_squared_norms`)."""
    patches, grads = [], []
    for a, g, geo in nhwc_uses:
        c = a.shape[-1]
        patches.append(cg.group_features(cg.im2col(a, geo), c, c))  # [B, T, C, kh*kw]
        grads.append(tf.reshape(g, [-1, geo.positions, c, g.shape[-1] // c]))
    return norms.grouped_gram_squared_norms(tf.concat(patches, 1), tf.concat(grads, 1))


@dataclasses.dataclass(frozen=True)
class DepthwiseRule(PatchRule):
    """Rule for kind `"depthwise_conv2d"` (spec: `DepthwiseSpec`); `method`: `"auto"` or one of
    `METHODS` (see the module docstring)."""

    KERNELS = _KERNELS
    NAME = "depthwise"

    def auto_method(self, spec):
        """Grouped without XLA at dilation 1, else taps (module docstring)."""
        if xla_lib.resolve_xla(self.xla) or spec.dilations_hw != (1, 1):
            return "taps"
        return "grouped"

    def gram_dims(self, spec):
        kh, kw, _, m = spec.kernel_shape
        return kh * kw, m

    def gram_norms(self, nhwc_uses):
        return _channel_gram_norms(nhwc_uses)

    def groups(self, spec):
        """Each of the C input channels is a group (``[kh, kw, C, M]``)."""
        return spec.kernel_shape[2]


# -- factor statistics (the Kronecker factors' rows) -------------------------------


def input_rows(a, spec):
    """The per-channel A factors' rows: channel c's `kh*kw` patch at every
    output location, `[N, C, kh*kw]`."""
    channels = spec.kernel_shape[2]
    patches = cg.extract_patches(a, spec)
    return cg.group_features(tf.reshape(patches, [-1, patches.shape[-1]]), channels, channels)


def output_rows(g, spec):
    """The per-channel G factors' rows: the M outputs channel c feeds, at
    every location, `[N, C, M]`."""
    _, _, channels, multiplier = spec.kernel_shape
    return tf.reshape(cg.to_nhwc(g, spec.data_format), [-1, channels, multiplier])


# -- the record --------------------------------------------------------------------


KIND = LayerKind(
    name="depthwise_conv2d",
    rule=DepthwiseRule(),
    spec=conv_family.spec_reader(DepthwiseSpec),
    operands=conv_family.operands,
    blocks={"kron": "DepthwiseConvKroneckerBlock", "kron_expand": "DepthwiseConvKroneckerBlock",
            "kron_reduce": "DepthwiseConvKroneckerReduceBlock",
            "diagonal": "DepthwiseConvDiagonalBlock",
            "full": "NaiveFullBlock"},
    default_block="kron",
    colour="khaki",
)
