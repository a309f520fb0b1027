"""Small linear-algebra helpers shared by the factors and blocks.

Conventions: a "factor" is a symmetric PSD matrix `[..., n, n]` or, when
diagonal, its diagonal `[..., n]`; the optional leading axes batch
independent factors (one per depthwise channel).  Damping `d` has the
leading shape (`[]` or `[groups]`) and is added to the diagonal.
"""

import numpy as np
import tensorflow as tf


def cast(x, dtype):
    """`tf.cast` that keeps full precision for Python numbers."""
    if isinstance(x, (int, float, np.number)):
        return tf.constant(x, dtype)
    return tf.cast(x, dtype)


def flatten(vs):
    """Concatenates tensors flattened row-major: the canonical vector order."""
    return tf.concat([tf.reshape(v, [-1]) for v in vs], axis=0)


def unflatten(vec, shapes):
    """Splits a flat vector into tensors of the given static shapes."""
    sizes = [int(np.prod(s)) for s in shapes]
    parts = tf.split(vec, sizes) if len(sizes) > 1 else [vec]
    return [tf.reshape(p, s) for p, s in zip(parts, shapes)]


def append_ones(x):
    """Appends the homogeneous coordinate: `[..., d] -> [..., d + 1]` (by
    padding: TensorFlow's concat along the last axis copies row by row)."""
    return tf.pad(x, [[0, 0]] * (len(x.shape) - 1) + [[0, 1]], constant_values=1)


def kron(a, b):
    """Kronecker product of two matrices: kron(a, b)[i*p+k, j*q+l] = a[i,j] b[k,l]."""
    m, n = a.shape[-2], a.shape[-1]
    p, q = b.shape[-2], b.shape[-1]
    out = a[:, None, :, None] * b[None, :, None, :]
    return tf.reshape(out, [m * p, n * q])


def trace(factor, diagonal):
    """Trace of a factor (batched over leading axes)."""
    return tf.reduce_sum(factor if diagonal else diag_part(factor), -1)


def diag_part(matrix):
    """The main diagonal `[..., n]` of `[..., n, n]` (the one-input kernel:
    `tf.linalg.diag_part` adds four constant inputs to every call's trace)."""
    return tf.raw_ops.MatrixDiagPart(input=matrix)


def column(x):
    """`x[..., None]`: one trailing axis of length 1 (a reshape-like op with
    one constant input, where indexing traces a slice with three)."""
    return tf.expand_dims(x, -1)


def pi_split_damping(damping, trace_a, dim_a, trace_g, dim_g):
    """Splits Tikhonov damping between two Kronecker factors.

    With `pi = sqrt((tr A / dim A) / (tr G / dim G))` returns
    `(pi sqrt(damping), sqrt(damping) / pi)`, so that
    `(A + pi sqrt(l) I) (x) (G + sqrt(l)/pi I)` = `A(x)G + l I + ...`.
    When either trace is not positive (no statistics yet) `pi = 1`.
    """
    num = trace_a / dim_a
    den = trace_g / dim_g
    ok = tf.logical_and(num > 0, den > 0)
    safe_den = tf.where(ok, den, tf.ones_like(den))
    pi = tf.where(ok, tf.sqrt(num / safe_den), tf.ones_like(num))
    root = tf.sqrt(cast(damping, pi.dtype))
    return pi * root, root / pi


def identity_like(matrix):
    """The identity shaped like `matrix` `[..., n, n]`, computed when the
    graph runs. (`tf.eye(n)` has only constant inputs, so TensorFlow's
    function runtime folds it into an `n x n` constant that it keeps, in
    several copies, for as long as the function lives: a step with many
    factors held gigabytes of identities that way.)"""
    return tf.raw_ops.MatrixDiag(diagonal=tf.ones_like(diag_part(matrix)))


def add_damping(factor, damping, diagonal):
    """`factor + damping I` (the damping added to the diagonal in place: no
    identity matrix is formed, see `identity_like`)."""
    if diagonal:
        return factor + column(damping)
    return tf.raw_ops.MatrixSetDiag(input=factor, diagonal=diag_part(factor) + column(damping))


def mul_left(factor, x, diagonal):
    """`factor @ x` for x `[..., n, m]`."""
    return column(factor) * x if diagonal else tf.matmul(factor, x)


def mul_right(x, factor, diagonal, transpose=False):
    """`x @ factor` (or `x @ factor^T`) for x `[..., m, n]`."""
    if diagonal:
        return x * tf.expand_dims(factor, -2)
    return tf.matmul(x, factor, transpose_b=transpose)


def cholesky(factor, diagonal):
    """Lower Cholesky factor (the square root of a diagonal)."""
    return tf.sqrt(factor) if diagonal else tf.linalg.cholesky(factor)


def solve_tril_left(chol, x, diagonal, transpose=False):
    """`L^{-1} x` (or `L^{-T} x`) for a lower-triangular `L`."""
    if diagonal:
        return x / column(chol)
    return tf.linalg.triangular_solve(chol, x, lower=True, adjoint=transpose)


def solve_tril_right(x, chol, diagonal, transpose=False):
    """`x L^{-T}` (or `x L^{-1}` when transpose)."""
    if diagonal:
        return x / tf.expand_dims(chol, -2)
    xt = tf.linalg.matrix_transpose(x)
    out = tf.linalg.triangular_solve(chol, xt, lower=True, adjoint=transpose)
    return tf.linalg.matrix_transpose(out)


def damped_inverse(factor, damping, diagonal):
    """`(factor + d I)^{-1}` by a Cholesky factorisation (NaN, not an error,
    where `factor + d I` is not positive definite: the optimizer then skips
    the step)."""
    if diagonal:
        return 1.0 / (tf.maximum(factor, 0.0) + column(damping))
    sym = 0.5 * (factor + tf.linalg.matrix_transpose(factor))
    chol = tf.linalg.cholesky(add_damping(sym, damping, False))
    return tf.linalg.cholesky_solve(chol, identity_like(factor))


def kron_split_damping(av, gv, damping, a_layout, g_layout):
    """`pi_split_damping` of two Kronecker factors' values `av`, `gv`, stored
    as their layouts say (`dim`, `diagonal`, `trace(value)`: a
    `factors_base.FactorLayout`)."""
    return pi_split_damping(damping, a_layout.trace(av), a_layout.dim, g_layout.trace(gv),
                            g_layout.dim)


def kron_damped_inverses(av, gv, damping, a_layout, g_layout):
    """`(X_A, X_G)`: the inverses of the factors `av`, `gv` damped by the
    pi-split of `damping` (`kron_split_damping`)."""
    da, dg = kron_split_damping(av, gv, damping, a_layout, g_layout)
    return damped_inverse(av, da, a_layout.diagonal), damped_inverse(gv, dg, g_layout.diagonal)


def damping_changed(damping, cached):
    """Whether a cache made for the damping ``cached`` (negative: none made)
    is stale for ``damping`` (a relative difference above 1e-6)."""
    return tf.abs(damping - cached) > 1e-6 * tf.abs(cached)


def psd_damped_inverse(matrix, damping):
    """`(matrix + d I)^{-1}` for one dense PSD `matrix`: by Cholesky
    (`damped_inverse`, about `n^3` multiply-adds), or, where rounding left the
    damped matrix indefinite (that result not finite), by the
    eigendecomposition with negative eigenvalues clipped at 0 (about `4 n^3`)."""
    damping = cast(damping, matrix.dtype)
    by_cholesky = damped_inverse(matrix, damping, False)
    return tf.cond(tf.reduce_all(tf.math.is_finite(by_cholesky)), lambda: by_cholesky,
                   lambda: damped_power(matrix, damping, False, -1.0))


def damped_power(factor, damping, diagonal, exp):
    """`(factor + d I)^exp` (negative eigenvalues of the factor clipped at 0)."""
    if diagonal:
        return tf.pow(tf.maximum(factor, 0.0) + column(damping), exp)
    evals, evecs = psd_eig(factor)
    powered = tf.pow(evals + column(damping), exp)
    return tf.matmul(evecs * tf.expand_dims(powered, -2), evecs, transpose_b=True)


def psd_eig(matrix):
    """Eigen-decomposition of the symmetrised matrix, eigenvalues clipped at 0."""
    sym = 0.5 * (matrix + tf.linalg.matrix_transpose(matrix))
    evals, evecs = tf.linalg.eigh(sym)
    return tf.maximum(evals, 0.0), evecs


def psd_power(matrix, exp, floor=None):
    """`matrix^exp` for a PSD matrix; eigenvalues <= floor map to 0 (pinv)."""
    evals, evecs = psd_eig(matrix)
    if floor is None:
        powered = tf.pow(evals, exp)
    else:
        keep = evals > floor
        powered = tf.where(keep, tf.pow(tf.where(keep, evals, 1.0), exp), 0.0)
    return tf.matmul(evecs * tf.expand_dims(powered, -2), evecs, transpose_b=True)


class DiagonalCache(tf.Module):
    """A diagonal factor's snapshot (negative entries clipped at 0) in a
    variable; `power_left` then applies `(F + d I)^p` for any power `p`, so the
    damping may change between refreshes."""

    def __init__(self, dim, dtype, name=None):
        super().__init__(name=name)
        self.evals = tf.Variable(tf.zeros([dim], dtype), trainable=False, name="evals")

    def updates(self, factor):
        """``[(variable, new value)]`` that store ``factor`` (nothing assigned)."""
        return [(self.evals, tf.maximum(factor, 0.0))]

    @staticmethod
    def power_left(evals, x, damping, exp):
        """`(F + d I)^exp @ x` for `x` `[dim, m]`, `evals` the stored entries of `F`."""
        return column(tf.pow(evals + column(damping), exp)) * x
