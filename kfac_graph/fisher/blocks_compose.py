"""Blocks made of other blocks: a kernel seen in another layout, and a block
diagonal over groups of a layer's variables.

`TransposedKernelBlock(block, var_shapes)`: a kernel stored with shape
`[..., d]`, viewed as the row-major matrix `M [r, d]` (r the product of the
other axes), is handed to `block` as `M^T [d, r]`, the layout `block` was
built for (a dense kernel stored `[d_out, d_in]`; a transposed convolution's
`[kh, kw, Cout_t, Cin_t]`, whose Kronecker block acts on `[Cin_t,
kh*kw*Cout_t]`). Vectors are transposed on the way in and out, `full_matrix`
is permuted to the stored row-major order; other variables (a bias) pass
through as they are.

`PermutedKernelBlock(block, var_shapes, perm)`: a kernel the op applies as
`transpose(W, perm)` (a dense kernel contracted on a later axis), handed to
`block` in that permuted layout: vectors are transposed by `perm` on the
way in and back on the way out, `full_matrix` is permuted to the stored
row-major order.

`StackedKernelBlock(block, var_shapes, rows)`: a dense kernel made of
several variables, `[W; R]` (`W` `[rows[0], d_out]`, then `R`; a recurrent
cell's input and recurrent kernels), handed to `block` as the one matrix
it was built for: vectors are concatenated along the rows on the way in
and split on the way out; the row-major order of `[W; R]` is that of `W`
then `R`, so `full_matrix` is the inner one.

`PartsBlock(parts)`: `F ~= diag(F_1, F_2, ...)`, part k a block over the
next `len(parts[k].var_shapes)` variables (in layer order), the cross terms
between parts dropped. Every part sees the layer's whole data; every method
is the parts' own, side by side (`multiply_cholesky`: a block-diagonal `L`
with `L L^T` the damped block; `inverses_stale`: any part's).
"""

import numpy as np
import tensorflow as tf

from kfac_graph.fisher import blocks_base


class TransposedKernelBlock(blocks_base.FisherBlock):
    """``block`` presented for the kernel layout ``var_shapes[0]`` (module
    docstring). Statistics (``(a, g)`` uses) pass through unchanged;
    ``block`` is the inner one."""

    def __init__(self, block, var_shapes, attrs=None, **kwargs):
        super().__init__(var_shapes, attrs, **kwargs)
        self.block = block
        self.stats = block.stats
        kernel_shape = self.var_shapes[0]
        self._cols = kernel_shape[-1]
        self._rows = int(np.prod(kernel_shape[:-1]))
        size = self._rows * self._cols
        kernel = np.arange(size).reshape(self._cols, self._rows).T.reshape(-1)
        self._perm = np.concatenate([kernel, np.arange(size, self.num_params)]).astype(np.int64)

    def _inward(self, vs):
        return [tf.transpose(tf.reshape(vs[0], [self._rows, self._cols]))] + list(vs[1:])

    def _outward(self, vs):
        return [tf.reshape(tf.transpose(vs[0]), self.var_shapes[0])] + list(vs[1:])

    def damping(self, value=None):
        return self.block.damping(value)

    def update(self, data, decay=None):
        return self.block.update(data, decay)

    def inverse_updates(self, damping=None):
        return self.block.inverse_updates(damping)

    def inverses_stale(self, damping=None):
        return self.block.inverses_stale(damping)

    def inverse_variables(self):
        return self.block.inverse_variables()

    def multiply(self, vs, damping=None):
        return self._outward(self.block.multiply(self._inward(vs), damping))

    def multiply_inverse(self, vs, refreshed=False, damping=None):
        return self._outward(self.block.multiply_inverse(self._inward(vs), refreshed, damping))

    def multiply_matpower(self, vs, exp, damping=None):
        return self._outward(self.block.multiply_matpower(self._inward(vs), exp, damping))

    def multiply_cholesky(self, vs, transpose=False, damping=None):
        """``P L P^T`` for the inner ``L`` (``P`` the layout permutation):
        not triangular, but its product with its transpose is the block."""
        return self._outward(self.block.multiply_cholesky(self._inward(vs), transpose, damping))

    def multiply_cholesky_inverse(self, vs, transpose=False, damping=None):
        return self._outward(self.block.multiply_cholesky_inverse(self._inward(vs), transpose,
                                                                  damping))

    def full_matrix(self):
        inner = self.block.full_matrix()
        return tf.gather(tf.gather(inner, self._perm, axis=0), self._perm, axis=1)


class PermutedKernelBlock(TransposedKernelBlock):
    """``block`` (built for the kernel ``transpose(W, perm)``) presented for
    the stored kernel ``var_shapes[0]`` (module docstring)."""

    def __init__(self, block, var_shapes, perm, attrs=None, **kwargs):
        blocks_base.FisherBlock.__init__(self, var_shapes, attrs, **kwargs)
        self.block = block
        self.stats = block.stats
        self._forward = [int(p) for p in perm]
        self._backward = [int(i) for i in np.argsort(self._forward)]
        kernel_shape = self.var_shapes[0]
        size = int(np.prod(kernel_shape))
        # stored flat index of each entry of the permuted kernel, then inverted:
        # the row of the inner matrix that each stored entry is
        stored = np.arange(size).reshape(kernel_shape).transpose(self._forward).reshape(-1)
        self._perm = np.concatenate([np.argsort(stored),
                                     np.arange(size, self.num_params)]).astype(np.int64)

    def _inward(self, vs):
        return [tf.transpose(vs[0], self._forward)] + list(vs[1:])

    def _outward(self, vs):
        return [tf.transpose(vs[0], self._backward)] + list(vs[1:])


class StackedKernelBlock(TransposedKernelBlock):
    """``block`` (built for the kernel ``[sum(rows), d_out]``) presented for
    the kernel's variables, ``rows[k]`` rows each, then the rest (module
    docstring)."""

    def __init__(self, block, var_shapes, rows, attrs=None, **kwargs):
        blocks_base.FisherBlock.__init__(self, var_shapes, attrs, **kwargs)
        self.block = block
        self.stats = block.stats
        self._rows = [int(r) for r in rows]

    def _inward(self, vs):
        k = len(self._rows)
        return [tf.concat(list(vs[:k]), axis=0)] + list(vs[k:])

    def _outward(self, vs):
        return tf.split(vs[0], self._rows, axis=0) + list(vs[1:])

    def full_matrix(self):
        return self.block.full_matrix()


class PartsBlock(blocks_base.FisherBlock):
    """The block diagonal of ``parts`` (module docstring); ``var_shapes``:
    the layer's variables, the parts' in order. The parts are built with the
    layer's damping and decay; a damping passed to a method reaches them all."""

    def __init__(self, parts, var_shapes, attrs=None, **kwargs):
        super().__init__(var_shapes, attrs, **kwargs)
        self.parts = list(parts)
        shapes = [s for part in self.parts for s in part.var_shapes]
        if tuple(shapes) != self.var_shapes:
            raise ValueError(f"PartsBlock: the parts cover {shapes}, not {list(self.var_shapes)}")
        stats = {part.stats for part in self.parts}
        if len(stats) != 1:
            raise ValueError(f"PartsBlock: the parts take different data {sorted(stats)}")
        self.stats = stats.pop()
        ends = np.cumsum([len(part.var_shapes) for part in self.parts])
        self._slices = [slice(end - len(p.var_shapes), end) for p, end in zip(self.parts, ends)]

    def _each(self, method, vs, *args):
        """``method(part, part's vs, *args)`` for every part, concatenated."""
        return [t for part, cut in zip(self.parts, self._slices)
                for t in method(part, list(vs[cut]), *args)]

    def update(self, data, decay=None):
        for part in self.parts:
            part.update(data, decay)

    def inverse_updates(self, damping=None):
        return [pair for part in self.parts for pair in part.inverse_updates(damping)]

    def inverses_stale(self, damping=None):
        return tf.reduce_any(tf.stack([part.inverses_stale(damping) for part in self.parts]))

    def inverse_variables(self):
        return tuple(v for part in self.parts for v in part.inverse_variables())

    def multiply(self, vs, damping=None):
        return self._each(lambda p, v: p.multiply(v, damping), vs)

    def multiply_inverse(self, vs, refreshed=False, damping=None):
        return self._each(lambda p, v: p.multiply_inverse(v, refreshed, damping), vs)

    def multiply_matpower(self, vs, exp, damping=None):
        return self._each(lambda p, v: p.multiply_matpower(v, exp, damping), vs)

    def multiply_cholesky(self, vs, transpose=False, damping=None):
        return self._each(lambda p, v: p.multiply_cholesky(v, transpose, damping), vs)

    def multiply_cholesky_inverse(self, vs, transpose=False, damping=None):
        return self._each(lambda p, v: p.multiply_cholesky_inverse(v, transpose, damping), vs)

    def full_matrix(self):
        mats = [tf.cast(part.full_matrix(), self.dtype) for part in self.parts]
        sizes = [m.shape[0] for m in mats]
        out, start = [], 0
        for m, size in zip(mats, sizes):
            pad = [start, self.num_params - start - size]
            out.append(tf.pad(m, [pad, pad]))
            start += size
        return tf.add_n(out)
