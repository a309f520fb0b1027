"""The exact inverse of a sum of two Kronecker products, by simultaneous
diagonalisation.

For ``M = A1 (x) B1 + A2 (x) B2`` with ``A1``, ``B1`` symmetric positive
definite and ``A2``, ``B2`` symmetric positive semi-definite, let

    A1^{-1/2} A2 A1^{-1/2} = U_a S_a U_a^T,   B1^{-1/2} B2 B1^{-1/2} = U_b S_b U_b^T,
    P_a = A1^{1/2} U_a,  P_b = B1^{1/2} U_b,  K_a = A1^{-1/2} U_a = P_a^{-T}, K_b likewise.

Then ``P_a P_a^T = A1``, ``P_a S_a P_a^T = A2`` (and the same on the b side), so

    M = (P_a (x) P_b) (I + S_a (x) S_b) (P_a (x) P_b)^T,
    M^{-1} = (K_a (x) K_b) (I + S_a (x) S_b)^{-1} (K_a (x) K_b)^T.

With the row-major ``vec`` (``(A (x) B) vec(X) = vec(A X B^T)``), for
``X [m, n]``:

    M^{-1} vec(X) = vec(K_a [(K_a^T X K_b) / (1 + s_a s_b^T)] K_b^T)

(elementwise division), and ``L = (P_a (x) P_b) (I + S_a (x) S_b)^{1/2}``
satisfies ``L L^T = M``: ``L vec(X) = vec(P_a [sqrt(1 + s_a s_b^T) * X] P_b^T)``.
The basis is not orthogonal, so other powers of ``M`` are not of this form.
The ``s`` are clipped at 0, so every denominator is at least 1.

Either side may be diagonal (its matrices given as ``[n]`` diagonals, both
``*1`` and ``*2`` of that side): then ``U = I``, ``S = A2 / A1`` and
``K = A1^{-1/2}``, all elementwise. On the a side ``A1`` is always given as
a diagonal ``[m]`` (the damped id frequencies of a tied embedding);
``A2`` is ``[m, m]`` or ``[m]``.
"""

import collections

import tensorflow as tf

from kfac_graph.fisher import linalg

Basis = collections.namedtuple("Basis", "ka sa kb sb")
Basis.__doc__ = """``K_a`` (``[m, m]`` or its diagonal ``[m]``), ``s_a [m]``,
``K_b`` (``[n, n]`` or ``[n]``), ``s_b [n]`` of the module docstring."""


def _a_side(a1, a2, diagonal):
    """``(K_a, s_a)`` for a diagonal ``A1 [m]`` and ``A2`` (``[m, m]`` or ``[m]``)."""
    r = tf.math.rsqrt(a1)
    if diagonal:
        return r, tf.maximum(a2, 0.0) * r * r
    s, u = linalg.psd_eig(r[:, None] * a2 * r[None, :])
    return r[:, None] * u, s


def _b_side(b1_evals, b1_evecs, b2, diagonal):
    """``(K_b, s_b)`` for ``B1 = V diag(e) V^T`` (or a diagonal ``e``) and ``B2``."""
    if diagonal:
        return tf.math.rsqrt(b1_evals), tf.maximum(b2, 0.0) / b1_evals
    inv_root = tf.matmul(b1_evecs * tf.math.rsqrt(b1_evals)[None, :], b1_evecs, transpose_b=True)
    s, u = linalg.psd_eig(tf.matmul(inv_root, tf.matmul(b2, inv_root)))
    return tf.matmul(inv_root, u), s


def decompose(a1, a2, b1_evals, b1_evecs, b2, a_diagonal, b_diagonal) -> Basis:
    """The basis of ``M = diag(a1) (x) B1 + A2 (x) B2``; ``B1`` given by its
    eigenpairs (``b1_evecs`` None when the b side is diagonal), every
    ``b1_evals`` positive, every ``a1`` positive."""
    ka, sa = _a_side(a1, a2, a_diagonal)
    kb, sb = _b_side(b1_evals, b1_evecs, b2, b_diagonal)
    return Basis(ka, sa, kb, sb)


def _left(k, x, diagonal, transpose):
    """``K x`` (``K^T x``) for ``K`` ``[m, m]`` or its diagonal."""
    return k[:, None] * x if diagonal else tf.matmul(k, x, transpose_a=transpose)


def _right(x, k, diagonal, transpose):
    """``x K`` (``x K^T``)."""
    return x * k[None, :] if diagonal else tf.matmul(x, k, transpose_b=transpose)


def _denominators(basis):
    return 1.0 + basis.sa[:, None] * basis.sb[None, :]


def apply_inverse(basis, x, a_diagonal, b_diagonal):
    """``M^{-1} vec(x)`` as ``[m, n]`` (module docstring)."""
    y = _right(_left(basis.ka, x, a_diagonal, True), basis.kb, b_diagonal, False)
    y = y / _denominators(basis)
    return _right(_left(basis.ka, y, a_diagonal, False), basis.kb, b_diagonal, True)


def apply_root(basis, a1, b1, x, a_diagonal, b_diagonal, transpose=False):
    """``L vec(x)`` (``L^T vec(x)``), ``L = (P_a (x) P_b) (I + S_a (x) S_b)^{1/2}``,
    ``P = A1 K`` (``A1 [m]`` diagonal, ``B1`` ``[n, n]`` or ``[n]``)."""
    pa = a1 * basis.ka if a_diagonal else a1[:, None] * basis.ka
    pb = b1 * basis.kb if b_diagonal else tf.matmul(b1, basis.kb)
    root = tf.sqrt(_denominators(basis))
    if transpose:
        return root * _right(_left(pa, x, a_diagonal, True), pb, b_diagonal, False)
    return _right(_left(pa, root * x, a_diagonal, False), pb, b_diagonal, True)


def apply_root_inverse(basis, x, a_diagonal, b_diagonal, transpose=False):
    """``L^{-1} vec(x)`` (``L^{-T} vec(x)``): ``L^{-1} = D^{-1/2} (K_a (x) K_b)^T``."""
    root = tf.sqrt(_denominators(basis))
    if transpose:
        return _right(_left(basis.ka, x / root, a_diagonal, False), basis.kb, b_diagonal, True)
    return _right(_left(basis.ka, x, a_diagonal, True), basis.kb, b_diagonal, False) / root
