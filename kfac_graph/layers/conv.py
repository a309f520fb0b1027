"""Per-example gradients of a convolution (`Conv2D`, and Conv1D lowered to
it; `Conv3D`, kind "conv3d", the same rule over three spatial axes: taps
`(r, p, q)`, kernel `[kd, kh, kw, Cin, Cout]`; see `conv3d.py`).

Math: with `tap_{p,q}(a_i)[y, x, c]` the input value that kernel tap `(p, q)`
multiplies at output position `(y, x)` (see `conv_geometry.py`),

    dW_i[p, q, c, o] = sum_{uses} sum_{y,x} tap_{p,q}(a_i)[y, x, c] g_i[y, x, o]
    db_i[o]          = sum_{uses} sum_{y,x} g_i[y, x, o]

i.e. a dense layer over the `T = Ho*Wo` im2col patches. A grouped
convolution (`spec.groups` G > 1, kernel `[kh, kw, cg, Cout]`, `cg = Cin/G`,
`og = Cout/G`; see `conv_geometry.py`) is G such layers side by side:

    dW_i[p, q, c, j*og + o] = sum_{uses} sum_{y,x} tap_{p,q}(a_i)[y, x, j*cg + c]
                                                  g_i[y, x, j*og + o]

Four kernels compute `dW_i`, every one for any G (no Python loop over
examples or groups in any of them; "taps", "gather" and "im2col" run a
grouped convolution as an ungrouped one on `B*G` examples,
`groups_as_examples`):

* `"taps"`: for each of the kh*kw taps one batched matmul
  `[B, Cin, T] x [B, T, Cout]` (grouped: `[B*G, cg, T] x [B*G, T, og]`);
  never builds the patch matrix.
* `"gather"`: the patch matrix `[B, T, kh*kw*Cin]` by one gather of the
  padded input (`conv_geometry.gather_im2col`), then one batched matmul
  (grouped: over the groups too).
* `"im2col"`: the same contraction on the taps stacked into the patch matrix.
* `"grouped"`: folds the batch into channel groups, `[1, H, W, B*Cin]`, and
  runs the filter-gradient op `Conv2DBackpropFilter` for a B*G-group
  convolution, whose filter `[kh, kw, cg, B*Cout]` is the per-example
  gradient. TF's CPU kernel supports this only for float32 (oneDNN; other
  dtypes take "taps"), and only in 2-D.

`"auto"`: "grouped" for a grouped 2-D convolution without XLA (2-3x faster
than the others there: each group's matmuls are small; XLA's CPU lowering of
that op takes seconds); otherwise for strided convolutions a patch-matrix
kernel ("gather" without XLA, "im2col" under XLA), else "taps": a strided
tap costs a reshaped slice while a unit-stride tap is a plain slice, so one
patch matrix pays off only with strides. See README's kernel-choice table,
measured by `python benchmarks/per_example_rules.py --only layers`. A 1x1
conv is the one-tap case: a dense layer.

Norms: Gram form on the im2col patches (uses concatenated along positions, so
cross terms are counted; grouped: per group, summed) iff
`T (kh kw cg + og) < kh kw cg og`, else the materialised `dW_i` is squared
(see `norms.py`); bias norm `|sum_t g_t|^2`.

NCHW tensors are transposed to NHWC first (TF's CPU Conv2D rejects NCHW for
float64, and the tap arithmetic is written once).
"""

import dataclasses
import functools
import math

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
    """`Conv2D`: kernel_shape = (kh, kw, Cin/G, Cout); bias `[Cout]`; `groups` G
    from `input_channels` (see `conv_geometry.ConvAttrs`)."""


METHODS = ("taps", "gather", "im2col", "grouped")


def groups_as_examples(kernel):
    """`kernel` (written for an ungrouped convolution) for any G: a grouped
    convolution runs as an ungrouped one on `B*G` examples, group j of
    example i being example `i*G + j` with `cg` input and `og` output
    channels; `dW[i*G + j, p, q, c, o]` goes to `dW_i[p, q, c, j*og + o]`.
    Two transposes in and a small one out, whatever the number of taps."""
    @functools.wraps(kernel)
    def any_groups(a, g, geo):
        if geo.groups == 1:
            return kernel(a, g, geo)
        groups, rank = geo.groups, len(geo.kernel)

        def fold(t):
            channels = t.shape[-1]
            split = tf.reshape(t, [-1, *t.shape[1:-1], groups, channels // groups])
            moved = tf.transpose(split, [0, rank + 1, *range(1, rank + 1), rank + 2])
            return tf.reshape(moved, [-1, *t.shape[1:-1], channels // groups])

        per_group = kernel(fold(a), fold(g), dataclasses.replace(geo, groups=1))
        cg_, og = per_group.shape[-2], per_group.shape[-1]
        split = tf.reshape(per_group, [-1, groups, *geo.kernel, cg_, og])
        moved = tf.transpose(split, [0, *range(2, rank + 3), 1, rank + 3])
        return tf.reshape(moved, [-1, *geo.kernel, cg_, groups * og])
    return any_groups


def _kernel_shape(a, g, geo):
    """`[B, kh, kw, Cin, Cout]` (3-D: `[B, kd, kh, kw, Cin, Cout]`): an
    ungrouped convolution's per-example kernel gradients' shape."""
    return [-1, *geo.kernel, a.shape[-1], g.shape[-1]]


@groups_as_examples
def taps_kernel_grads(a, g, geo):
    """`[B, kh, kw, cg, Cout]` by one batched contraction per tap (NHWC inputs)."""
    cin = a.shape[-1]
    g2 = tf.reshape(g, [-1, geo.positions, g.shape[-1]])
    per_tap = [tf.matmul(tf.reshape(v, [-1, geo.positions, cin]), g2, transpose_a=True)
               for v in cg.tap_views(a, geo)]
    stacked = per_tap[0][:, None] if len(per_tap) == 1 else tf.stack(per_tap, 1)
    return tf.reshape(stacked, _kernel_shape(a, g, geo))


def _patch_matmul(patches, a, g, geo):
    g2 = tf.reshape(g, [-1, geo.positions, g.shape[-1]])
    return tf.reshape(tf.matmul(patches, g2, transpose_a=True), _kernel_shape(a, g, geo))


@groups_as_examples
def gather_kernel_grads(a, g, geo):
    """`[B, kh, kw, cg, Cout]` by one contraction on the gathered patch matrix."""
    return _patch_matmul(cg.gather_im2col(a, geo), a, g, geo)


@groups_as_examples
def im2col_kernel_grads(a, g, geo):
    """`[B, kh, kw, cg, Cout]` by one contraction on the stacked taps."""
    return _patch_matmul(cg.im2col(a, geo), a, g, geo)


def grouped_kernel_grads(a, g, geo):
    """`[B, kh, kw, cg, Cout]` via `Conv2DBackpropFilter` of a B*G-group conv."""
    if len(geo.kernel) != 2:
        raise ValueError(f"the 'grouped' conv method is 2-D only, not {len(geo.kernel)}-D")
    if a.dtype != tf.float32:  # TF's CPU kernel: float32 only
        return taps_kernel_grads(a, g, geo)
    x, dy, strides, dilations, padding = cg.fold_batch_into_channels(a, g, geo)
    batch = uses_lib.batch_size(a)
    per_group, cout = a.shape[-1] // geo.groups, g.shape[-1]
    kh, kw = geo.kernel
    filt = tf.raw_ops.Conv2DBackpropFilter(
        input=x,
        filter_sizes=tf.stack([kh, kw, per_group, batch * cout]),
        out_backprop=dy,
        strides=strides,
        dilations=dilations,
        padding=padding,
    )
    filt = tf.reshape(filt, [kh, kw, per_group, batch, cout])
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
        """Grouped 2-D convolutions without XLA: "grouped"; else taps at
        stride 1, else a patch matrix (module docstring)."""
        if spec.groups > 1 and spec.rank == 2 and not xla_lib.resolve_xla(self.xla):
            return "grouped"
        if all(s == 1 for s in spec.strides_hw):
            return "taps"
        return "im2col" if xla_lib.resolve_xla(self.xla) else "gather"

    def gram_dims(self, spec):
        """Per group: `kh*kw*cg` and `og` (the kernel's `[kh, kw, cg, Cout]`)."""
        *taps, per_group, cout = spec.kernel_shape
        return math.prod(taps) * per_group, cout // spec.groups

    def gram_norms(self, nhwc_uses):
        """The Gram form on the im2col patches, uses concatenated along
        positions; per group for a grouped convolution."""
        patches = tf.concat([cg.im2col(a, geo) for a, _, geo in nhwc_uses], 1)
        gs = tf.concat([tf.reshape(g, [-1, geo.positions, g.shape[-1]])
                        for _, g, geo in nhwc_uses], 1)
        a, groups = nhwc_uses[0][0], nhwc_uses[0][2].groups
        if groups == 1:
            return norms.gram_squared_norms(patches, gs)
        return norms.grouped_gram_squared_norms(
            cg.group_features(patches, a.shape[-1], groups),
            tf.reshape(gs, [-1, gs.shape[1], groups, gs.shape[-1] // groups]))


# -- factor statistics (the Kronecker factors' rows) -------------------------------


def input_rows(a, spec):
    """The A factor's rows: the input patch at every output location,
    `[N, kh*kw*Cin]` in the flattened kernel's `(p, q, c)` order (3-D:
    `[N, kd*kh*kw*Cin]`, `(r, p, q, c)`); grouped,
    each group's patch, `[N, G, kh*kw*cg]` (3-D: `[N, G, kd*kh*kw*cg]`; cg
    is the kernel's last-but-one axis in either rank)."""
    patches = cg.extract_patches(a, spec)
    rows = tf.reshape(patches, [-1, patches.shape[-1]])
    if spec.groups == 1:
        return rows
    return cg.group_features(rows, spec.kernel_shape[-2] * spec.groups, spec.groups)


def output_rows(g, spec):
    """The G factor's rows: the output gradient at every location, `[N, Cout]`;
    grouped, each group's outputs, `[N, G, og]`."""
    g = cg.to_nhwc(g, spec.data_format)
    cout, groups = g.shape[-1], spec.groups
    return tf.reshape(g, [-1, cout] if groups == 1 else [-1, groups, cout // groups])


# -- the record --------------------------------------------------------------------


KIND = LayerKind(
    name="conv2d",
    rule=ConvRule(),
    spec=conv_family.spec_reader(ConvSpec),
    operands=conv_family.operands,
    blocks={"kron": "ConvKroneckerBlock", "kron_expand": "ConvKroneckerBlock",
            "kron_reduce": "ConvKroneckerReduceBlock", "diagonal": "ConvDiagonalBlock",
            "full": "NaiveFullBlock"},
    default_block="kron",
    colour="palegreen",
)
