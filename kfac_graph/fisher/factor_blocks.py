"""The block-diagonal layout of a wide Kronecker factor.

A full factor of width ``d`` over the block size ``m`` (the estimator's
``factor_block_size``) keeps the ``c = ceil(d / m)`` diagonal
blocks of ``C`` of equal size ``k = ceil(d / c) <= m``, the last one
padded with zero rows and columns to ``k``: stored ``[c, k, k]``, it is
``C_bd = diag(C_1, ..., C_c)`` with ``C_j = C[jk:(j+1)k, jk:(j+1)k]``. The
damped factor ``C_bd + d I`` is then block-diagonal too, so its inverse,
powers and Cholesky factor are those of the blocks, and a product
``C_bd X`` (``X`` ``[d, n]``) is ``c`` batched products of ``[k, k]`` by
``[k, n]``: ``c k^2 n`` multiply-adds against ``d^2 n``, and a refresh
``c k^3`` against ``d^3``. A padded row of the factor's value is 1 on the
diagonal and zero elsewhere (``with_padding``; the trace leaves it out): it
never mixes with a real one, keeps the blocks as invertible as the factor
(at any damping), and the rows it adds to a product are cut off again.

The Kronecker block ``C_bd (x) G`` drops the cross-covariances between
the blocks (between input features, or patch positions and channels, in
different blocks); a diagonal factor (one over ``max_factor_size``) drops
all of them, a full one none.
"""
from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from kfac_graph.fisher import linalg


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """``count`` diagonal blocks of ``size`` covering a factor of width ``dim``."""

    dim: int
    count: int
    size: int

    @classmethod
    def for_budget(cls, dim: int, max_size: int) -> "BlockLayout":
        """The fewest equal blocks of at most ``max_size`` covering ``dim``."""
        count = math.ceil(dim / max_size)
        return cls(dim, count, math.ceil(dim / count))

    @property
    def padding(self) -> int:
        return self.count * self.size - self.dim

    @property
    def shape(self) -> list:
        return [self.count, self.size, self.size]

    def rows(self, x):
        """Rows ``[N, dim]`` as ``[N, count, size]`` (zero-padded)."""
        if self.padding:
            x = tf.pad(x, [[0, 0], [0, self.padding]])
        return tf.reshape(x, [-1, self.count, self.size])

    def split(self, mat):
        """``[dim, n]`` as ``[count, size, n]``: the rows each block multiplies."""
        if self.padding:
            mat = tf.pad(mat, [[0, self.padding], [0, 0]])
        return tf.reshape(mat, [self.count, self.size, -1])

    def merge(self, blocks):
        """The inverse of ``split``: ``[count, size, n]`` to ``[dim, n]``."""
        mat = tf.reshape(blocks, [self.count * self.size, -1])
        return mat[:self.dim] if self.padding else mat

    def with_padding(self, value):
        """``value`` ``[count, size, size]`` with 1 on the padded diagonal."""
        if not self.padding:
            return value
        ones = [0.0] * (self.count * self.size - self.padding) + [1.0] * self.padding
        return value + tf.linalg.diag(tf.reshape(tf.constant(ones, value.dtype),
                                                 [self.count, self.size]))

    def trace(self, value):
        """The trace of the factor that ``with_padding(value)`` stores."""
        return tf.reduce_sum(linalg.diag_part(value)) - self.padding

    def dense(self, value):
        """The block-diagonal matrix ``[dim, dim]`` that ``value`` stores."""
        blocks = tf.unstack(value)
        full = tf.linalg.LinearOperatorBlockDiag(
            [tf.linalg.LinearOperatorFullMatrix(b) for b in blocks]).to_dense()
        return full[:self.dim, :self.dim]

    def identity(self, dtype):
        return tf.eye(self.size, batch_shape=[self.count], dtype=dtype)


def left(factor, fn, value, mat):
    """``fn(value, mat)``: a product or solve from the left by a factor's
    stored ``value`` (``fn`` as for a full factor, e.g. ``linalg``'s), of
    ``mat`` ``[dim, n]``; block by block where ``factor.blocks`` is a layout."""
    layout = factor.blocks
    if layout is None:
        return fn(value, mat)
    return layout.merge(fn(value, layout.split(mat)))


def right(factor, left_fn, right_fn, value, mat):
    """``right_fn(mat, value)``, from the right, of ``mat`` ``[n, dim]``; in
    blocks through the same operation's left form ``left_fn`` on ``mat^T``
    (``left_fn(value, x)`` must be ``right_fn(x^T, value)^T``, e.g. ``value^T
    x`` for ``x value``)."""
    if factor.blocks is None:
        return right_fn(mat, value)
    transpose = tf.linalg.matrix_transpose
    return transpose(left(factor, left_fn, value, transpose(mat)))
