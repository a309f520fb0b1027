"""Per-example gradients of a 2-D convolution (`Conv2D`, and Conv1D lowered
to it).

Math: with `tap_{p,q}(a_i)[y, x, c]` the input value that kernel tap `(p, q)`
multiplies at output position `(y, x)` (see `conv_geometry.py`),

    dW_i[p, q, c, o] = sum_{uses} sum_{y,x} tap_{p,q}(a_i)[y, x, c] g_i[y, x, o]
    db_i[o]          = sum_{uses} sum_{y,x} g_i[y, x, o]

i.e. a dense layer over the `T = Ho*Wo` im2col patches. Three kernels compute
`dW_i` (no Python loop over examples in any of them):

* `"taps"`: for each of the kh*kw taps one batched matmul
  `[B, Cin, T] x [B, T, Cout]`; never builds the patch matrix.
* `"im2col"`: stacks the taps into `[B, T, kh*kw*Cin]` and does one batched
  matmul.
* `"grouped"`: folds the batch into channel groups, `[1, H, W, B*Cin]`, and
  runs the filter-gradient op `Conv2DBackpropFilter` for a B-group
  convolution, whose filter `[kh, kw, Cin, B*Cout]` is the per-example
  gradient. TF's CPU kernel supports this only for float32 (oneDNN).

`"auto"` is "taps", with and without XLA. Measured by
benchmarks/per_example_rules.py (batch 64, 2 CPU cores, float32; time of the
per-example kernel / the same layer's batch filter gradient, no XLA | XLA;
two runs, 25 and 20 calls):

    layer                  taps              im2col            grouped
    conv 3->32 3x3 @32     2.04 1.81 | 1.37 1.81  2.56 2.47 | 1.51 1.85  2.73 2.68 | >100
    conv 32->64 3x3 s2     1.35 1.38 | 0.90 1.41  1.51 1.53 | 1.23 1.11  1.83 1.81 | >100
    conv 1x1 64->64 @16    0.95 0.86 | 0.56 1.16  0.89 0.80 | 0.52 1.15  2.78 2.55 | >100

Without XLA "taps" wins on the 3x3 layers; under XLA "taps" and "im2col"
trade places from run to run, so one code path is kept.
("taps" never writes the 9x larger patch matrix; "grouped" pays for transposes
and oneDNN's grouped kernel, and XLA's CPU lowering of a batch-grouped filter
gradient takes seconds; `tf.image.extract_patches` + matmul was 2-10x slower
still and was dropped.) A 1x1 conv is the one-tap case: a dense layer.

Norms: Gram form on the im2col patches (uses concatenated along positions, so
cross terms are counted) iff `T (kh kw Cin + Cout) < kh kw Cin Cout`, else the
materialised `dW_i` is squared (see `norms.py`); bias norm `|sum_t g_t|^2`.

NCHW tensors are transposed to NHWC first (TF's CPU Conv2D rejects NCHW for
float64, and the tap arithmetic is written once).
"""

import dataclasses

import tensorflow as tf

from kfac_graph.per_example import conv_geometry as cg
from kfac_graph.per_example import norms
from kfac_graph.per_example import uses as uses_lib

METHODS = ("taps", "im2col", "grouped")


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


def im2col_kernel_grads(a, g, geo):
    """`[B, kh, kw, Cin, Cout]` by one batched matmul on the patch matrix."""
    cin, cout = a.shape[-1], g.shape[-1]
    patches = cg.im2col(a, geo)
    g2 = tf.reshape(g, [-1, geo.positions, cout])
    out = tf.matmul(patches, g2, transpose_a=True)
    return tf.reshape(out, [-1, geo.kernel[0], geo.kernel[1], cin, cout])


def grouped_kernel_grads(a, g, geo):
    """`[B, kh, kw, Cin, Cout]` via `Conv2DBackpropFilter` of a B-group conv."""
    x, dy, strides, dilations = cg.fold_batch_into_channels(a, g, geo)
    batch = uses_lib.batch_size(a)
    cin, cout = a.shape[-1], g.shape[-1]
    kh, kw = geo.kernel
    filt = tf.raw_ops.Conv2DBackpropFilter(
        input=x,
        filter_sizes=tf.stack([kh, kw, cin, batch * cout]),
        out_backprop=dy,
        strides=strides,
        dilations=dilations,
        padding="VALID",
    )
    filt = tf.reshape(filt, [kh, kw, cin, batch, cout])
    return tf.transpose(filt, [3, 0, 1, 2, 4])


_KERNELS = {
    "taps": taps_kernel_grads,
    "im2col": im2col_kernel_grads,
    "grouped": grouped_kernel_grads,
}


@dataclasses.dataclass(frozen=True)
class ConvRule:
    """Rule for kind `"conv2d"` (spec: `ConvSpec`).

    Attributes:
      method: `"auto"` or one of `METHODS` (see the module docstring).
      norm_method: `"auto"` (the cost rule), `"gram"` or `"materialize"`.
    """

    method: str = "auto"
    norm_method: str = "auto"

    def choose_method(self):
        """The kernel `"auto"` resolves to ("taps", see the module docstring)."""
        if self.method == "auto":
            return "taps"
        if self.method not in METHODS:
            raise ValueError(f"unknown conv method {self.method!r}")
        return self.method

    def _uses(self, uses, spec):
        return [cg.nhwc_use(a, g, spec) for a, g in uses_lib.as_uses(uses)]

    def _kernel_grads(self, nhwc_uses):
        kernel = _KERNELS[self.choose_method()]
        return uses_lib.add_all([kernel(a, g, geo) for a, g, geo in nhwc_uses])

    @staticmethod
    def _bias_grads(nhwc_uses):
        return uses_lib.add_all([tf.reduce_sum(g, axis=[1, 2]) for _, g, _ in nhwc_uses])

    def per_example_grads(self, uses, spec):
        """`[B, kh, kw, Cin, Cout]` and, if `spec.has_bias`, `[B, Cout]`."""
        nhwc_uses = self._uses(uses, spec)
        out = [self._kernel_grads(nhwc_uses)]
        if spec.has_bias:
            out.append(self._bias_grads(nhwc_uses))
        return out

    def use_gram(self, spec, positions):
        """Whether `squared_norms` takes the Gram form for `positions` in all."""
        if self.norm_method in ("gram", "materialize"):
            return self.norm_method == "gram"
        if self.norm_method != "auto":
            raise ValueError(f"unknown norm_method {self.norm_method!r}")
        kh, kw, cin, cout = spec.kernel_shape
        return norms.gram_is_cheaper(positions, kh * kw * cin, cout)

    def squared_norms(self, uses, spec):
        """`[B]`: squared norm of each example's gradient over kernel (+ bias)."""
        nhwc_uses = self._uses(uses, spec)
        positions = sum(geo.positions for _, _, geo in nhwc_uses)
        if self.use_gram(spec, positions):
            patches = [cg.im2col(a, geo) for a, _, geo in nhwc_uses]
            gs = [tf.reshape(g, [-1, geo.positions, g.shape[-1]]) for _, g, geo in nhwc_uses]
            total = norms.gram_squared_norms(tf.concat(patches, 1), tf.concat(gs, 1))
        else:
            total = norms.sum_of_squares(self._kernel_grads(nhwc_uses))
        if spec.has_bias:
            total += norms.sum_of_squares(self._bias_grads(nhwc_uses))
        return total
