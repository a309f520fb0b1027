"""Fisher blocks of a transposed convolution (`kfac_graph.layers.conv_transpose`).

`ConvTransposeKroneckerBlock`, kernel `W [kh, kw, Cout_t, Cin_t]` (+ bias
`[Cout_t]`): the block diagonal (`blocks_compose.PartsBlock`)

    F ~= diag( R (A (x) G) on V = M^T,   F_b ),

- the kernel, KFC with the roles of the conv's factors swapped: at each of
  the layer input's T positions the kernel's gradient is `patch(dy)_t x_t^T`
  (the kernel viewed as `M [kh*kw*Cout_t, Cin_t]`), so `A = E[x x^T]`
  (`Cin_t`, over the input's positions) and `G = E[patch(dy) patch(dy)^T]`
  (`kh*kw*Cout_t`), both averaged over examples, the T positions and the U
  uses, R = T U, damped as every Kronecker block (`blocks_kron`). The block
  acts on `V = M^T [Cin_t, kh*kw*Cout_t]`, presented in the kernel's own
  layout by `TransposedKernelBlock`, so in the canonical (row-major kernel)
  order `full_matrix = R kron(G, A)`. Exact for one example at one input
  position (T = 1, U = 1), for any number of sources.
- the bias, exactly: `F_b = sum_s (1/B) sum_i db_{s,i} db_{s,i}^T` with
  `db_{s,i}` the bias's per-example gradient (the output gradient summed over
  the output's positions and uses; `conv_transpose.bias_grads`), damped
  `F_b + l I`. It cannot join A as a homogeneous 1 as a conv's bias does:
  the bias's gradient sums `dy` over the output's positions, each covered by
  anywhere from 0 to kh*kw taps, not over the input's positions.

The approximation: KFC on the kernel, and the kernel-bias cross terms
dropped; the bias's own block is exact.

`ConvTransposeKroneckerReduceBlock` (`"kron_reduce"`): the same with
K-FAC-reduce on the kernel (`positions.py`): `A = (1/B) sum_b xbar_b xbar_b^T`
with `xbar_b` example b's input averaged over its T positions and U uses,
`G = (1/B) sum_b psum_b psum_b^T` with `psum_b` its output-gradient patches
summed there, `F ~= A (x) G` (R = 1). Exact for the kernel where the input
does not vary over an example's positions.

`ConvTransposeDiagonalBlock`: the exact diagonal of F (kernel and bias) from
the kind's per-example rule, as `ConvDiagonalBlock`.
"""

import tensorflow as tf

from kfac_graph.fisher import blocks_base
from kfac_graph.fisher import blocks_full
from kfac_graph.fisher import blocks_kron
from kfac_graph.fisher import factors_grad
from kfac_graph.fisher import factors_kron
from kfac_graph.fisher import positions as positions_lib
from kfac_graph.fisher.blocks_compose import PartsBlock, TransposedKernelBlock
from kfac_graph.layers import conv_transpose
from kfac_graph.layers.uses import as_pairs


def _spec(var_shapes, attrs):
    # the op's kernel shape: Conv1DTranspose's variable lacks its unit axis
    kernel = tuple((attrs or {}).get("kernel_shape") or var_shapes[0])
    return conv_transpose.ConvTransposeSpec.from_attrs(kernel, attrs,
                                                       has_bias=len(var_shapes) > 1)


class ConvTransposeKernelBlock(blocks_kron.KroneckerBlock):
    """The kernel alone on `V [Cin_t, kh*kw*Cout_t]` (`spec.matrix_shape`):
    R (A (x) G), R = T U with T the layer input's positions."""

    def __init__(self, spec, attrs=None, **kwargs):
        super().__init__([spec.matrix_shape], attrs, **kwargs)
        self.spec = spec
        self._out_width = spec.matrix_shape[1]
        self.input_factor, self.output_factor = factors_kron.conv_transpose_factors(
            spec, **self._factor_options(positions=self.positions))
        self._init_kron()

    def _locations(self, use):
        """T: the layer input's positions (not the output's)."""
        a = use[0]
        return tf.size(a) // (tf.shape(a)[0] * self.spec.matrix_shape[0])


class ConvTransposeBiasBlock(blocks_base.FullBlock):
    """The bias alone: its exact Fisher from per-example bias gradients."""

    def __init__(self, spec, attrs=None, **kwargs):
        super().__init__([(spec.kernel_shape[-2],)], attrs, **kwargs)
        self.spec = spec
        self.factor = factors_grad.ExampleGradientFactor(self.num_params, dtype=self.dtype)
        self._init_cache()

    def update(self, data, decay=None):
        sources = factors_kron.sources_by_use([g for _, g in as_pairs(data)])
        grads = [conv_transpose.bias_grads([tf.cast(g, self.dtype) for g in dys],
                                           self.spec.data_format) for dys in sources]
        self.factor.update_grads(grads, self._decay(decay))


class ConvTransposeKernelReduceBlock(ConvTransposeKernelBlock):
    """The kernel alone, K-FAC-reduce (`positions.py`): A from each example's
    mean input over its positions (and uses), G from its summed output-gradient
    patches, F ~= A (x) G (R = 1)."""

    positions = positions_lib.REDUCE


class ConvTransposeKroneckerBlock(PartsBlock):
    """Kernel `[kh, kw, Cout_t, Cin_t]` (+ bias `[Cout_t]`): KFC on the kernel,
    the bias's exact block beside it (module docstring)."""

    kernel_block = ConvTransposeKernelBlock

    def __init__(self, var_shapes, attrs=None, **kwargs):
        shapes = [blocks_base.shape_of(v) for v in var_shapes]
        spec = _spec(shapes, attrs)
        options = {k: v for k, v in kwargs.items() if k != "name"}
        kernel = TransposedKernelBlock(
            self.kernel_block(spec, attrs, name="kernel_kron", **options),
            shapes[:1], attrs, name="kernel", **options)
        parts = [kernel]
        if spec.has_bias:
            parts.append(ConvTransposeBiasBlock(spec, attrs, name="bias", **options))
        super().__init__(parts, shapes, attrs, **kwargs)


class ConvTransposeKroneckerReduceBlock(ConvTransposeKroneckerBlock):
    """K-FAC-reduce on the kernel (`ConvTransposeKernelReduceBlock`), the
    bias's exact block beside it: the expand block's approximation otherwise."""

    kernel_block = ConvTransposeKernelReduceBlock


class ConvTransposeDiagonalBlock(blocks_full.ConvDiagonalBlock):
    """diag F for a transposed convolution (kernel and bias), exact."""

    _spec_type, _rule = conv_transpose.ConvTransposeSpec, conv_transpose.KIND.rule
