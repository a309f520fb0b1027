"""The Fisher block contract, and blocks stored as a full or diagonal matrix.

A block approximates the Fisher of one layer's parameters

    F = (1/B) sum_i E_y[grad_i grad_i^T],  grad_i = d(-log p(y|z_i))/d theta,

over the layer's variables; vectors are lists of tensors shaped like those
variables, flattened (for `full_matrix`) row-major and concatenated in
variable order (kernel or scale first, then bias or shift).

Data (`update(data, decay=None)`), by `block.stats`:
  "activations": `data` is a list over uses of `(a, g)` pairs (one pair may
      be passed bare): `a` the layer input of that use, `g` the gradient of
      each example's own loss term with respect to that use's
      pre-activation output (not scaled by 1/B), either a tensor or a list
      over sources whose contributions add up: the Fisher-square-root
      columns in "exact" mode, or the S samples of "sampled" mode, each
      scaled by 1/sqrt(S) by the caller so that their sum is the mean.
  "per_example_gradients": `data` is a list over variables of per-example
      gradients `[B, *var.shape]`, or a list over sources of such lists.
`decay` defaults to the block's `ema_decay`; the averages are debiased.

Methods. Every method that damps takes `damping=l` (l >= 0, a float or a
scalar tensor), passed by the caller as a value; `None` means the block's
own `damping` (given at construction: a float, tensor, variable or
zero-argument callable, read on every call).
  multiply(vs, damping)        (F~) vs with F~ the damped block, built from the
                               current factors.
  multiply_inverse(vs, refreshed=False, damping)
                               F~^{-1} vs from the snapshot taken by the last
  multiply_matpower(vs, exp, damping)   update_inverses() (exp = 1 means multiply).
  multiply_cholesky(vs, transpose=False, damping)          L vs (L^T vs) and
  multiply_cholesky_inverse(vs, transpose=False, damping)  L^{-1} vs (L^{-T} vs),
                               with L L^T = F~ from the current factors.
  full_matrix()                the undamped block, dense `[n, n]`.
  update_inverses(damping)     refreshes the cached decompositions
  inverse_updates(damping)     ... as [(variable, value)], without storing them.
  inverses_stale(damping)      whether the caches were made for another damping
                               (Kronecker and full blocks cache damped inverses).
  inverse_variables()          the variables those caches live in (the rest of
                               the block's variables hold its statistics).
Unsupported methods raise NotImplementedError naming block and method.

Full and diagonal blocks damp as `F + l I`.
"""

import re

import numpy as np
import tensorflow as tf

from kfac_graph.fisher import linalg
from kfac_graph.fisher import shared_kernels


def shape_of(v):
    """A variable's (or a shape's) dimensions as a tuple of ints."""
    shape = v.shape if hasattr(v, "shape") else v
    return tuple(int(d) for d in shape)


class FisherBlock(tf.Module):
    """Base class: the contract of the module docstring."""

    stats = "activations"
    # the estimator's, shared by its blocks (``shared_kernels.py``); in place by default
    kernels = shared_kernels.IN_PLACE

    def __init__(
        self,
        var_shapes,
        attrs=None,
        *,
        num_uses=1,
        damping=1e-3,
        ema_decay=0.95,
        dtype=tf.float32,
        max_factor_size=None,
        factor_block_size=None,
        name=None,
    ):
        """var_shapes: the layer's variables (or their shapes), in layer order;
        attrs: the op's attributes (conv geometry), unused by most blocks;
        num_uses: `Layer.uses`, kept for reference (the replica count R and the
        series length T are read from the data at each update);
        max_factor_size: Kronecker blocks keep a factor wider than this as its
        diagonal (None: every factor full); other blocks ignore it;
        factor_block_size: Kronecker blocks keep a full, ungrouped factor wider
        than this (and within max_factor_size) as its diagonal blocks of at
        most this size (``factor_blocks.py``; None: none); other blocks ignore it;
        name: any string (characters other than [A-Za-z0-9_] become "_")."""
        name = re.sub(r"\W", "_", name or type(self).__name__)
        if not name[0].isalpha():
            name = "block_" + name
        super().__init__(name=name)
        self.var_shapes = tuple(shape_of(v) for v in var_shapes)
        self.num_params = int(sum(np.prod(s) for s in self.var_shapes))
        self.attrs = dict(attrs or {})
        self.num_uses = int(num_uses)
        self.ema_decay = ema_decay
        self.dtype = tf.as_dtype(dtype)
        self._damping_source = damping
        self.max_factor_size = None if max_factor_size is None else int(max_factor_size)
        self.factor_block_size = (None if factor_block_size is None
                                  else int(factor_block_size))

    # -- helpers -------------------------------------------------------------
    def damping(self, value=None):
        """``value`` (the damping a caller passed), else the block's own, as a
        scalar tensor of the block's dtype."""
        d = self._damping_source if value is None else value
        if callable(d) and not isinstance(d, tf.Variable):
            d = d()
        return linalg.cast(d, self.dtype)

    def _op_kernel_shape(self):
        """The convolution op's kernel shape (``attrs["kernel_shape"]``), else
        the kernel variable's: a 1-D convolution's variable lacks the unit
        axis of the 2-D op TensorFlow runs (``[k, ...]`` vs ``[1, k, ...]``)."""
        return tuple(self.attrs.get("kernel_shape") or self.var_shapes[0])

    def _decay(self, decay):
        return self.ema_decay if decay is None else decay

    def _unsupported(self, method, why="not available for this approximation"):
        raise NotImplementedError(f"{type(self).__name__}.{method}: {why}")

    def _flat(self, vs):
        return linalg.flatten([tf.cast(v, self.dtype) for v in vs])

    def _unflat(self, vec):
        return linalg.unflatten(vec, self.var_shapes)

    # -- the contract ----------------------------------------------------------
    def update(self, data, decay=None):
        self._unsupported("update")

    def inverse_updates(self, damping=None):
        """``[(variable, new value)]``: the refreshed cached decompositions,
        computed from the current factors but not stored (``update_inverses``
        stores them; a distributed step may compute them on one replica and
        share them)."""
        self._unsupported("update_inverses")

    def update_inverses(self, damping=None):
        for variable, value in self.inverse_updates(damping):
            variable.assign(value)

    def inverses_stale(self, damping=None):
        """Whether the cached inverses were made for another damping (a scalar
        bool tensor); False for blocks whose caches follow the damping."""
        return tf.constant(False)

    def multiply(self, vs, damping=None):
        return self.multiply_matpower(vs, 1, damping)

    def multiply_inverse(self, vs, refreshed=False, damping=None):
        """``refreshed=True``: the caller has refreshed any stale caches
        (``inverses_stale(damping)`` is False), so blocks may skip that check."""
        return self.multiply_matpower(vs, -1, damping)

    def multiply_matpower(self, vs, exp, damping=None):
        self._unsupported("multiply_matpower")

    def multiply_cholesky(self, vs, transpose=False, damping=None):
        self._unsupported("multiply_cholesky")

    def multiply_cholesky_inverse(self, vs, transpose=False, damping=None):
        self._unsupported("multiply_cholesky_inverse")

    def full_matrix(self):
        self._unsupported("full_matrix")

    def inverse_variables(self) -> tuple:
        """The variables holding cached inverses / decompositions (what
        ``update_inverses`` writes); every other variable of the block holds
        statistics. Blocks that cache nothing return ()."""
        return ()


class FullBlock(FisherBlock):
    """A block held as one dense `[n, n]` factor (`self.factor`), damped `+ l I`.

    Its cache is the damped inverse `(F + l I)^{-1}` of the last
    `update_inverses` and the `l` it was made for, as the Kronecker blocks
    keep theirs: a refresh costs a Cholesky factorisation and a solve
    (about `n^3` multiply-adds; `linalg.psd_damped_inverse`), and where the
    damping has changed since, `multiply_inverse` inverts the current factor
    instead (`inverses_stale`)."""

    factor = None  # set by subclasses: a CovarianceFactor of dim n

    def _init_cache(self):
        n = self.num_params
        self.inverse = tf.Variable(tf.zeros([n, n], self.dtype), trainable=False, name="inverse")
        self.inverse_damping = tf.Variable(tf.constant(-1.0, self.dtype), trainable=False,
                                           name="inverse_damping")

    def _current_inverse(self, damping):
        return self.kernels(("psd_damped_inverse",), linalg.psd_damped_inverse,
                            self.factor.value(), self.damping(damping))

    def inverse_updates(self, damping=None):
        lam = linalg.cast(self.damping(damping), self.dtype)
        return [(self.inverse, self._current_inverse(lam)), (self.inverse_damping, lam)]

    def inverse_variables(self):
        return (self.inverse, self.inverse_damping)

    def inverses_stale(self, damping=None):
        """Whether ``l`` differs from the cached inverse's (or none is cached)."""
        lam = linalg.cast(self.damping(damping), self.dtype)
        return linalg.damping_changed(lam, self.inverse_damping.read_value())

    def full_matrix(self):
        return self.factor.value()

    def _damped(self, damping):
        return linalg.add_damping(self.factor.value(), self.damping(damping), False)

    def multiply_inverse(self, vs, refreshed=False, damping=None):
        if refreshed:
            apply = lambda inverse, *vs: self._unflat(  # noqa: E731
                tf.matmul(inverse, self._flat(vs)[:, None])[:, 0])
            return self.kernels(("full_multiply_inverse", self.var_shapes, self.dtype), apply,
                                self.inverse, *vs)
        v = self._flat(vs)[:, None]
        out = tf.cond(self.inverses_stale(damping),
                      lambda: tf.matmul(self._current_inverse(damping), v),
                      lambda: tf.matmul(self.inverse, v))
        return self._unflat(out[:, 0])

    def multiply_matpower(self, vs, exp, damping=None):
        if exp == -1:
            return self.multiply_inverse(vs, damping=damping)
        v = self._flat(vs)[:, None]
        if exp == 1:
            out = tf.matmul(self._damped(damping), v)
        else:
            power = linalg.damped_power(self.factor.value(), self.damping(damping), False, exp)
            out = tf.matmul(power, v)
        return self._unflat(out[:, 0])

    def multiply_cholesky(self, vs, transpose=False, damping=None):
        chol = tf.linalg.cholesky(self._damped(damping))
        out = tf.matmul(chol, self._flat(vs)[:, None], transpose_a=transpose)
        return self._unflat(out[:, 0])

    def multiply_cholesky_inverse(self, vs, transpose=False, damping=None):
        chol = tf.linalg.cholesky(self._damped(damping))
        out = linalg.solve_tril_left(chol, self._flat(vs)[:, None], False, transpose)
        return self._unflat(out[:, 0])


class DiagonalBlock(FisherBlock):
    """A block held as a diagonal `[n]` factor (`self.factor`), damped `+ l`."""

    factor = None

    def _init_cache(self):
        self.cache = linalg.DiagonalCache(self.num_params, self.dtype, name="inverse_cache")

    def inverse_updates(self, damping=None):
        return self.cache.updates(self.factor.value())

    def inverse_variables(self):
        return tuple(self.cache.variables)

    def full_matrix(self):
        return tf.linalg.diag(self.factor.value())

    def _damped(self, damping):
        return self.factor.value() + self.damping(damping)

    def multiply_matpower(self, vs, exp, damping=None):
        if exp == 1:
            return self._unflat(self._damped(damping) * self._flat(vs))
        apply = lambda evals, d, *vs: self._unflat(  # noqa: E731
            linalg.DiagonalCache.power_left(evals, self._flat(vs)[:, None], d, exp)[:, 0])
        return self.kernels(("diagonal_matpower", self.var_shapes, self.dtype, exp), apply,
                            self.cache.evals, self.damping(damping), *vs)

    def multiply_cholesky(self, vs, transpose=False, damping=None):
        return self._unflat(tf.sqrt(self._damped(damping)) * self._flat(vs))

    def multiply_cholesky_inverse(self, vs, transpose=False, damping=None):
        return self._unflat(self._flat(vs) / tf.sqrt(self._damped(damping)))
