"""Per-example gradients of a 2-D convolution (`Conv2D`, and Conv1D lowered
to it).

Math: with `tap_{p,q}(a_i)[y, x, c]` the input value that kernel tap `(p, q)`
multiplies at output position `(y, x)` (see `conv_geometry.py`),

    dW_i[p, q, c, o] = sum_{uses} sum_{y,x} tap_{p,q}(a_i)[y, x, c] g_i[y, x, o]
    db_i[o]          = sum_{uses} sum_{y,x} g_i[y, x, o]

i.e. a dense layer over the `T = Ho*Wo` im2col patches. Four kernels compute
`dW_i` (no Python loop over examples in any of them):

* `"taps"`: for each of the kh*kw taps one batched matmul
  `[B, Cin, T] x [B, T, Cout]`; never builds the patch matrix.
* `"gather"`: the patch matrix `[B, T, kh*kw*Cin]` by one gather of the
  padded input (`conv_geometry.gather_im2col`), then one batched matmul.
* `"im2col"`: the same matmul on the taps stacked into the patch matrix.
* `"grouped"`: folds the batch into channel groups, `[1, H, W, B*Cin]`, and
  runs the filter-gradient op `Conv2DBackpropFilter` for a B-group
  convolution, whose filter `[kh, kw, Cin, B*Cout]` is the per-example
  gradient. TF's CPU kernel supports this only for float32 (oneDNN).

`"auto"`: for strided convolutions a patch-matrix kernel ("gather" without
XLA, "im2col" under XLA), else "taps": a strided tap costs a reshaped slice
while a unit-stride tap is a plain slice, so one patch matrix pays off only
with strides; "grouped" is never picked. See README's kernel-choice table,
measured by `python benchmarks/per_example_rules.py --only layers`. A 1x1
conv is the one-tap case: a dense layer.

Norms: Gram form on the im2col patches (uses concatenated along positions, so
cross terms are counted) iff `T (kh kw Cin + Cout) < kh kw Cin Cout`, else the
materialised `dW_i` is squared (see `norms.py`); bias norm `|sum_t g_t|^2`.

NCHW tensors are transposed to NHWC first (TF's CPU Conv2D rejects NCHW for
float64, and the tap arithmetic is written once).
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
class ConvSpec(cg.ConvAttrs):
    """`Conv2D`: kernel_shape = (kh, kw, Cin, Cout); bias `[Cout]`."""


METHODS = ("taps", "gather", "im2col", "grouped")


def taps_kernel_grads(a, g, geo):
    """`[B, kh, kw, Cin, Cout]` by one batched matmul per tap (NHWC inputs)."""
    cin, cout = a.shape[-1], g.shape[-1]
    g2 = tf.reshape(g, [-1, geo.positions, cout])
    per_tap = [
        tf.matmul(tf.reshape(v, [-1, geo.positions, cin]), g2, transpose_a=True)
        for v in cg.tap_views(a, geo)
    ]
    stacked = per_tap[0][:, None] if len(per_tap) == 1 else tf.stack(per_tap, 1)
    return tf.reshape(stacked, [-1, geo.kernel[0], geo.kernel[1], cin, cout])


def _patch_matmul(patches, a, g, geo):
    cin, cout = a.shape[-1], g.shape[-1]
    g2 = tf.reshape(g, [-1, geo.positions, cout])
    out = tf.matmul(patches, g2, transpose_a=True)
    return tf.reshape(out, [-1, geo.kernel[0], geo.kernel[1], cin, cout])


def gather_kernel_grads(a, g, geo):
    """`[B, kh, kw, Cin, Cout]` by one matmul on the gathered patch matrix."""
    return _patch_matmul(cg.gather_im2col(a, geo), a, g, geo)


def im2col_kernel_grads(a, g, geo):
    """`[B, kh, kw, Cin, Cout]` by one matmul on the stacked taps."""
    return _patch_matmul(cg.im2col(a, geo), a, g, geo)


def grouped_kernel_grads(a, g, geo):
    """`[B, kh, kw, Cin, Cout]` via `Conv2DBackpropFilter` of a B-group conv."""
    x, dy, strides, dilations, padding = cg.fold_batch_into_channels(a, g, geo)
    batch = uses_lib.batch_size(a)
    cin, cout = a.shape[-1], g.shape[-1]
    kh, kw = geo.kernel
    filt = tf.raw_ops.Conv2DBackpropFilter(
        input=x,
        filter_sizes=tf.stack([kh, kw, cin, batch * cout]),
        out_backprop=dy,
        strides=strides,
        dilations=dilations,
        padding=padding,
    )
    filt = tf.reshape(filt, [kh, kw, cin, batch, cout])
    return tf.transpose(filt, [3, 0, 1, 2, 4])


_KERNELS = {
    "taps": taps_kernel_grads,
    "gather": gather_kernel_grads,
    "im2col": im2col_kernel_grads,
    "grouped": grouped_kernel_grads,
}


@dataclasses.dataclass(frozen=True)
class ConvRule(PatchRule):
    """Rule for kind `"conv2d"` (spec: `ConvSpec`); `method`: `"auto"` or one of
    `METHODS` (see the module docstring)."""

    KERNELS = _KERNELS
    NAME = "conv"

    def auto_method(self, spec):
        """Taps at stride 1, else a patch matrix (module docstring)."""
        if tuple(spec.strides_hw) == (1, 1):
            return "taps"
        return "im2col" if xla_lib.resolve_xla(self.xla) else "gather"

    def gram_dims(self, spec):
        kh, kw, cin, cout = spec.kernel_shape
        return kh * kw * cin, cout

    def gram_norms(self, nhwc_uses):
        """The Gram form on the im2col patches, uses concatenated along positions."""
        patches = [cg.im2col(a, geo) for a, _, geo in nhwc_uses]
        gs = [tf.reshape(g, [-1, geo.positions, g.shape[-1]]) for _, g, geo in nhwc_uses]
        return norms.gram_squared_norms(tf.concat(patches, 1), tf.concat(gs, 1))


# -- factor statistics (the Kronecker factors' rows) -------------------------------


def input_rows(a, spec):
    """The A factor's rows: the input patch at every output location,
    `[N, kh*kw*Cin]` in the flattened kernel's `(p, q, c)` order."""
    patches = cg.extract_patches(a, spec)
    return tf.reshape(patches, [-1, patches.shape[-1]])


def output_rows(g, spec):
    """The G factor's rows: the output gradient at every location, `[N, Cout]`."""
    g = cg.to_nhwc(g, spec.data_format)
    return tf.reshape(g, [-1, g.shape[-1]])


# -- the record --------------------------------------------------------------------


KIND = LayerKind(
    name="conv2d",
    rule=ConvRule(),
    spec=conv_family.spec_reader(ConvSpec),
    operands=conv_family.operands,
    blocks={"kron": "ConvKroneckerBlock", "diagonal": "ConvDiagonalBlock", "full": "NaiveFullBlock"},
    default_block="kron",
    colour="palegreen",
)
