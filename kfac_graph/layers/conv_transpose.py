"""Per-example gradients of a transposed convolution (`Conv2DTranspose`, and
`Conv1DTranspose` lowered to it; `Conv3DTranspose`, kind "conv3d_transpose",
`Conv3DBackpropInputV2` with kernel `[kd, kh, kw, Cout_t, Cin_t]`, the same
math over three spatial axes, see `conv3d.py`), and its Kronecker factors' rows.

TensorFlow writes `y = conv_transpose(x, W)` as
`Conv2DBackpropInput(input_sizes=shape(y), filter=W, out_backprop=x)`: the
input-gradient of the forward convolution `conv(., W)` whose input has y's
shape and whose output has x's. The op's attributes (strides, padding,
dilations, explicit paddings, data format) are that forward convolution's,
and `W [kh, kw, Cout_t, Cin_t]` is its kernel `[kh, kw, in, out]` (Cout_t:
y's channels, Cin_t: x's). Keras's `output_padding` changes only
`input_sizes`, y's shape, from which the forward geometry is computed
(`conv_geometry.geometry` on y's spatial size), so it needs nothing more.

Math: `y = J_W^T x` with `J_W = conv(., W)` linear in both arguments, so
`<y, dy> = <conv(dy, W), x>` and

    dW_i[p, q, c, o] = sum_{uses} sum_t tap_{p,q}(dy_i)[t, c] x_i[t, o]
    db_i[c]          = sum_{uses} sum_s dy_i[s, c]

with t over x's positions (the forward convolution's outputs) and s over y's:
the conv rule (`conv.py`, every kernel and norm form of it) with the roles
swapped, `a := dy_i`, `g := x_i`, on the forward geometry; only the bias
differs, a sum of the output gradient over y's positions.

Kronecker rows: at each of x's T positions the kernel's gradient, the kernel
viewed as `M = W` reshaped `[kh*kw*Cout_t, Cin_t]`, is the outer product
`patch(dy)_t x_t^T` of an output-gradient patch (`kh*kw*Cout_t`) and the layer
input (`Cin_t`, an activation). So the activation factor is `A = E[x x^T]`
over x's positions and the gradient factor `G = E[patch(dy) patch(dy)^T]`:
the conv's rows with the roles swapped (`input_rows` is `conv.output_rows`,
`output_rows` is `conv.input_rows`). The Kronecker block acts on
`V = M^T` (`ConvTransposeSpec.matrix_shape`). The bias is no row of A (each
of y's positions is covered by anywhere from 0 to kh*kw taps), so the
blocks treat it apart (`kfac_graph/fisher/blocks_conv_transpose.py`).
"""

import dataclasses
import math

import tensorflow as tf

from kfac_graph.layers import conv, conv_family
from kfac_graph.layers import conv_geometry as cg
from kfac_graph.layers import uses as uses_lib
from kfac_graph.layers.kind import LayerKind


@dataclasses.dataclass(frozen=True)
class ConvTransposeSpec(cg.ConvAttrs):
    """`Conv2DBackpropInput`: the forward convolution's attributes;
    kernel_shape = (kh, kw, Cout_t, Cin_t); bias `[Cout_t]`."""

    @property
    def matrix_shape(self):
        """`(Cin_t, kh*kw*Cout_t)` (3-D: `kd*kh*kw*Cout_t`): the kernel as the
        Kronecker block's `V`, the transpose of the row-major `[kh*kw*Cout_t, Cin_t]`."""
        *taps, cout, cin = self.kernel_shape
        return cin, math.prod(taps) * cout


def bias_grads(dys, data_format="NHWC"):
    """`[B, Cout_t]`: each example's bias gradient, its output gradients
    (`dys`, one per use) summed over y's positions and over the uses."""
    return uses_lib.add_all([tf.reduce_sum(cg.to_nhwc(dy, data_format),
                                           axis=list(range(1, dy.shape.rank - 1)))
                             for dy in dys])


@dataclasses.dataclass(frozen=True)
class ConvTransposeRule(conv.ConvRule):
    """Rule for kind `"conv2d_transpose"` (spec: `ConvTransposeSpec`): the conv
    rule on `(dy, x)` (module docstring); `method` as `conv.ConvRule`'s."""

    NAME = "conv_transpose"

    @staticmethod
    def nhwc_uses(uses, spec):
        """`[(dy, x, geometry)]` per use: the forward convolution's input (the
        layer's output gradient) and output (the layer's input), in NHWC."""
        return [cg.nhwc_use(g, a, spec) for a, g in uses_lib.as_uses(uses)]

    @staticmethod
    def bias_grads(nhwc_uses):
        """The bias's per-example gradients: `dy` summed over y's positions."""
        return bias_grads([dy for dy, _, _ in nhwc_uses])

    def run_time_grads(self, uses, spec):
        """At a spatial size known at run time only: the forward convolution's
        patches of `dy` contracted with `x` (`conv_family.run_time_grads` on
        `(dy, x)`), and the bias's `dy` summed over y's positions."""
        uses = uses_lib.as_uses(uses)
        kernel = conv_family.run_time_grads([(g, a) for a, g in uses],
                                            dataclasses.replace(spec, has_bias=False), 1)
        return kernel + ([bias_grads([g for _, g in uses], spec.data_format)]
                         if spec.has_bias else [])


# -- factor statistics (the Kronecker factors' rows) -------------------------------


def input_rows(x, spec):
    """The A factor's rows: the layer input at each of its positions,
    `[N, Cin_t]` (the forward convolution's output rows)."""
    return conv.output_rows(x, spec)


def output_rows(dy, spec):
    """The G factor's rows: the output gradient's patch at each of x's
    positions, `[N, kh*kw*Cout_t]` in the kernel's `(p, q, c)` order (the
    forward convolution's input patches)."""
    return conv.input_rows(dy, spec)


# -- the record --------------------------------------------------------------------


KIND = LayerKind(
    name="conv2d_transpose",
    rule=ConvTransposeRule(),
    spec=conv_family.spec_reader(ConvTransposeSpec),
    operands=conv_family.operands,
    blocks={"kron": "ConvTransposeKroneckerBlock",
            "kron_reduce": "ConvTransposeKroneckerReduceBlock",
            "diagonal": "ConvTransposeDiagonalBlock", "full": "NaiveFullBlock"},
    default_block="kron",
    colour="lightseagreen",
)
