"""Blocks of a grouped dense layer (`kfac_graph.layers.grouped_dense`): a
kernel `W [G, d_in, d_out]` applied group by group (a mixture of experts'
output projections, one expert per group).

`GroupedDenseKroneckerBlock`: per group j, K-FAC on `W[j]`,

    F ~= diag_j R (A_j (x) G_j),   A_j = E[x_j x_j^T],  G_j = E[g_j g_j^T],

averaged over every token of every example (and use), `R` the tokens per
example times the uses. It is `GroupedKroneckerBlock`'s block diagonal
(each group its own pi; the cross-group terms dropped, as between layers)
with the groups leading the kernel: `V_j = W[j]` `(d_in, d_out)`, so the
kernel's row-major order is already the groups' one after the other.

`GroupedDenseDiagonalBlock`: the exact diagonal, from the kind's
per-example rule.
"""

import numpy as np
import tensorflow as tf

from kfac_graph.fisher import blocks_base, factors_grad, factors_kron
from kfac_graph.fisher.blocks_full import _LayerMixin
from kfac_graph.fisher.blocks_kron import GroupedKroneckerBlock
from kfac_graph.layers import grouped_dense


class GroupedDenseKroneckerBlock(GroupedKroneckerBlock):
    """Kernel `[G, d_in, d_out]`, no bias; uses `(x [B, G, k, d_in],
    g [B, G, k, d_out])` (module docstring)."""

    def __init__(self, var_shapes, attrs=None, **kwargs):
        super().__init__(var_shapes, attrs, **kwargs)
        if len(self.var_shapes) != 1 or len(self.var_shapes[0]) != 3:
            raise ValueError(f"a grouped dense block takes one kernel [G, d_in, d_out], "
                             f"got {self.var_shapes}")
        groups, d_in, d_out = (int(d) for d in self.var_shapes[0])
        self._out_width = groups * d_out
        options = lambda name: self._factor_options(groups=groups, name=name)  # noqa: E731
        # an input factor without the homogeneous coordinate: the rows as given
        self.input_factor = factors_kron.OutputFactor(d_in, grouped_dense.group_rows,
                                                      **options("input_factor"))
        self.output_factor = factors_kron.OutputFactor(d_out, grouped_dense.group_rows,
                                                       **options("output_factor"))
        self._init_kron()

    def _to_mat(self, vs):
        return tf.reshape(tf.cast(vs[0], self.dtype), self.var_shapes[0])

    def _from_mat(self, mat):
        return [tf.reshape(mat, self.var_shapes[0])]

    def _canonical_index(self):
        """index[j, r*d_out + o] = the row-major position of W[j, r, o]."""
        groups, d_in, d_out = (int(d) for d in self.var_shapes[0])
        return np.arange(groups * d_in * d_out).reshape(groups, d_in * d_out)


class GroupedDenseDiagonalBlock(_LayerMixin, blocks_base.DiagonalBlock):
    """diag F of a grouped dense kernel: mean_i dW_i^2, each example's
    gradient from the kind's rule."""

    def __init__(self, var_shapes, attrs=None, **kwargs):
        super().__init__(var_shapes, attrs, **kwargs)
        spec = grouped_dense.GroupedDenseSpec(self.var_shapes[0])
        self.factor = factors_grad.LayerGradientFactor(
            grouped_dense.KIND.rule, spec, self.num_params, diagonal=True, dtype=self.dtype)
        self._init_cache()
