"""Series (RNN) blocks for a dense layer applied at U consecutive time steps.

Martens, Ba & Johnson (ICLR 2018), "Kronecker-factored curvature
approximations for recurrent neural networks", options 1 and 2 (the
`FullyConnectedSeriesFB` of tensorflow/kfac).  Uses must be the time steps
in order, each `(a [B, d_in], g [B, d_out])`.  The factors track the
time-averaged moments C0 (= A, G as in the independent block) and the
lag-one cross moments C1 = E[x_{t+1} x_t^T] (normalised by all B U rows,
see `factors_base`).  Assuming a and g are independent stationary VAR(1)
processes, the lag-d moments are M_d = (C1 C0^{-1})^d C0 (d >= 0),
M_{-d} = M_d^T, and the Fisher of the shared weights is

    F = sum_{t,s} M^A_{t-s} (x) M^G_{t-s}.

Option 1 symmetrises C1 -> (C1 + C1^T)/2 and sums exactly over T = U steps:
    F = sum_{|d| < T} (T - |d|) M^A_d (x) M^G_d
      = (N_A (x) N_G) diag(1 / gamma(psi_A psi_G^T)) (N_A (x) N_G)^T,
    hat Psi = C0^{-1/2} C1 C0^{-1/2} = U diag(psi) U^T, N = C0^{1/2} U,
    1/gamma(x) = sum_{|d|<T} (T-|d|) x^|d| = (T(1-x^2) - 2x(1-x^T)) / (1-x)^2.
Option 2 takes sequences as infinitely long:  F = T sum_{d in Z} M^A_d (x) M^G_d,
    F^{-1} = (1/T) (I - P^T) K D K^T (I - P),   P = C1^T C0^{-1} per factor,
    hat Psi^T hat Psi = E diag(mu) E^T,  K = C0^{-1/2} E,
    D = diag(1 / (1 - mu_A mu_G^T)).
Damping: l' = l / U split by pi between the factors, added to C0 only,
when `update_inverses()` makes the quantities (`inverses_stale()` says
when l' has changed since).
Supported: multiply_inverse (both), multiply (option 1 only, from the
current factors), full_matrix (undamped, pseudo-inverting a singular C0;
dense, meant for tests); no Cholesky, no other powers.
"""

import tensorflow as tf

from kfac_graph.fisher import blocks_kron
from kfac_graph.fisher import linalg
from kfac_graph.layers.uses import as_pairs

OPTIONS = (1, 2)


def _sym(m):
    return 0.5 * (m + tf.linalg.matrix_transpose(m))


def _floor(c0):
    eps = 1e-7 if c0.dtype == tf.float32 else 1e-13
    return eps * c0.shape[-1] * tf.reduce_max(tf.abs(linalg.diag_part(c0)))


def option1_quantities(c0, c1, pinv=False):
    """(N = C0^{1/2} U, L = C0^{-1/2} U, psi) for a (damped) C0."""
    floor = _floor(c0) if pinv else None
    inv_sqrt = _sym(linalg.psd_power(c0, -0.5, floor))
    hpsi = _sym(tf.matmul(tf.matmul(inv_sqrt, _sym(c1)), inv_sqrt))
    psi, u = tf.linalg.eigh(hpsi)
    return (tf.matmul(_sym(linalg.psd_power(c0, 0.5)), u), tf.matmul(inv_sqrt, u), psi)


def option2_quantities(c0, c1):
    """(P = C1^T C0^{-1}, K = C0^{-1/2} E, mu) for a damped C0."""
    inv_sqrt = _sym(linalg.psd_power(c0, -0.5))
    inv_sqrt_c1 = tf.matmul(inv_sqrt, c1)
    hpsi = tf.matmul(inv_sqrt_c1, inv_sqrt)
    s, _, v = tf.linalg.svd(hpsi)
    mu = tf.minimum(tf.square(s), 1.0)
    p = tf.matmul(inv_sqrt_c1, inv_sqrt, transpose_a=True)
    return p, tf.matmul(inv_sqrt, v), mu


def inverse_gamma(x, steps):
    """sum_{|d|<T} (T-|d|) x^|d| in closed form (T^2 at x = 1)."""
    one_minus = 1.0 - x
    near = tf.abs(one_minus) < 1e-6
    safe = tf.where(near, tf.ones_like(x), one_minus)
    val = (steps * (1.0 - x * x) - 2.0 * x * (1.0 - tf.pow(x, steps))) / (safe * safe)
    return tf.where(near, steps * steps * tf.ones_like(x), val)


class FullyConnectedSeriesBlock(blocks_kron.FullyConnectedKroneckerBlock):
    """Series block, `option` 1 or 2 (module docstring)."""

    def __init__(self, var_shapes, attrs=None, *, option=2, **kwargs):
        if option not in OPTIONS:
            raise ValueError(f"FullyConnectedSeriesBlock: option must be 1 or 2, got {option!r}")
        budget = kwargs.pop("max_factor_size", None)
        super().__init__(var_shapes, attrs, lag_one=True, **kwargs)
        wide = [f.dim for f in (self.input_factor, self.output_factor)
                if budget is not None and f.dim > budget]
        if wide:
            raise ValueError(f"{self.name}: the series block needs full factors, and one of "
                             f"width {wide[0]} exceeds max_factor_size ({budget})")
        self.option = option
        n_in, n_out = self.input_factor.dim, self.output_factor.dim

        def var(shape, name):
            return tf.Variable(tf.zeros(shape, self.dtype), trainable=False, name=name)

        names = ("L", "psi") if option == 1 else ("P", "K", "mu")
        self.input_quants = [
            var([n_in] if k in ("psi", "mu") else [n_in, n_in], "input_" + k) for k in names
        ]
        self.output_quants = [
            var([n_out] if k in ("psi", "mu") else [n_out, n_out], "output_" + k) for k in names
        ]

    def update(self, data, decay=None):
        data = as_pairs(data)
        for a, _ in data:
            if len(a.shape) != 2:
                raise ValueError(
                    "FullyConnectedSeriesBlock.update: inputs must be [B, d_in] per time step"
                )
        super().update(data, decay)

    def _damped_c0(self, damping):
        return self._damped_factors(damping)

    def _init_inverses(self):
        """Only the damping of the last refresh: the quantities below hold the rest."""
        self.inverse_damping = tf.Variable(tf.constant(-1.0, self.dtype), trainable=False,
                                           name="inverse_damping")

    def inverse_variables(self):
        return tuple(self.input_quants) + tuple(self.output_quants) + (self.inverse_damping,)

    def inverse_updates(self, damping=None):
        a0, g0 = self._damped_c0(damping)
        a1 = self.input_factor.lag_one_value()
        g1 = self.output_factor.lag_one_value()
        pairs = []
        for quants, c0, c1 in ((self.input_quants, a0, a1), (self.output_quants, g0, g1)):
            if self.option == 1:
                values = option1_quantities(c0, c1)[1:]
            else:
                values = option2_quantities(c0, c1)
            pairs += list(zip(quants, values))
        return pairs + [(self.inverse_damping, self._normalised_damping(damping))]

    def multiply_inverse(self, vs, refreshed=False, damping=None):
        """From the quantities of the last ``update_inverses`` (no on-the-fly path)."""
        return self.multiply_matpower(vs, -1, damping)

    def multiply_matpower(self, vs, exp, damping=None):
        """``exp = -1`` reads the quantities of the last ``update_inverses``
        (made for the damping it was given); ``exp = 1`` (option 1) damps the
        current factors with ``damping``."""
        if exp == -1:
            return self._from_mat(self._inverse(self._to_mat(vs)))
        if exp == 1 and self.option == 1:
            return self._from_mat(self._forward(self._to_mat(vs), damping))
        self._unsupported(
            f"multiply_matpower(exp={exp})",
            f"option {self.option} supports "
            + ("exp = 1 or -1" if self.option == 1 else "exp = -1"),
        )

    def _forward(self, z, damping):
        a0, g0 = self._damped_c0(damping)
        n_a, _, psi_a = option1_quantities(a0, self.input_factor.lag_one_value())
        n_g, _, psi_g = option1_quantities(g0, self.output_factor.lag_one_value())
        z = tf.matmul(tf.matmul(n_a, z, transpose_a=True), n_g)
        z *= inverse_gamma(psi_a[:, None] * psi_g[None, :], self.replicas)
        return tf.matmul(tf.matmul(n_a, z), n_g, transpose_b=True)

    def _inverse(self, z):
        steps = self.replicas
        if self.option == 1:
            (l_a, psi_a), (l_g, psi_g) = self.input_quants, self.output_quants
            z = tf.matmul(tf.matmul(l_a, z, transpose_a=True), l_g)
            z /= inverse_gamma(psi_a[:, None] * psi_g[None, :], steps)
            return tf.matmul(tf.matmul(l_a, z), l_g, transpose_b=True)
        (p_a, k_a, mu_a), (p_g, k_g, mu_g) = self.input_quants, self.output_quants
        z = z - tf.matmul(tf.matmul(p_a, z), p_g, transpose_b=True)
        z = tf.matmul(tf.matmul(k_a, z, transpose_a=True), k_g)
        denom = 1.0 - mu_a[:, None] * mu_g[None, :]
        z /= tf.where(tf.equal(denom, 0.0), tf.ones_like(denom), denom)
        z = tf.matmul(tf.matmul(k_a, z), k_g, transpose_b=True)
        z = z - tf.matmul(tf.matmul(p_a, z, transpose_a=True), p_g)
        return z / steps

    def multiply_cholesky(self, vs, transpose=False, damping=None):
        self._unsupported("multiply_cholesky")

    def multiply_cholesky_inverse(self, vs, transpose=False, damping=None):
        self._unsupported("multiply_cholesky_inverse")

    def full_matrix(self):
        a0, g0 = self.input_factor.value(), self.output_factor.value()
        a1 = self.input_factor.lag_one_value()
        g1 = self.output_factor.lag_one_value()
        steps = self.replicas
        if self.option == 1:
            n_a, _, psi_a = option1_quantities(a0, a1, pinv=True)
            n_g, _, psi_g = option1_quantities(g0, g1, pinv=True)
            n = linalg.kron(n_a, n_g)
            w = tf.reshape(inverse_gamma(psi_a[:, None] * psi_g[None, :], steps), [-1])
            return tf.matmul(n * w[None, :], n, transpose_b=True)
        psi = linalg.kron(
            tf.matmul(a1, linalg.psd_power(a0, -1.0, _floor(a0))),
            tf.matmul(g1, linalg.psd_power(g0, -1.0, _floor(g0))),
        )
        c0 = linalg.kron(a0, g0)
        eye = tf.eye(c0.shape[0], dtype=c0.dtype)
        s = tf.linalg.solve(eye - psi, c0)
        return steps * (s + tf.transpose(s) - c0)
