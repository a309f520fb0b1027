"""``kg.FisherEstimator``: one Fisher block per registered layer, updated
from one re-run of the registered graph.

With ``l_i = -log p(y_i | z_i)`` for the loss's predictive distribution at
the model output ``z`` (the loss's ``scale`` and reduction do not enter),

    F = (1/B) sum_i E_y [grad l_i grad l_i^T],

estimated from cotangents ``v`` at ``z``, one backward pass each, which give
every layer use's output gradient ``g = v^T dz/ds``:

- ``"empirical"``: ``v_i = dl_i/dz_i`` at the data's targets (for an
  ``"opaque"`` loss, with no ``z``: each example's own loss's gradient);
- ``"sampled"``: the same at ``S = num_samples`` targets drawn from
  ``p(y | z_i)`` (stateless seeds from ``seed`` and an update counter;
  XLA's kernels draw other samples than TensorFlow's for the same seed),
  each scaled by ``1/sqrt(S)`` so that the blocks' sums over sources are
  the means over samples (under ``tf.distribute`` the other replicas fold
  their index into the seed);
- ``"exact"``: the columns of the Fisher square root ``S_i`` (``F_i = S_i
  S_i^T``), summed. Exact for outputs ``[B, K]``; with more output axes
  (positions) one column index is shared by all positions, as in
  tensorflow/kfac, which leaves out no term but adds cross-position ones
  (exact for layers applied position by position up to the output, not
  for the full block of a layer whose per-example gradient sums positions);
  ``position_columns="separate"`` takes one column per position and
  class, ``T K`` backward passes, and is exact.

A loss that is no likelihood but has a model output (kind ``"ggn"``: Huber,
focal, Poisson, KL) takes the Hessian ``H_i`` of its per-example loss at
``z`` for ``F_i`` (the generalised Gauss-Newton matrix; ``ggn.py``): exact
mode its square root's columns, sampled mode ``S_i eps``
(``cotangents.py``).

A per-token loss with data weights (a padding mask, ``sample_weight``, a
masked mean) weighs each token's cotangent by ``sqrt(w_it)``
(``kfac_graph.token_weights``): ``F = (1/B) sum_i sum_t w_it J_it^T F_it
J_it``.

``max_factor_size`` (default 4096; None: no budget): a Kronecker factor
wider keeps only its diagonal (a language model's head over a 50k
vocabulary would otherwise keep a ``50k x 50k`` output factor);
``factor_block_size`` k: a full one wider keeps its diagonal blocks of <= k.
``summary()`` says which layers got which, ``memory()`` the bytes of
parameters, statistics and cached inverses per layer (``report.py``).

Generic layers get per-example gradients of the variable itself (a vectorised
Jacobian of the per-example ``l_i``, or ``v_i . z_i`` in exact mode). Block choice and
data layout: ``block_choice.py``. All blocks keep debiased moving averages with decay
``cov_ema_decay``, so after the first update a block equals that batch's estimate.

Every tensor a block reads is checked while tracing to have the batch first, and every
factor's rows the factor's width (``kfac_graph.invariants``): a form the rules do not
know is a one-line ``KfacGraphError``. ``update`` and ``update_inverses`` run eagerly
(each a cached ``tf.function``), inside the caller's ``tf.function``, and under XLA.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from kfac_graph import invariants, options
from kfac_graph.auto_register import RegisteredFunction, auto_register
from kfac_graph.fisher import cotangents, ema, report, shared_kernels
from kfac_graph.fisher.block_choice import (DEFAULT_MAX_FACTOR_SIZE, PER_EXAMPLE, block_stats,
                                            make_layer_block)
from kfac_graph.per_example import gradients as pe_gradients
from kfac_graph.per_example.rules import default_registry
from kfac_graph.taps import LayerTaps, layer_operands
from kfac_graph.layers.scalars import as_dtype
from passes.errors import KfacGraphError

MODES = ("sampled", "empirical", "exact")
POSITION_COLUMNS = ("shared", "separate")
# Called from a user's tf.function, AutoGraph would otherwise convert the
# registration pass (plain Python over networkx graphs) too.
_plain_python = tf.autograph.experimental.do_not_convert


class _Cache:
    """Plain holder for traced functions (kept out of tf.Module tracking)."""

    def __init__(self):
        self.update, self.inverses = {}, None


class FisherEstimator(tf.Module):
    """Fisher blocks for the layers of ``fn``'s registration.

    ``fn``: a ``kg.auto_register``ed loss function (a plain one is wrapped).
    ``approximations``: ``{kind or layer name: factory or alias}``, see
    ``kfac_graph.fisher.block_choice``. ``max_factor_size``: the widest
    Kronecker factor kept as a full matrix (wider ones keep their diagonal,
    None: no budget; ``factor_block_size``: see ``block_choice``).
    ``damping``: the blocks' own damping (a float, variable or zero-argument
    callable, read at every multiply) for calls that pass none; every product,
    refresh and staleness check also takes ``damping=`` as a value, which
    wins. Bad options are one-line ``ValueError``s (``OPTIONS``: what each
    takes; ``kfac_graph/options.py``).
    """

    DEFAULT_MAX_FACTOR_SIZE = DEFAULT_MAX_FACTOR_SIZE
    OPTIONS = {"estimation_mode": options.OneOf(MODES), "num_samples": options.Integer(1),
               "damping": options.Real(0.0, dynamic=True),
               "cov_ema_decay": options.Real(0.0, 1.0, high_open=True, dynamic=True),
               "seed": options.Integer(),
               "max_factor_size": options.Integer(1, none=True),
               "factor_block_size": options.Integer(1, none=True),
               "position_columns": options.OneOf(POSITION_COLUMNS)}

    def __init__(self, fn, estimation_mode: str = "sampled", num_samples: int = 1,
                 damping=1e-3, cov_ema_decay: float = 0.95, approximations=None,
                 seed: int = 0, max_factor_size: int | None = DEFAULT_MAX_FACTOR_SIZE,
                 name: str | None = None, position_columns: str = "shared",
                 factor_block_size: int | None = None):
        given = options.check_all("kg.FisherEstimator", self.OPTIONS, dict(
            estimation_mode=estimation_mode, num_samples=num_samples, damping=damping,
            cov_ema_decay=cov_ema_decay, seed=seed, max_factor_size=max_factor_size,
            position_columns=position_columns, factor_block_size=factor_block_size))
        self.position_columns = position_columns
        super().__init__(name=name or "fisher_estimator")
        self.fn = fn if isinstance(fn, RegisteredFunction) else auto_register(fn)
        self.estimation_mode, self.num_samples = estimation_mode, int(num_samples)
        self._damping, self.cov_ema_decay = damping, cov_ema_decay
        self.approximations, self.seed = dict(approximations or {}), int(seed)
        self.max_factor_size, self.factor_block_size = (given["max_factor_size"],
                                                        given["factor_block_size"])
        self._registration = self._blocks = self._counter = None
        self._cache = _Cache()

    # -- structure ------------------------------------------------------------------
    @property
    def registration(self):
        if self._registration is None:
            raise ValueError("the estimator is not built yet: call build(*args) or update(*args)")
        return self._registration

    @property
    def blocks(self) -> tuple:
        """One block per layer, aligned with ``registration.layers``."""
        self.registration  # noqa: B018  (raises when not built)
        return tuple(self._blocks)

    @property
    def damping(self):
        """As given: the blocks read it at every multiply (pass a variable
        or a callable to change it later)."""
        return self._damping

    @property
    def layers(self) -> tuple:
        return self.registration.layers

    @_plain_python
    def build(self, *args):
        """Registers ``fn`` for ``args`` and creates the blocks (once)."""
        reg = self.fn.registration(*args)
        if self._registration is not None:
            _check_same_layers(self._registration, reg)
            return reg
        self._registration = reg
        with tf.init_scope():
            self._counter = ema.replica_local(tf.zeros([], tf.int64), name="update_counter")
        self.use_factor_block_size(self.factor_block_size)
        return reg

    def use_factor_block_size(self, size):
        """Makes the blocks anew with ``factor_block_size = size`` (after
        ``build``, before the first update: the statistics start empty)."""
        self.factor_block_size = size
        with tf.init_scope():
            self._blocks = [make_layer_block(
                layer, self.approximations, max_factor_size=self.max_factor_size,
                factor_block_size=size, damping=self._damping, ema_decay=self.cov_ema_decay,
                dtype=tf.as_dtype(layer.variables[0].dtype), name=f"block_{i}_{layer.name}")
                for i, layer in enumerate(self.registration.layers)]
        shared_kernels.share(self._blocks, shared_kernels.SharedKernels())  # new blocks' own

    def memory(self) -> dict:
        """Per layer (aligned with ``layers``) and in total: the bytes of its
        parameters (``parameters``), its block's statistics (``factors_bytes``)
        and cached inverses (``inverses_bytes``), with the block, how it treats
        positions and each factor's width and layout (``report.memory_report``)."""
        return report.memory_report(self.layers, self.blocks)

    def summary(self) -> str:
        """A table: per layer its block, factors (full, diagonal, or diagonal
        for the size budget) and memory, then the totals."""
        return report.format_report(self.memory(), self.max_factor_size,
                                    self.factor_block_size)

    # -- updates ------------------------------------------------------------------
    @_plain_python
    def update(self, *args):
        """Folds one batch's statistics into every block; returns the loss."""
        reg = self.build(*args)
        run = self._cache.update.get(id(reg))
        if run is None:
            run = tf.function(lambda *a: self._update(reg, a).loss, autograph=False)
            self._cache.update[id(reg)] = run
        return run(*args)

    @_plain_python
    def update_inverses(self, damping=None):
        """Refreshes every block's cached inverses / decompositions (for
        ``damping``, default the blocks' own)."""
        if self._cache.inverses is None:
            self._cache.inverses = tf.function(self.refresh_inverses, autograph=False)
        if damping is None:
            return self._cache.inverses()
        return self._cache.inverses(as_dtype(damping, tf.float64))

    def refresh_inverses(self, damping=None, mask=None):
        """``update_inverses`` inside a ``tf.function`` of the caller's (the
        optimizer's step, an exported function). ``mask``: a scalar bool
        tensor per block; only the blocks whose entry is True refresh, one
        branch per distinct mask tensor (the blocks of one slot share it)."""
        if mask is None:
            _refreshed(self.blocks, damping)
            return
        for due, members in mask_groups(mask, self.blocks):
            tf.cond(due, lambda members=members: _refreshed(members, damping),
                    lambda: tf.constant(False))

    def inverse_variables(self) -> list:
        """Every block's cached inverses (what ``refresh_inverses`` writes), each once."""
        return list({v.ref(): v for b in self.blocks for v in b.inverse_variables()}.values())

    def inverses_stale(self, damping=None):
        """Whether any block's cached inverses were made for another damping
        than ``damping`` (then ``multiply_inverse`` inverts those blocks on
        the fly)."""
        return tf.reduce_any(tf.stack([block.inverses_stale(damping) for block in self.blocks]))

    # -- products over all layers ------------------------------------------------------
    @_plain_python
    def multiply(self, vectors, damping=None):
        """The damped blocks times ``vectors`` (aligned with ``registration.variables``)."""
        return self._per_block(vectors, lambda b, vs: b.multiply(vs, damping))

    @_plain_python
    def multiply_inverse(self, vectors, refreshed=False, damping=None):
        """The damped blocks' inverses (from the last ``update_inverses``) times
        ``vectors``. ``refreshed=True``: no block's inverses are stale (the
        caller refreshed them after any damping change), so the cached ones
        are used without checking; the check's fallback reads the factors,
        which an XLA-compiled caller under ``tf.distribute`` cannot reach."""
        return self._per_block(vectors, lambda b, vs: b.multiply_inverse(vs, refreshed, damping))

    def _per_block(self, vectors, op):
        ends = np.cumsum([0] + [len(layer.variables) for layer in self.layers])
        return [v for block, k, n in zip(self.blocks, ends, ends[1:])
                for v in op(block, list(vectors)[k:n])]

    def accumulate(self, *args, decay=None):
        """Inside a ``tf.function``: add this batch's statistics to the blocks (with
        ``decay``, default ``cov_ema_decay``) and return the loss (the same forward
        pass), for callers that build their own step (the optimizer)."""
        return self.accumulate_taps(*args, decay=decay).loss

    def accumulate_taps(self, *args, decay=None):
        """``accumulate``, returning the forward pass's ``LayerTaps`` (the loss,
        the model output), from which a caller may take more derivatives."""
        return self._update(self.build(*args), args, decay)

    # -- the traced update -------------------------------------------------------------
    def _update(self, reg, args, decay=None):
        taps = LayerTaps.build(reg, args, read_variables=reg.generic_variables)
        if taps.model_output is None and (self.estimation_mode, reg.loss.kind) != (
                "empirical", "opaque"):
            raise KfacGraphError(reg.loss.no_fisher)
        cotangents, per_example_terms = self._cotangents(reg, taps)
        operands = layer_operands(reg, taps, [taps.output_gradients(v) for v in cotangents])
        jacobians = pe_gradients.generic_jacobians(reg, taps, tf.stack(per_example_terms))
        rules = default_registry()
        batch = taps.batch_size
        for layer, block, uses in zip(reg.layers, self._blocks, operands):
            if uses is None:
                if block_stats(block) != PER_EXAMPLE:
                    raise ValueError(f"generic layer {layer.name!r} needs a block fed "
                                     "per-example gradients (NaiveDiagonalBlock, NaiveFullBlock)")
                data = [[_generic_gradient(jacobians[v.ref()][s], v, batch, layer)
                         for v in layer.variables] for s in range(len(cotangents))]
            else:
                uses = _batch_first_operands(layer, uses, batch)
                if block_stats(block) == PER_EXAMPLE:
                    data = [pe_gradients.layer_gradients(
                                rules, layer, [(a, gs[s]) for a, gs in uses], batch)
                            for s in range(len(cotangents))]
                else:
                    data = uses
            try:
                block.update(data, decay)
            except invariants.FactorShapeError as e:
                raise KfacGraphError(f"{invariants.where(layer)}: {e}; "
                                     f"{invariants.UNSUPPORTED}") from None
        self._counter.assign_add(1)
        return taps

    def _cotangents(self, reg, taps):
        """``cotangents.at_output`` for this estimator's mode; the sampled
        mode's seeds come from ``seed`` and the update counter."""
        seeds = ()
        if self.estimation_mode == "sampled":
            # int32 seeds: XLA has no StatelessMultinomial kernel for int64 ones.
            first = tf.cast(self._counter.read_value() * self.num_samples, tf.int32)
            seeds = [_per_replica(tf.stack([tf.constant(self.seed, tf.int32), first + s]))
                     for s in range(self.num_samples)]
        return cotangents.at_output(reg, taps, self.estimation_mode, seeds,
                                    self.position_columns)


def mask_groups(mask, items) -> list:
    """``[(mask tensor, [items it selects])]``, grouping the items whose mask
    entries are the same tensor, in first-seen order."""
    groups = {}
    for due, item in zip(mask, items):
        groups.setdefault(due.ref(), (due, []))[1].append(item)
    return list(groups.values())


def _refreshed(blocks, damping):
    for block in blocks:
        block.update_inverses(damping)
    return tf.constant(True)


def _batch_first_operands(layer, uses, batch):
    """A layer's operands ``[(a, [g, ...])]``, each tensor checked to have the
    batch B as its leading axis (a conv on a space-to-batch view has
    ``block * B``, an embedding read by positions alone has none): statistics
    of such rows would weigh examples wrongly."""
    out = []
    for use, (a, gs) in enumerate(uses):
        context = invariants.where(layer, use)
        a = tf.nest.map_structure(
            lambda t: invariants.batch_leading(t, batch, context, "layer input")
            if tf.convert_to_tensor(t).shape.rank else t, a)
        gs = [invariants.batch_leading(g, batch, context, "output gradient") for g in gs]
        out.append((a, gs))
    return out


def _generic_gradient(jacobian, variable, batch, layer):
    return invariants.to_variable_shape(jacobian, variable, batch,
                                        pe_gradients.generic_context(variable, layer))


def _per_replica(seed):
    """``seed`` on the first replica (and outside ``tf.distribute``); folded
    with the replica's index on the others, so replicas draw independently."""
    context = tf.distribute.get_replica_context()
    replica = 0 if context is None else context.replica_id_in_sync_group
    if isinstance(replica, int) and replica == 0:
        return seed
    replica = tf.cast(replica, tf.int32)
    return tf.where(tf.equal(replica, 0), seed,
                    tf.random.experimental.stateless_fold_in(seed, replica))


def _check_same_layers(old, new):
    key = lambda reg: [(la.kind, tuple(map(id, la.variables))) for la in reg.layers]  # noqa
    if key(old) != key(new):
        raise ValueError("these arguments register different layers than those the estimator "
                         "was built for; make a new FisherEstimator for them")
