"""A Kronecker block for a tied input/output embedding (kind
``"tied_embedding"``): one table ``E [V, D]`` gathered by token ids
("lookup" uses) and applied transposed as the LM head, ``logits = h E^T``
("projection" uses).

With ``E`` in its row-major layout (``vec(E)[v D + d] = E[v, d]``):

- lookups (as ``EmbeddingKroneckerBlock``): ``F_L ~= R_L diag(p) (x) G_L``,
  ``p [V]`` the id frequencies among all lookups, ``G_L [D, D]`` the
  covariance of the lookups' output gradients ``g``, ``R_L`` the lookups per
  example (positions times uses);
- projections: a dense use with its kernel stored ``[d_out, d_in] = [V, D]``,
  whose K-FAC block (``FullyConnectedKroneckerBlock`` on ``E^T``) is
  ``R_P H (x) Q``; in ``E``'s layout ``F_P ~= R_P Q (x) H``, ``Q [V, V]`` the
  covariance of the logits' gradients ``q``, ``H [D, D]`` that of ``h``,
  ``R_P`` the projected positions per example;

    F ~= F_L + F_P.

The cross terms between lookup and projection gradients are dropped (the
"independent uses" approximation, as for a dense layer applied several
times). Exact for one example with one lookup and one projection position,
up to those cross terms. Factors are debiased moving averages
(``factors_kron``: ``EmbeddingInputFactor``, ``OutputFactor``,
``DenseInputFactor``), ``R_L`` and ``R_P`` the latest batch's (expand).

Wide factors: ``Q`` wider than ``max_factor_size`` keeps its diagonal
(``factor.wide``), so for a large vocabulary the V side is diagonal in both
terms and the block keeps ``O(V + D^2)`` numbers (``G_L``, ``H`` wider than
the budget keep their diagonals too).

Damping ``l``: folded into the lookup term as ``KroneckerBlock`` pi-splits it,
``l' = l / R_L``, ``pi = sqrt((tr diag(p) / V) / (tr G_L / D))``,

    F~ = M1 + R_P Q (x) H,   M1 = R_L (diag(p) + pi sqrt(l') I) (x) (G_L + sqrt(l')/pi I),

and ``F~^{-1}`` is the exact inverse of that sum of two Kronecker products,
by simultaneous diagonalisation (``kron_sum.py``): ``A1 = R_L (diag(p) + pi
sqrt(l'))`` (diagonal), ``B1 = G_L + sqrt(l')/pi I``, ``A2 = R_P Q``,
``B2 = H``. ``multiply`` applies ``F~``, ``multiply_inverse`` its inverse
(cached by ``update_inverses``: ``K_a, s_a, K_b, s_b`` and the ``l'`` they
were made for; stale when ``l'`` changed, then recomputed on the fly),
``multiply_cholesky`` an ``L`` (not triangular) with ``L L^T = F~``.
``multiply_matpower`` for powers other than +-1 raises NotImplementedError:
the basis is not orthogonal. ``full_matrix()`` is the undamped
``R_L diag(p) (x) G_L + R_P Q (x) H``, dense ``[V D, V D]``.

Roles: the block's ``attrs["tied_roles"]`` (``block_choice.block_attrs``)
holds each use's role in use order, the order of the ``(a, g)`` pairs it is
fed: ``(ids, g)`` for a lookup, ``(h, q)`` for a projection. A layer
without both roles is a one-line ``KfacGraphError`` naming it.
"""

import tensorflow as tf

from kfac_graph.fisher import blocks_base, ema, factors_kron, kron_sum, linalg
from kfac_graph.layers.uses import as_pairs
from passes.errors import KfacGraphError

LOOKUP, PROJECTION = "lookup", "projection"
ROLES = "tied_roles"


class TiedEmbeddingKroneckerBlock(blocks_base.FisherBlock):
    """``F ~= R_L diag(p) (x) G_L + R_P Q (x) H`` for a tied table ``[V, D]``
    (module docstring); ``attrs["tied_roles"]``: every use's role."""

    positions = "expand"

    def __init__(self, var_shapes, attrs=None, **kwargs):
        layer = kwargs.get("name") or "tied embedding"
        super().__init__(var_shapes, attrs, **kwargs)
        self.roles = tuple(self.attrs.get(ROLES) or ())
        missing = [r for r in (LOOKUP, PROJECTION) if r not in self.roles]
        if missing or len(self.var_shapes) != 1 or len(self.var_shapes[0]) != 2:
            raise KfacGraphError(
                f"{layer}: TiedEmbeddingKroneckerBlock needs one table [V, D] with lookup and "
                f"projection uses, got variables {list(self.var_shapes)} and use roles "
                f"{list(self.roles)}; use the 'diagonal' or 'full' block for it")
        self.vocab, self.width = self.var_shapes[0]
        options = dict(dtype=self.dtype, max_dim=self.max_factor_size)
        self.lookup_ids = factors_kron.EmbeddingInputFactor(self.vocab, name="lookup_ids",
                                                            **options)
        self.lookup_grads = factors_kron.OutputFactor(self.width, name="lookup_grads", **options)
        self.projection_inputs = factors_kron.DenseInputFactor(
            self.width, False, name="projection_inputs", **options)
        self.projection_grads = factors_kron.OutputFactor(self.vocab, name="projection_grads",
                                                          **options)
        self.lookup_replicas = ema.replica_local(tf.ones([], self.dtype), name="lookup_replicas")
        self.projection_replicas = ema.replica_local(tf.ones([], self.dtype),
                                                     name="projection_replicas")
        self._init_inverses()

    # -- layout -------------------------------------------------------------------
    @property
    def _a_diagonal(self):
        """Whether the V side is diagonal in both terms (Q kept as its diagonal)."""
        return self.projection_grads.diagonal

    @property
    def _b_diagonal(self):
        """Whether the D side is: G_L and H wider than the budget (both are D wide)."""
        return self.lookup_grads.diagonal

    def named_factors(self):
        """``[(label, factor)]`` for the memory report."""
        return [("lookup ids", self.lookup_ids), ("lookup grads", self.lookup_grads),
                ("projection inputs", self.projection_inputs),
                ("projection grads", self.projection_grads)]

    def kronecker_terms(self):
        """``[(V-side factor, D-side factor)]`` of the two terms (the step's
        cost count, ``optimizer/costs.py``)."""
        return [(self.lookup_ids, self.lookup_grads),
                (self.projection_grads, self.projection_inputs)]

    def _init_inverses(self):
        """Cached basis: the identity, made for damping -1 (stale until refreshed)."""
        def cache(dim, diagonal, name):
            value = tf.ones([dim], self.dtype) if diagonal else tf.eye(dim, dtype=self.dtype)
            return tf.Variable(value, trainable=False, name=name)

        self.cached_ka = cache(self.vocab, self._a_diagonal, "cached_ka")
        self.cached_sa = tf.Variable(tf.zeros([self.vocab], self.dtype), trainable=False,
                                     name="cached_sa")
        self.cached_kb = cache(self.width, self._b_diagonal, "cached_kb")
        self.cached_sb = tf.Variable(tf.zeros([self.width], self.dtype), trainable=False,
                                     name="cached_sb")
        self.inverse_damping = tf.Variable(tf.constant(-1.0, self.dtype), trainable=False,
                                           name="inverse_damping")

    # -- statistics -----------------------------------------------------------------
    def _split(self, data):
        uses = as_pairs(data)
        if len(uses) != len(self.roles):
            raise ValueError(f"{self.name}: {len(uses)} uses given for the {len(self.roles)} "
                             f"roles {list(self.roles)}")
        pick = lambda role: [u for u, r in zip(uses, self.roles) if r == role]  # noqa: E731
        return pick(LOOKUP), pick(PROJECTION)

    def _per_example(self, tensors, width):
        """Rows per example over all uses: ``sum_u size(t_u) / (B width)``."""
        counts = [tf.size(t) // (tf.shape(t)[0] * width) for t in tensors]
        return tf.cast(tf.add_n(counts), self.dtype)

    def update(self, data, decay=None):
        lookups, projections = self._split(data)
        decay = self._decay(decay)
        first = lambda g: g[0] if isinstance(g, (list, tuple)) else g  # noqa: E731
        self.lookup_ids.update([ids for ids, _ in lookups], decay)
        self.lookup_grads.update([g for _, g in lookups], decay)
        self.projection_inputs.update([h for h, _ in projections], decay)
        self.projection_grads.update([q for _, q in projections], decay)
        self.lookup_replicas.assign(self._per_example([first(g) for _, g in lookups],
                                                      self.width))
        self.projection_replicas.assign(self._per_example([first(q) for _, q in projections],
                                                          self.vocab))

    # -- the damped block's pieces ------------------------------------------------------
    def _normalised_damping(self, damping):
        return self.damping(damping) / self.lookup_replicas

    def _terms(self, damping):
        """``(a1 [V], (B1 eigenpairs), B1, A2, B2)`` of the module docstring
        from the current factors."""
        p = tf.maximum(self.lookup_ids.value(), 0.0)
        gl, diag_b = self.lookup_grads.value(), self._b_diagonal
        da, db = linalg.pi_split_damping(self._normalised_damping(damping), tf.reduce_sum(p),
                                         self.vocab, linalg.trace(gl, diag_b), self.width)
        a1 = self.lookup_replicas * (p + da)
        if diag_b:
            b1_evals, b1_evecs = tf.maximum(gl, 0.0) + db, None
        else:
            evals, b1_evecs = linalg.psd_eig(gl)
            b1_evals = evals + db
        b1 = linalg.add_damping(gl, db, diag_b)
        a2 = self.projection_replicas * self.projection_grads.value()
        return a1, (b1_evals, b1_evecs), b1, a2, self.projection_inputs.value()

    def _current_basis(self, damping):
        a1, (evals, evecs), _, a2, b2 = self._terms(damping)
        return kron_sum.decompose(a1, a2, evals, evecs, b2, self._a_diagonal, self._b_diagonal)

    def _cached_basis(self):
        return kron_sum.Basis(self.cached_ka.read_value(), self.cached_sa.read_value(),
                              self.cached_kb.read_value(), self.cached_sb.read_value())

    # -- caches -----------------------------------------------------------------------
    def inverse_variables(self):
        return (self.cached_ka, self.cached_sa, self.cached_kb, self.cached_sb,
                self.inverse_damping)

    def inverse_updates(self, damping=None):
        basis = self._current_basis(damping)
        return list(zip(self.inverse_variables(),
                        (*basis, self._normalised_damping(damping))))

    def inverses_stale(self, damping=None):
        """Whether ``l' = l / R_L`` differs from the cached basis's (or none is cached)."""
        return linalg.damping_changed(self._normalised_damping(damping),
                                      self.inverse_damping.read_value())

    # -- products -----------------------------------------------------------------------
    def _to_mat(self, vs):
        return tf.reshape(tf.cast(vs[0], self.dtype), [self.vocab, self.width])

    def _from_mat(self, mat):
        return [tf.reshape(mat, self.var_shapes[0])]

    def multiply_matpower(self, vs, exp, damping=None):
        x = self._to_mat(vs)
        if exp == 1:
            a1, _, b1, a2, b2 = self._terms(damping)
            diag_a, diag_b = self._a_diagonal, self._b_diagonal
            lookup = a1[:, None] * linalg.mul_right(x, b1, diag_b)
            projection = linalg.mul_right(linalg.mul_left(a2, x, diag_a), b2, diag_b)
            return self._from_mat(lookup + projection)
        if exp == -1:
            return self.multiply_inverse(vs, False, damping)
        self._unsupported("multiply_matpower", f"power {exp}: the basis that inverts the sum "
                          "of two Kronecker products is not orthogonal (only +-1)")

    def multiply_inverse(self, vs, refreshed=False, damping=None):
        if refreshed:
            basis = self._cached_basis()
        else:
            basis = kron_sum.Basis(*tf.cond(self.inverses_stale(damping),
                                            lambda: tuple(self._current_basis(damping)),
                                            lambda: tuple(self._cached_basis())))
        out = kron_sum.apply_inverse(basis, self._to_mat(vs), self._a_diagonal,
                                     self._b_diagonal)
        return self._from_mat(out)

    def multiply_cholesky(self, vs, transpose=False, damping=None):
        """``L v`` (``L^T v``) with ``L L^T = F~`` (``kron_sum.apply_root``)."""
        a1, (evals, evecs), b1, a2, b2 = self._terms(damping)
        basis = kron_sum.decompose(a1, a2, evals, evecs, b2, self._a_diagonal, self._b_diagonal)
        return self._from_mat(kron_sum.apply_root(basis, a1, b1, self._to_mat(vs),
                                                  self._a_diagonal, self._b_diagonal, transpose))

    def multiply_cholesky_inverse(self, vs, transpose=False, damping=None):
        """``L^{-1} v`` (``L^{-T} v``) for the ``L`` of ``multiply_cholesky``."""
        return self._from_mat(kron_sum.apply_root_inverse(
            self._current_basis(damping), self._to_mat(vs), self._a_diagonal, self._b_diagonal,
            transpose))

    def full_matrix(self):
        dense = lambda f: tf.linalg.diag(f.value()) if f.diagonal else f.value()  # noqa: E731
        lookup = self.lookup_replicas * linalg.kron(dense(self.lookup_ids),
                                                    dense(self.lookup_grads))
        projection = self.projection_replicas * linalg.kron(dense(self.projection_grads),
                                                            dense(self.projection_inputs))
        return lookup + projection
