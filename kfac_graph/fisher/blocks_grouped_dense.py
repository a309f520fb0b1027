"""Blocks of a grouped dense layer (`kfac_graph.layers.grouped_dense`): a
kernel `W [G, d_in, d_out]` applied group by group (a mixture of experts'
output projections, one expert per group).

`GroupedDenseKroneckerBlock`: per group j, K-FAC on `W[j]`,

    F ~= diag_j R (A_j (x) G_j),   A_j = E[x_j x_j^T],  G_j = E[g_j g_j^T],

averaged over every token of every example (and use), `R` the tokens per
example times the uses. It is `GroupedKroneckerBlock`'s block diagonal
(each group its own pi; the cross-group terms dropped, as between layers)
with the groups leading the kernel: `V_j = [W[j]; b[j]]` `(d_in (+1),
d_out)`, the bias's row from the homogeneous 1 appended to each group's
input rows.

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
        kernel = tuple(int(d) for d in self.var_shapes[0])
        if len(kernel) != 3 or len(self.var_shapes) > 2:
            raise ValueError(f"a grouped dense block takes a kernel [G, d_in, d_out] and "
                             f"maybe a bias [G, d_out], got {self.var_shapes}")
        groups, d_in, d_out = kernel
        self.spec = grouped_dense.GroupedDenseSpec(kernel, has_bias=len(self.var_shapes) == 2)
        self._out_width = groups * d_out
        options = lambda name: self._factor_options(name=name)  # noqa: E731
        self.input_factor = factors_kron.PatchInputFactor(
            self.spec, grouped_dense.input_rows, d_in, groups, **options("input_factor"))
        self.output_factor = factors_kron.OutputFactor(
            d_out, grouped_dense.group_rows, groups=groups, **options("output_factor"))
        self._init_kron()

    def _to_mat(self, vs):
        """`V_j = [W[j]; b[j]]`: `[G, d_in (+1), d_out]`."""
        mat = tf.reshape(tf.cast(vs[0], self.dtype), self.spec.kernel_shape)
        if self.spec.has_bias:
            mat = tf.concat([mat, tf.cast(vs[1], self.dtype)[:, None, :]], axis=1)
        return mat

    def _from_mat(self, mat):
        d_in = self.spec.kernel_shape[1]
        out = [tf.reshape(mat[:, :d_in], self.spec.kernel_shape)]
        return out + ([mat[:, d_in]] if self.spec.has_bias else [])

    def _canonical_index(self):
        """index[j, r*d_out + o]: the canonical position of V_j's entry (r, o):
        the kernel row-major, then the bias (row r = d_in)."""
        groups, d_in, d_out = self.spec.kernel_shape
        j, r, o = np.meshgrid(np.arange(groups), np.arange(self.input_factor.dim),
                              np.arange(d_out), indexing="ij")
        bias = groups * d_in * d_out + j * d_out + o
        index = np.where(r < d_in, (j * d_in + r) * d_out + o, bias)
        return index.reshape(groups, -1)


class GroupedDenseDiagonalBlock(_LayerMixin, blocks_base.DiagonalBlock):
    """diag F of a grouped dense kernel: mean_i dW_i^2, each example's
    gradient from the kind's rule."""

    def __init__(self, var_shapes, attrs=None, **kwargs):
        super().__init__(var_shapes, attrs, **kwargs)
        spec = grouped_dense.GroupedDenseSpec(self.var_shapes[0],
                                              has_bias=len(self.var_shapes) == 2)
        self.factor = factors_grad.LayerGradientFactor(
            grouped_dense.KIND.rule, spec, self.num_params, diagonal=True, dtype=self.dtype)
        self._init_cache()
