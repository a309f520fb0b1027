"""The Gauss-Newton curvature of a loss that is no likelihood (kind ``"ggn"``).

For a loss read only down to per-example terms ``l_i`` with a model output
``z`` (``passes.loss_output``: Huber, log-cosh, Poisson, focal, KL, cosine),
the curvature at ``z`` is the loss's own Hessian, per example and position,

    H_it = d^2 l_i / dz_it^2            ([..., K, K]),

formed by ``K`` backward passes through the loss head, vectorised into one
(``tf.vectorized_map``; row ``c`` is the gradient of ``dl/dz . e_c``,
``e_c`` the unit vector of class ``c`` at every position: exact where the
head is per position, as the pass checks). The
generalised Gauss-Newton matrix ``(1/B) sum_i J_i^T H_i J_i`` is then the
Fisher of the likelihood kinds (their ``-log p`` has Hessian ``F``), and it
stands in for one here. ``H`` is projected onto the positive semidefinite
cone (negative eigenvalues set to zero: a non-convex head such as a cosine
similarity) so that the curvature stays a curvature.

``GGN(H)`` offers the distribution interface the estimator and the exact
forms use (``fisher``, ``fisher_diagonal``, ``multiply_fisher``,
``sqrt_fisher``, ``sqrt_fisher_columns``) and, for the sampled mode,
``sample_cotangent(seed)``: ``S eps`` with ``S S^T = H``, ``eps ~ N(0, I)``,
whose outer products average to ``H``. There are no targets to sample."""

import numpy as np
import tensorflow as tf



def output_hessian(per_example_loss, z):
    """``[..., K, K]``: ``H`` at each position of ``z`` (module docstring),
    in float32 at least, non-finite entries (a step about to be skipped) zero."""
    k, rank = z.shape[-1], z.shape.rank
    rows = hessian_rows(per_example_loss, z, np.eye(k))  # [K, ..., K]
    if rows is None:
        return tf.zeros(tf.concat([tf.shape(z), [k]], 0), at_least_float32_dtype(z.dtype))
    return symmetric_part(tf.transpose(rows, [*range(1, rank), 0, rank]), z.dtype)


def hessian_rows(per_example_loss, z, units):
    """``[C, *shape(z)]``: row ``c`` the gradient of ``dl/dz . u_c``, each
    unit ``u_c`` (``units`` ``[C, m]``, ``m`` ``z``'s trailing size or sizes)
    broadcast over ``z``'s leading axes; the ``C`` backward passes vectorised
    into one (pfor). None where the loss does not read ``z``."""
    grad = tf.gradients(tf.reduce_sum(per_example_loss), z)[0]
    if grad is None:
        return None

    def row(unit):
        out = tf.gradients(grad, z, grad_ys=tf.broadcast_to(unit, tf.shape(grad)))[0]
        return tf.zeros_like(z) if out is None else out
    return tf.vectorized_map(row, tf.cast(units, grad.dtype))


def symmetric_part(h, dtype):
    """``h`` ``[..., K, K]`` in ``at_least_float32_dtype(dtype)``, non-finite
    entries zero, symmetrised."""
    h = tf.cast(h, at_least_float32_dtype(dtype))
    h = tf.where(tf.math.is_finite(h), h, tf.zeros_like(h))
    return 0.5 * (h + tf.linalg.matrix_transpose(h))


def at_least_float32_dtype(dtype):
    return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


class GGN:
    """The loss Hessian ``H`` at ``z``, made positive semidefinite."""

    kind = "ggn"

    def __init__(self, hessian):
        values, vectors = tf.linalg.eigh(hessian)
        self._values = values
        self._sqrt = vectors * tf.sqrt(tf.maximum(values, 0.0))[..., None, :]

    def flat(self):
        """Whether ``H`` made positive semidefinite is zero (up to rounding)
        at every position: the loss is concave or piecewise linear at ``z``."""
        top = tf.reduce_max(self._values, axis=-1)
        scale = tf.reduce_max(tf.abs(self._values), axis=-1)
        eps = tf.constant(np.finfo(self._values.dtype.as_numpy_dtype).eps ** 0.5,
                          self._values.dtype)
        return tf.reduce_all(top <= eps * scale)

    def sqrt_fisher(self):
        return self._sqrt

    def sqrt_fisher_columns(self):
        return tf.unstack(self._sqrt, axis=-1)

    def fisher(self):
        return tf.linalg.matmul(self._sqrt, self._sqrt, transpose_b=True)

    def fisher_diagonal(self):
        return tf.reduce_sum(tf.square(self._sqrt), axis=-1)

    def multiply_fisher(self, v):
        v = tf.cast(v, self._sqrt.dtype)
        inner = tf.einsum("...kc,...k->...c", self._sqrt, v)
        return tf.einsum("...kc,...c->...k", self._sqrt, inner)

    def sample_cotangent(self, seed):
        shape = tf.shape(self._sqrt)[:-1]
        eps = tf.random.stateless_normal(shape, seed=seed, dtype=self._sqrt.dtype)
        return tf.einsum("...kc,...c->...k", self._sqrt, eps)

