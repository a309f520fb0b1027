"""Full and diagonal factors built from per-example gradients.

    F = sum_s (1 / B) sum_i grad_{s,i} grad_{s,i}^T     (or its diagonal)

where grad_{s,i} is example i's gradient (flattened in the canonical order)
for source s (sampled target or Fisher-square-root column).  This is the
low-variance "sum of squares" estimator: its expectation is the Fisher
block itself, with no Kronecker approximation.

`NaiveFactor.update(grads, decay)` takes the gradients directly: `grads`
is a list over variables of `[B, *var.shape]`, or a list over sources of
such lists. `LayerGradientFactor` instead takes the uses `[(a, g), ...]` and
gets each example's gradient from the layer kind's own per-example rule
(`kfac_graph.layers`), which sums over uses.
"""

import tensorflow as tf

from kfac_graph.fisher import factors_base
from kfac_graph.fisher import factors_kron
from kfac_graph.fisher import linalg


def flat_example_grads(grads):
    """A list of per-example gradients `[B, *var.shape]` -> `[B, n]`."""
    b = tf.shape(grads[0])[0]
    return tf.concat([tf.reshape(g, [b, -1]) for g in grads], axis=1)


class ExampleGradientFactor(factors_base.CovarianceFactor):
    """Moving average of F from `[B, n]` per-example gradients per source."""

    def __init__(self, num_params, diagonal=False, **kwargs):
        super().__init__(num_params, diagonal=diagonal, **kwargs)

    def update_grads(self, sources, decay):
        """sources: list over sources of `[B, n]` per-example gradients."""
        self.update_rows([[s] for s in sources], decay)


class NaiveFactor(ExampleGradientFactor):
    """F from per-example gradients of arbitrary variables."""

    def batch_estimates(self, grads):
        grads = list(grads)
        sources = grads if isinstance(grads[0], (list, tuple)) else [grads]
        flat = [flat_example_grads([tf.cast(t, self.dtype) for t in s]) for s in sources]
        return self.row_estimates([[s] for s in flat])

    def estimate_key(self):
        return self._structure()


class LayerGradientFactor(ExampleGradientFactor):
    """F of one layer from its uses `[(a, g), ...]` (g a tensor or a list over
    sources): each source's per-example gradients by `rule.per_example_grads
    (uses, spec)`, the rule of the layer's kind."""

    def __init__(self, rule, spec, num_params, diagonal=False, **kwargs):
        super().__init__(num_params, diagonal, **kwargs)
        self.rule, self.spec = rule, spec

    def batch_estimates(self, uses):
        inputs = [tf.cast(a, self.dtype) for a, _ in uses]
        sources = factors_kron.sources_by_use([g for _, g in uses])
        grads = [flat_example_grads(self.rule.per_example_grads(
                     [(a, tf.cast(g, self.dtype)) for a, g in zip(inputs, per_use)], self.spec))
                 for per_use in sources]
        return self.row_estimates([[g] for g in grads])

    def estimate_key(self):
        return self._structure(self.rule, self.spec)


class DenseGradientFactor(LayerGradientFactor):
    """A dense layer's F; its diagonal for one use of `[B, d_in]` inputs by one
    product per source, `diag = mean_i (abar_i^2)(g_i^2)^T` (no per-example
    gradients formed)."""

    def batch_estimates(self, uses):
        single = len(uses) == 1 and len(uses[0][0].shape) == 2
        if not (self.diagonal and single and not self.spec.transpose_kernel):
            return super().batch_estimates(uses)
        a = tf.cast(uses[0][0], self.dtype)
        if self.spec.has_bias:
            a = linalg.append_ones(a)
        a2 = tf.square(a)
        b = tf.cast(tf.shape(a)[0], self.dtype)
        est = [tf.reshape(tf.matmul(a2, tf.square(tf.cast(s[0], self.dtype)), transpose_a=True),
                          [-1]) / b
               for s in factors_kron.sources_by_use([uses[0][1]])]
        return [tf.add_n(est)]
