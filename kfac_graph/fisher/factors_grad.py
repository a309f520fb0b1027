"""Full and diagonal factors built from per-example gradients.

    F = sum_s (1 / B) sum_i grad_{s,i} grad_{s,i}^T     (or its diagonal)

where grad_{s,i} is example i's gradient (flattened in the canonical order)
for source s (sampled target or Fisher-square-root column).  This is the
low-variance "sum of squares" estimator: its expectation is the Fisher
block itself, with no Kronecker approximation.

`NaiveFactor.update(grads, decay)` takes the gradients directly:
`grads` is a list over variables of `[B, *var.shape]`, or a list over
sources of such lists.  The layer-aware factors instead take the uses
`[(a, g), ...]` and rebuild each example's gradient from the layer input
and output gradient (see `layer_gradients.py`), summing over uses.
"""

import numpy as np
import tensorflow as tf

from kfac_graph.fisher import factors_base
from kfac_graph.fisher import factors_kron
from kfac_graph.fisher import layer_gradients as lg
from kfac_graph.fisher import linalg
from kfac_graph.fisher import patches as patches_lib


class ExampleGradientFactor(factors_base.CovarianceFactor):
    """Moving average of F from `[B, n]` per-example gradients per source."""

    def __init__(self, num_params, diagonal=False, **kwargs):
        super().__init__(num_params, diagonal=diagonal, **kwargs)

    def update_grads(self, sources, decay):
        """sources: list over sources of `[B, n]` per-example gradients."""
        self.update_rows([[s] for s in sources], decay)

    # Layer-aware subclasses define these two.
    def _prepare(self, a):
        return tf.cast(a, self.dtype)

    def _example_grads(self, prepared, g):
        raise NotImplementedError(
            f"{type(self).__name__}._example_grads: a layer-aware subclass defines it")

    def update(self, uses, decay):
        """uses: `[(a, g), ...]`, g a tensor or a list over sources."""
        prepared = [self._prepare(a) for a, _ in uses]
        sources = factors_kron.sources_by_use([g for _, g in uses])
        grads = []
        for per_use in sources:
            grads.append(
                tf.add_n(
                    [
                        self._example_grads(p, tf.cast(g, self.dtype))
                        for p, g in zip(prepared, per_use)
                    ]
                )
            )
        self.update_grads(grads, decay)


class NaiveFactor(ExampleGradientFactor):
    """F from per-example gradients of arbitrary variables."""

    def update(self, grads, decay):
        grads = list(grads)
        sources = grads if isinstance(grads[0], (list, tuple)) else [grads]
        flat = [lg.variable_example_grads([tf.cast(t, self.dtype) for t in s]) for s in sources]
        self.update_grads(flat, decay)


class DenseGradientFactor(ExampleGradientFactor):
    """Dense layer: grad_i = sum_t abar_{i,t} g_{i,t}^T (kernel, then bias)."""

    def __init__(self, kernel_shape, has_bias, diagonal=False, **kwargs):
        d_in, d_out = kernel_shape
        super().__init__((d_in + int(has_bias)) * d_out, diagonal, **kwargs)
        self.has_bias = bool(has_bias)

    def _example_grads(self, a, g):
        return lg.dense_example_grads(a, g, self.has_bias)

    def update(self, uses, decay):
        single = len(uses) == 1 and len(uses[0][0].shape) == 2
        if not (self.diagonal and single):
            return super().update(uses, decay)
        # One outer product per example: diag = mean_i (abar_i^2)(g_i^2)^T.
        a = tf.cast(uses[0][0], self.dtype)
        if self.has_bias:
            a = linalg.append_ones(a)
        a2 = tf.square(a)
        sources = factors_kron.sources_by_use([uses[0][1]])
        b = tf.cast(tf.shape(a)[0], self.dtype)
        est = [
            tf.reshape(tf.matmul(a2, tf.square(tf.cast(s[0], self.dtype)), transpose_a=True), [-1])
            / b
            for s in sources
        ]
        est = tf.add_n(est)
        self.cov.update(est, decay)


class ConvGradientFactor(ExampleGradientFactor):
    """Conv2D: grad_i = sum_t P_{i,t} g_{i,t}^T over output locations t."""

    def __init__(self, kernel_shape, geometry, has_bias, diagonal=False, **kwargs):
        n = int(np.prod(kernel_shape)) + int(has_bias) * self._bias_size(kernel_shape)
        super().__init__(n, diagonal, **kwargs)
        self.kernel_hw, self.geometry = tuple(kernel_shape[:2]), geometry
        self.has_bias = bool(has_bias)

    @staticmethod
    def _bias_size(kernel_shape):
        return kernel_shape[-1]

    def _prepare(self, a):
        return patches_lib.extract_patches(tf.cast(a, self.dtype), self.kernel_hw, self.geometry)

    def _example_grads(self, patches, g):
        g_loc = patches_lib.output_locations(g, self.geometry.data_format)
        return lg.conv_example_grads(patches, g_loc, self.has_bias)


class DepthwiseGradientFactor(ConvGradientFactor):
    """DepthwiseConv2dNative: grad_i[k,c,m] = sum_t P_{i,t}[k,c] g_{i,t}[c,m]."""

    def __init__(self, kernel_shape, geometry, has_bias, diagonal=False, **kwargs):
        super().__init__(kernel_shape, geometry, has_bias, diagonal, **kwargs)
        self.channels, self.multiplier = kernel_shape[2], kernel_shape[3]

    @staticmethod
    def _bias_size(kernel_shape):
        return kernel_shape[2] * kernel_shape[3]

    def _example_grads(self, patches, g):
        g_loc = patches_lib.output_locations(g, self.geometry.data_format)
        return lg.depthwise_example_grads(
            patches, g_loc, self.channels, self.multiplier, self.has_bias
        )


class ScaleAndShiftGradientFactor(ExampleGradientFactor):
    """Scale (and shift) over a broadcast input: grads summed over broadcast axes."""

    def __init__(self, scale_shape, has_shift, diagonal=False, **kwargs):
        n = int(np.prod(scale_shape)) * (1 + int(has_shift))
        super().__init__(n, diagonal, **kwargs)
        self.scale_shape, self.has_shift = tuple(scale_shape), bool(has_shift)

    def _example_grads(self, xhat, g):
        return lg.scale_shift_example_grads(xhat, g, self.scale_shape, self.has_shift)
