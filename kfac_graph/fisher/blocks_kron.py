"""Kronecker-factored blocks: dense (K-FAC), conv (KFC), depthwise, embedding.

With the weights stacked as V = [W; b] (`(d_in + 1, d_out)`; a conv kernel
reshaped to `(kh*kw*Cin, Cout)`), the block is

    F ~= R (A (x) G),   i.e.  V -> R A V G,

with A, G the input/output factors (`factors_kron.py`), averaged over
examples and over the R = T * U replicas of the weights: T positions (dense
middle axes) or output locations (conv), times U uses.  The canonical
parameter order (kernel row-major, then bias) is exactly the row-major
vec of V, so `full_matrix() = R kron(A, G)`.  With U > 1 this is the
"independence across uses" approximation (FullyConnectedMultiIndepFB and
ConvKFCBasicMultiIndepFB of tensorflow/kfac are the same math).

Damping (tensorflow/kfac's convention): l' = l / R,
pi = sqrt((tr A / dim A) / (tr G / dim G)), and the damped block is
R (A + pi sqrt(l') I) (x) (G + sqrt(l')/pi I).  `update_inverses()`
caches the damped factors' inverses X_A, X_G (by Cholesky) and the l' they
were made for, so the inverse is V -> X_A V X_G / R: one matmul per side,
where an eigenbasis costs two (tensorflow/kfac caches such inverses too).
If l' has since changed (relative difference above 1e-6), `multiply_inverse`
inverts the current factors on the fly instead, and `inverses_stale()`
says so (the optimizer then refreshes).  Other powers, `multiply` and the
Cholesky factor sqrt(R) chol(A~) (x) chol(G~) use the current factors.

Grouped blocks (`GroupedKroneckerBlock`): a layer of G independent groups,
its kernel flattened to `[K, G*og]` with group j owning columns
j*og ... (j+1)*og - 1 (and those bias entries), gets the block diagonal

    F ~= diag_j R (A_j (x) G_j),   V_j = [W[:, j*og:(j+1)*og]; b_j]  `(K (+1), og)`,

each group with its own pi, so the inverse is applied per group:
V_j -> (A_j + pi_j r I)^-1 V_j (G_j + r/pi_j I)^-1 / R.  This is KFC per group
*and* the block-diagonal approximation across groups: the true Fisher's
cross-group terms (groups share the loss, so they do not vanish) are
dropped, as tensorflow/kfac drops those between layers.  A grouped
Conv2D (kernel `[kh, kw, cg, Cout]`, K = kh*kw*cg, G = Cin/cg) is one:
A_j from group j's patch features (input channels j*cg ... (j+1)*cg - 1),
G_j from its og output gradients.  So are depthwise kernels `[kh, kw, C, M]`
(K = kh*kw, G = C, og = M: C independent convs, one per input channel).
(The seed instead restricts one big `(kh*kw*C) x (C*M)` Kronecker product
to the depthwise entries, whose "inverse" is then not the inverse of its
own block.)  The Cholesky factor is triangular per group, i.e. up to a
permutation of the canonical order; `L L^T` is the damped block.

Embedding tables `[V, D]`: A is diagonal (id frequencies), so
F ~= R diag(A) (x) G; exact for one example with one lookup.

Positions (`positions.py`): the blocks above "expand" (every position and
use another example, R = T U); their `positions = "reduce"` subclasses
(`blocks_reduce.py`) "reduce" instead.

Wide factors: a factor wider than the block's `max_factor_size` keeps only
its diagonal (`factor.wide`), e.g. the `50k x 50k` output factor of a
language model's head; the block is then R (A (x) diag(G)) (or diag(A) (x) G),
and all its products are those of a Kronecker product with one diagonal
factor. With a `factor_block_size` k, a full, ungrouped factor wider than k
keeps its diagonal blocks of at most k (`factor.blocks`, `factor_blocks.py`):
R (A_bd (x) G), every product taken block by block.
"""

import numpy as np
import tensorflow as tf

from kfac_graph.fisher import blocks_base
from kfac_graph.fisher import ema
from kfac_graph.fisher import factor_blocks
from kfac_graph.fisher import factors_kron
from kfac_graph.fisher import linalg
from kfac_graph.fisher import positions as positions_lib
from kfac_graph.layers import conv, dense, depthwise
from kfac_graph.layers.uses import as_pairs


def _mul_left_t(factor, x, diagonal, transpose):
    if diagonal:
        return factor[..., :, None] * x
    return tf.matmul(factor, x, transpose_a=transpose)


class KroneckerBlock(blocks_base.FisherBlock):
    """Base: subclasses set `input_factor`, `output_factor`, `_out_width` and
    call `_init_kron()`; `_to_mat`/`_from_mat` map variables <-> V.
    `positions`: "expand" (R = T U) or "reduce" (R = 1; the factors reduce)."""

    positions = positions_lib.EXPAND
    takes_factor_blocks = True  # its factors take ``factor_block_size``

    def _factor_options(self, **kwargs):
        """Options every factor of the block takes: dtype, the size budget
        and the block size."""
        return dict(dtype=self.dtype, max_dim=self.max_factor_size,
                    block_dim=self.factor_block_size, **kwargs)

    def _init_kron(self):
        self.replicas = ema.replica_local(tf.ones([], self.dtype), name="replicas")
        self._init_inverses()

    def _init_inverses(self):
        """The cached inverses: ``(0 + 1 I)^{-1}`` until the first refresh, whose
        damping (-1) matches no real one, so they count as stale until then."""

        def cache(factor, name):
            shape = list(factor.batch_shape) + [factor.dim]
            if factor.blocks is not None:
                return tf.Variable(factor.blocks.identity(self.dtype), trainable=False,
                                   name=name)
            if factor.diagonal:
                return tf.Variable(tf.ones(shape, self.dtype), trainable=False, name=name)
            eye = tf.eye(factor.dim, batch_shape=list(factor.batch_shape), dtype=self.dtype)
            return tf.Variable(eye, trainable=False, name=name)

        self.input_inverse = cache(self.input_factor, "input_inverse")
        self.output_inverse = cache(self.output_factor, "output_inverse")
        self.inverse_damping = tf.Variable(tf.constant(-1.0, self.dtype), trainable=False,
                                           name="inverse_damping")

    # -- variables <-> V ------------------------------------------------------
    def _to_mat(self, vs):
        vs = [tf.cast(v, self.dtype) for v in vs]
        mat = tf.reshape(vs[0], [-1, self._out_width])
        if len(vs) > 1:
            mat = tf.concat([mat, tf.reshape(vs[1], [1, -1])], axis=0)
        return mat

    def _from_mat(self, mat):
        if len(self.var_shapes) == 1:
            return [tf.reshape(mat, self.var_shapes[0])]
        rows = int(np.prod(self.var_shapes[0])) // self._out_width
        weights, bias = tf.split(mat, [rows, 1])
        return [tf.reshape(weights, self.var_shapes[0]), tf.reshape(bias, self.var_shapes[1])]

    # -- statistics -------------------------------------------------------------
    def _locations(self, use):
        """T: positions / output locations of one use (from its gradient)."""
        g = use[1][0] if isinstance(use[1], (list, tuple)) else use[1]
        if g.shape[1:].is_fully_defined():
            return tf.constant(g.shape[1:].num_elements() // self._out_width)
        shape = tf.shape(g)
        return tf.size(g) // (shape[0] * self._out_width)

    def update(self, data, decay=None):
        uses = as_pairs(data)
        decay = self._decay(decay)
        self.input_factor.update([a for a, _ in uses], decay)
        self.output_factor.update([g for _, g in uses], decay)
        if self.positions == positions_lib.REDUCE:
            return
        self.replicas.assign(tf.cast(self._locations(uses[0]) * len(uses), self.dtype))

    def inverse_variables(self):
        return (self.input_inverse, self.output_inverse, self.inverse_damping)

    def inverse_updates(self, damping=None):
        xa, xg, lam = self._current_inverses(damping)
        return [(self.input_inverse, xa), (self.output_inverse, xg), (self.inverse_damping, lam)]

    def _current_inverses(self, damping):
        """``(X_A, X_G, l')`` from the current factors and damping."""
        a, g = self.input_factor, self.output_factor
        lam = self._normalised_damping(damping)
        key = ("kron_inverses", a.layout, g.layout)
        inverses = lambda av, gv, lam: linalg.kron_damped_inverses(  # noqa: E731
            av, gv, lam, a.layout, g.layout)
        return (*self.kernels(key, inverses, a.value(), g.value(), lam), lam)

    def inverses_stale(self, damping=None):
        """Whether the damping ``l'`` differs from the cached inverses' (or none are cached)."""
        return linalg.damping_changed(self._normalised_damping(damping),
                                      self.inverse_damping.read_value())

    # -- damping ------------------------------------------------------------------
    def _normalised_damping(self, damping):
        return self.damping(damping) / self.replicas

    def _split_factors(self, damping):
        """``((A, d_A), (G, d_G))``: the current factors and their pi-split damping."""
        a, g = self.input_factor, self.output_factor
        av, gv = a.value(), g.value()
        da, dg = linalg.kron_split_damping(av, gv, self._normalised_damping(damping), a.layout,
                                           g.layout)
        return (av, da), (gv, dg)

    def _damped_factors(self, damping):
        a, g = self.input_factor, self.output_factor
        (av, da), (gv, dg) = self._split_factors(damping)
        return (linalg.add_damping(av, da, a.diagonal), linalg.add_damping(gv, dg, g.diagonal))

    # -- products -------------------------------------------------------------------
    def multiply_inverse(self, vs, refreshed=False, damping=None):
        if not refreshed:
            return self.multiply_matpower(vs, -1, damping)
        a, g = self.input_factor, self.output_factor  # the key: all _to_mat, _kron_product read
        key = ("kron_multiply_inverse", type(self), self.var_shapes, self._out_width, self.dtype,
               a.layout, a.groups, g.layout)
        apply = lambda xa, xg, r, *vs: self._from_mat(  # noqa: E731
            self._kron_product(self._to_mat(vs), xa, xg) / r)
        return self.kernels(key, apply, self.input_inverse, self.output_inverse, self.replicas, *vs)

    def _kron_product(self, mat, left, right):
        """``left @ mat @ right`` (either factor may be a diagonal or blocks)."""
        a, g = self.input_factor, self.output_factor
        out = factor_blocks.left(a, lambda f, x: linalg.mul_left(f, x, a.diagonal), left, mat)
        return factor_blocks.right(g, lambda f, x: tf.matmul(f, x, transpose_a=True),
                                   lambda x, f: linalg.mul_right(x, f, g.diagonal), right, out)

    def multiply_matpower(self, vs, exp, damping=None):
        mat = self._to_mat(vs)
        if exp == 1:
            a, g = self._damped_factors(damping)
            return self._from_mat(self.replicas * self._kron_product(mat, a, g))
        if exp == -1:
            cached = lambda: (self.input_inverse.read_value(), self.output_inverse.read_value())
            xa, xg = tf.cond(self.inverses_stale(damping),
                             lambda: self._current_inverses(damping)[:2], cached)
        else:
            (av, da), (gv, dg) = self._split_factors(damping)
            xa = linalg.damped_power(av, da, self.input_factor.diagonal, exp)
            xg = linalg.damped_power(gv, dg, self.output_factor.diagonal, exp)
        return self._from_mat(tf.pow(self.replicas, exp) * self._kron_product(mat, xa, xg))

    def _cholesky_factors(self, damping):
        a, g = self._damped_factors(damping)
        return (
            linalg.cholesky(a, self.input_factor.diagonal),
            linalg.cholesky(g, self.output_factor.diagonal),
        )

    def multiply_cholesky(self, vs, transpose=False, damping=None):
        """L v with L = sqrt(R) L_A (x) L_G: V -> sqrt(R) L_A V L_G^T."""
        la, lg = self._cholesky_factors(damping)
        a, g = self.input_factor, self.output_factor
        out = factor_blocks.left(a, lambda f, x: _mul_left_t(f, x, a.diagonal, transpose), la,
                                 self._to_mat(vs))
        # x op(L_G)^T, op(L) = L^T when transposed: from the left, op(L_G) x^T
        out = factor_blocks.right(
            g, lambda f, x: tf.matmul(f, x, transpose_a=transpose),
            lambda x, f: linalg.mul_right(x, f, g.diagonal, transpose=not transpose), lg, out)
        return self._from_mat(tf.sqrt(self.replicas) * out)

    def multiply_cholesky_inverse(self, vs, transpose=False, damping=None):
        """L^{-1} v: V -> R^{-1/2} L_A^{-1} V L_G^{-T} (transposed: L^{-T})."""
        la, lg = self._cholesky_factors(damping)
        a, g = self.input_factor, self.output_factor
        out = factor_blocks.left(
            a, lambda f, x: linalg.solve_tril_left(f, x, a.diagonal, transpose), la,
            self._to_mat(vs))
        # x L_G^-T (transposed: x L_G^-1) is (L_G^-1 x^T)^T (transposed: L_G^-T)
        out = factor_blocks.right(
            g, lambda f, x: linalg.solve_tril_left(f, x, False, transpose),
            lambda x, f: linalg.solve_tril_right(x, f, g.diagonal, transpose), lg, out)
        return self._from_mat(out / tf.sqrt(self.replicas))

    def _dense_factors(self):
        return self.input_factor.dense(), self.output_factor.dense()

    def full_matrix(self):
        a, g = self._dense_factors()
        return self.replicas * linalg.kron(a, g)


class FullyConnectedKroneckerBlock(KroneckerBlock):
    """Dense kernel `[d_in, d_out]` (+ bias `[d_out]`): A from [a, 1], G from g.

    Options: `diagonal_input`, `diagonal_output` keep only that factor's
    diagonal.  Inputs `[B, ..., d_in]` with middle axes count as positions.
    A kernel of another shape is the matrix `[d_in, d_out]` the op reads it as,
    row-major (`dense.kernel_matrix_shape`), and its bias (any shape) `[d_out]`.
    """

    def __init__(
        self,
        var_shapes,
        attrs=None,
        *,
        diagonal_input=False,
        diagonal_output=False,
        lag_one=False,
        **kwargs,
    ):
        super().__init__(var_shapes, attrs, **kwargs)
        d_in, d_out = dense.kernel_matrix_shape(self.var_shapes[0], self.attrs)
        has_bias = len(self.var_shapes) > 1
        self._out_width = d_out
        self.input_factor = factors_kron.DenseInputFactor(
            d_in, has_bias, diagonal=diagonal_input,
            **self._factor_options(lag_one=lag_one, positions=self.positions,
                                   name="input_factor"))
        self.output_factor = factors_kron.OutputFactor(
            d_out, diagonal=diagonal_output,
            **self._factor_options(lag_one=lag_one, positions=self.positions,
                                   name="output_factor"))
        self._init_kron()


class FullyConnectedMultiIndepBlock(FullyConnectedKroneckerBlock):
    """A dense layer used U times, uses independent: U (A (x) G), l' = l / U,
    with A, G averaged over the uses (and positions)."""


class GroupedKroneckerBlock(KroneckerBlock):
    """Base of the grouped blocks (module docstring): when the factors have a
    group axis (`input_factor.groups`), V is `[G, K (+1), og]` and the block
    the block diagonal of the groups' Kronecker products; without one, the
    plain `KroneckerBlock`. Subclasses set the factors and `_out_width` (G*og)."""

    def _to_mat(self, vs):
        groups = self.input_factor.groups
        if groups is None:
            return super()._to_mat(vs)
        og = self._out_width // groups
        kernel = tf.reshape(tf.cast(vs[0], self.dtype), [-1, groups, og])
        mat = tf.transpose(kernel, [1, 0, 2])
        if len(vs) > 1:
            bias = tf.reshape(tf.cast(vs[1], self.dtype), [groups, 1, og])
            mat = tf.concat([mat, bias], axis=1)
        return mat

    def _from_mat(self, mat):
        if self.input_factor.groups is None:
            return super()._from_mat(mat)
        rows = self.input_factor.dim - int(len(self.var_shapes) > 1)
        out = [tf.reshape(tf.transpose(mat[:, :rows], [1, 0, 2]), self.var_shapes[0])]
        if len(self.var_shapes) > 1:
            out.append(tf.reshape(mat[:, rows], [-1]))
        return out

    def _canonical_index(self):
        """index[j, r*og + o]: canonical position of V_j's entry (r, o): the
        kernel `[K, G*og]` row-major, then the bias (row r = K)."""
        groups, width = self.input_factor.groups, self._out_width
        j, r, o = np.meshgrid(np.arange(groups), np.arange(self.input_factor.dim),
                              np.arange(width // groups), indexing="ij")
        return (r * width + j * (width // groups) + o).reshape(groups, -1)

    def full_matrix(self):
        if self.input_factor.groups is None:
            return super().full_matrix()
        a, g = self._dense_factors()
        index = self._canonical_index()
        size = index.shape[1]
        per_group = tf.reshape(self.replicas * tf.einsum("gij,gkl->gikjl", a, g), [-1, size, size])
        rows = np.broadcast_to(index[:, :, None], (len(index), size, size))
        cols = np.broadcast_to(index[:, None, :], rows.shape)
        indices = np.stack([rows, cols], axis=-1)
        return tf.scatter_nd(indices, per_group, [self.num_params, self.num_params])


class ConvKroneckerBlock(GroupedKroneckerBlock):
    """Conv2D kernel `[kh, kw, Cin, Cout]` (+ bias `[Cout]`), KFC: T (A (x) G);
    grouped (kernel `[kh, kw, Cin/G, Cout]`, G > 1 from `attrs["input_channels"]`):
    the block diagonal over groups of T (A_j (x) G_j) (module docstring)."""

    def __init__(self, var_shapes, attrs=None, **kwargs):
        super().__init__(var_shapes, attrs, **kwargs)
        kernel = self._op_kernel_shape()
        self.spec = conv.ConvSpec.from_attrs(kernel, self.attrs, len(self.var_shapes) > 1,
                                             self.name)
        self._out_width = kernel[-1]
        options = lambda name: self._factor_options(positions=self.positions, name=name)  # noqa
        self.input_factor = factors_kron.ConvInputFactor(self.spec, **options("input_factor"))
        self.output_factor = factors_kron.conv_output_factor(self.spec,
                                                             **options("output_factor"))
        self._init_kron()


class ConvMultiIndepBlock(ConvKroneckerBlock):
    """A Conv2D used U times, uses independent: T U (A (x) G), l' = l / (T U)."""


class EmbeddingKroneckerBlock(KroneckerBlock):
    """Embedding table `[V, D]`; uses are `(ids [B, ...], g [B, ..., D])`."""

    def __init__(self, var_shapes, attrs=None, **kwargs):
        super().__init__(var_shapes, attrs, **kwargs)
        vocab, width = self.var_shapes[0]
        self._out_width = width
        self.input_factor = factors_kron.EmbeddingInputFactor(
            vocab, **self._factor_options(name="input_factor"))
        self.output_factor = factors_kron.OutputFactor(
            width, **self._factor_options(name="output_factor"))
        self._init_kron()


class DepthwiseConvKroneckerBlock(GroupedKroneckerBlock):
    """Depthwise kernel `[kh, kw, C, M]` (+ bias `[C*M]`): per channel KFC.
    DepthwiseConv1D's kernel variable `[k, C, M]` is the op's `[1, k, C, M]`."""

    def __init__(self, var_shapes, attrs=None, **kwargs):
        super().__init__(var_shapes, attrs, **kwargs)
        kh, kw, channels, mult = self._op_kernel_shape()
        self._out_width = channels * mult
        self.spec = depthwise.DepthwiseSpec.from_attrs(
            (kh, kw, channels, mult), self.attrs, len(self.var_shapes) > 1, self.name)
        options = lambda name: self._factor_options(positions=self.positions, name=name)  # noqa
        self.input_factor = factors_kron.DepthwiseInputFactor(self.spec, **options("input_factor"))
        self.output_factor = factors_kron.depthwise_output_factor(self.spec,
                                                                  **options("output_factor"))
        self._init_kron()
