"""Blocks without a Kronecker approximation: full or diagonal matrices.

All estimate F = (1/B) sum_i grad_i grad_i^T (summed over sources) from
each example's own gradient, so their full (diagonal) matrix equals the
true Fisher block (its diagonal), not an approximation, wherever the
sources do (in exact mode on a per-token output, with one column per
position and class, ``position_columns="separate"``; the default "shared"
columns add cross-position terms, ``fisher/estimator.py``).  Damping:
`F + l I` (no location normalisation: for the conv
diagonal block this equals the seed's `T * (l / T)`).

  NaiveFullBlock, NaiveDiagonalBlock    any layer; data = per-example grads.
  FullyConnectedDiagonalBlock           dense kernel [d_in, d_out] (+ bias).
  ConvDiagonalBlock                     Conv2D kernel [kh, kw, Cin, Cout].
  DepthwiseConvDiagonalBlock            depthwise kernel [kh, kw, C, M].
  ScaleAndShiftFullBlock / ...DiagonalBlock   scale (+ shift) over xhat.
The layer blocks take uses `[(a, g), ...]` and get each example's gradient
from the layer kind's own per-example rule (`kfac_graph.layers`); multiple
uses are exact here (the gradient sums over uses before squaring).
"""

from kfac_graph.fisher import blocks_base
from kfac_graph.fisher import factors_grad
from kfac_graph.layers import conv, dense, depthwise, scale_shift
from kfac_graph.layers.uses import as_pairs


class _LayerMixin:
    """`update` for blocks whose factor rebuilds gradients from (a, g)."""

    def update(self, data, decay=None):
        self.factor.update(as_pairs(data), self._decay(decay))


class _NaiveMixin:
    stats = "per_example_gradients"

    def update(self, data, decay=None):
        self.factor.update(data, self._decay(decay))


class NaiveFullBlock(_NaiveMixin, blocks_base.FullBlock):
    """Full Fisher of arbitrary variables from per-example gradients."""

    def __init__(self, var_shapes, attrs=None, **kwargs):
        super().__init__(var_shapes, attrs, **kwargs)
        self.factor = factors_grad.NaiveFactor(self.num_params, dtype=self.dtype)
        self._init_cache()


class NaiveDiagonalBlock(_NaiveMixin, blocks_base.DiagonalBlock):
    """Diagonal Fisher of arbitrary variables from per-example gradients."""

    def __init__(self, var_shapes, attrs=None, **kwargs):
        super().__init__(var_shapes, attrs, **kwargs)
        self.factor = factors_grad.NaiveFactor(self.num_params, diagonal=True, dtype=self.dtype)
        self._init_cache()


class FullyConnectedDiagonalBlock(_LayerMixin, blocks_base.DiagonalBlock):
    """diag F for a dense layer: mean_i (sum_t abar_{i,t} g_{i,t}^T)^2."""

    def __init__(self, var_shapes, attrs=None, **kwargs):
        super().__init__(var_shapes, attrs, **kwargs)
        spec = dense.DenseSpec(has_bias=len(self.var_shapes) > 1)
        self.factor = factors_grad.DenseGradientFactor(dense.KIND.rule, spec, self.num_params,
                                                       diagonal=True, dtype=self.dtype)
        self._init_cache()


class ConvDiagonalBlock(_LayerMixin, blocks_base.DiagonalBlock):
    """diag F for Conv2D: mean_i (sum_t P_{i,t} g_{i,t}^T)^2 (+ bias)."""

    _spec_type, _rule = conv.ConvSpec, conv.KIND.rule

    def __init__(self, var_shapes, attrs=None, **kwargs):
        super().__init__(var_shapes, attrs, **kwargs)
        self.spec = self._spec_type.from_attrs(self._op_kernel_shape(), self.attrs,
                                               has_bias=len(self.var_shapes) > 1,
                                               layer=self.name)
        self.factor = factors_grad.LayerGradientFactor(self._rule, self.spec, self.num_params,
                                                       diagonal=True, dtype=self.dtype)
        self._init_cache()


class DepthwiseConvDiagonalBlock(ConvDiagonalBlock):
    """diag F for DepthwiseConv2dNative (kernel [kh, kw, C, M], bias [C*M])."""

    _spec_type, _rule = depthwise.DepthwiseSpec, depthwise.KIND.rule


class ScaleAndShiftFullBlock(_LayerMixin, blocks_base.FullBlock):
    """Full F for `y = scale * xhat + shift`; data uses are `(xhat, g)`."""

    _diagonal = False

    def __init__(self, var_shapes, attrs=None, **kwargs):
        super().__init__(var_shapes, attrs, **kwargs)
        spec = scale_shift.ScaleShiftSpec(self.var_shapes[0], has_shift=len(self.var_shapes) > 1)
        self.factor = factors_grad.LayerGradientFactor(
            scale_shift.KIND.rule, spec, self.num_params, diagonal=self._diagonal,
            dtype=self.dtype)
        self._init_cache()


class ScaleAndShiftDiagonalBlock(_LayerMixin, blocks_base.DiagonalBlock):
    """Diagonal F for `y = scale * xhat + shift`."""

    def __init__(self, var_shapes, attrs=None, **kwargs):
        super().__init__(var_shapes, attrs, **kwargs)
        spec = scale_shift.ScaleShiftSpec(self.var_shapes[0], has_shift=len(self.var_shapes) > 1)
        self.factor = factors_grad.LayerGradientFactor(
            scale_shift.KIND.rule, spec, self.num_params, diagonal=True, dtype=self.dtype)
        self._init_cache()
