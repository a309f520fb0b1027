"""``kg.KFAC``: the K-FAC optimizer, one compiled step per call.

Each ``step(*args)`` runs one ``tf.function`` that, on the step counter
``t`` (only steps that were applied count) and ``k = t - num_burnin_steps``
(``schedule.py``):

1. runs the loss forward and backward once; on covariance steps (every
   step of the burn-in, then ``k % cov_update_period == 0``) the same
   re-run of the registered graph also folds the batch's statistics into
   the estimator's factors (``cov_ema_decay``); with ``spread_covariances``
   each step folds in a slice's instead (``covariance_slices.py``);
2. on inverse steps (``k % inverse_update_period == 0``, never in the
   burn-in), and after the damping has changed (the blocks cache damped
   inverses), refreshes the estimator's cached inverses, after (1);
3. outside the burn-in, preconditions the gradient ``g`` (plus
   ``l2_reg * theta``) with the damped blocks' inverses (an inner
   ``tf.function``, XLA-compiled unless ``jit_compile="auto"`` on the
   CPU), forms the update by the momentum
   rule (``update_rules.py``) and applies it:

   - ``"regular"``: ``v <- mu v + F~^{-1} g``, ``delta = -lr v``;
   - ``"adam"``: ``v <- mu v + g``, ``delta = -lr F~^{-1} v``;
   - ``"qmodel"``: ``delta = alpha F~^{-1} g + mu delta_prev`` with
     ``(alpha, mu)`` minimising the quadratic model (``qmodel.py``); its
     curvature is, by ``qmodel_curvature``, the exact Fisher of the batch
     (``"exact"``, the default, as Martens & Grosse 2015 §7: Fisher-vector
     products by a double backward pass, ``exact_fisher.py``, through the
     step's own forward pass when every step updates the covariances and
     there is no burn-in, else through a second one) plus
     ``(lambda + l2_reg) I``, or the estimator's damped K-FAC matrix ``F~``
     (``"kfac"``); with ``qmodel_batch_fraction = f < 1`` the exact forms
     are the batch's first ``ceil(f B)`` examples' (unbiased over a shuffled
     batch; about ``f`` of the cost), and so are the model's linear terms and
     objective (``exact_fisher.Part``); where the model without ``lambda I`` promises a fall
     below zero, the update is shortened to where it promises the whole
     objective (``qmodel.cap``), and a ``learning_rate`` schedule scales it;
     ``learning_rate`` and ``momentum`` record ``-alpha`` and ``mu`` taken.

   ``F~`` is damped by ``lambda + l2_reg`` in the blocks' convention
   (``pi``-split Tikhonov damping of each Kronecker factor). With
   ``norm_constraint = C`` ("regular", "adam") the preconditioned vector
   ``p`` (for ``v``/``g`` the vector it preconditions) is scaled by
   ``min(1, sqrt(C / (lr^2 p.g)))`` so that ``lr^2 p.g <= C``
   (tensorflow/kfac's ``_clip_updates``, Ba et al. 2017 §5);
4. with ``adapt_damping``, at ``(k + 1) % damping_adaptation_interval ==
   0`` re-evaluates the loss at the new parameters on the same batch and
   adapts ``lambda`` by the Levenberg-Marquardt rule (``damping.py``). The
   model change ``M(delta)`` uses the quadratic model's own curvature for
   ``"qmodel"`` (less ``lambda I``), and otherwise the K-FAC blocks damped
   by ``l2_reg`` alone (``c F~_0 delta``, not tensorflow/kfac's
   ``F~_lambda - lambda I``, which keeps the Kronecker cross terms).

The step itself is a step core's (``step_core.py``: the logic above, on the
seams that ``single_device.py`` and, under ``tf.distribute``,
``distributed.py`` provide); ``KFAC`` holds the options, the state and the
compiled functions, and reads and writes nothing else.

The curvature is that of the loss as written: ``c F`` with ``c`` the
loss's ``scale`` times ``B`` for a sum over the batch (1 for a mean), so
the damping is in the loss's units: the blocks see ``(lambda + l2_reg) /
c`` (``blocks_damping``), passed as a value on every call that multiplies,
inverts, refreshes or checks the staleness of the blocks.

``l2_reg``: the optimizer minimises ``L + l2_reg/2 |theta|^2`` (do not
add the penalty to the loss yourself): ``l2_reg theta`` joins the
gradient and ``l2_reg`` the damping; the loss returned is ``L`` alone.

A non-finite loss, gradient, factor, inverse or update leaves every variable (parameters,
factors, inverses, velocities, damping, counter) as it was, adds one to ``skipped_steps``
and logs a warning; ``"qmodel"`` steps the cap mostly shortened log one (``cap_watch.py``).

``jit_compile``: ``True`` compiles the whole step with XLA; ``"auto"`` on
accelerators only (on the CPU XLA's convolutions, Cholesky factorisations
and matmuls trail oneDNN's, ``benchmarks/step_overhead.py``). The
preconditioning is compiled with ``True`` and ``False``; ``"auto"`` on the
CPU runs it with TensorFlow's kernels too (its XLA compile was most of a
first step, ``benchmarks/cold_start.py``). Summaries and the skip warning
run outside XLA.

Under ``tf.distribute`` (the strategy in scope when the optimizer is made)
the same ``step`` runs in phases, with the single-device step's result on
the whole batch (``distributed.py``, ``sync_statistics`` there).
"""
from __future__ import annotations

import tensorflow as tf

from kfac_graph import graph_options, relaxed_shapes
from kfac_graph.auto_register import RegisteredFunction, auto_register
from kfac_graph.fisher.estimator import FisherEstimator
from kfac_graph.optimizer import costs as costs_lib, damping as damping_lib, distributed
from kfac_graph.optimizer import cap_watch, kfac_options, plan, qmodel_fallback, summaries
from kfac_graph.optimizer.schedule import StepSchedule
from kfac_graph.optimizer.single_device import SingleDeviceCore
from kfac_graph.layers.scalars import as_dtype

DEFAULT_COV_UPDATE_PERIOD = 1
DEFAULT_INVERSE_UPDATE_PERIOD = 10
_plain_python = tf.autograph.experimental.do_not_convert


class _Compiled:
    """Plain holder for the traced functions (kept out of checkpoints)."""

    def __init__(self):
        self.step = self.core = self.precondition = None  # set by build()


class KFAC(tf.Module):
    """K-FAC for a ``kg.auto_register``ed loss ``fn`` (a plain one is wrapped).

    Defaults follow Martens & Grosse 2015: the quadratic model picks the
    step size and momentum, and the damping (from 0.1) adapts by the
    Levenberg-Marquardt rule (how they compare with Adam: the README and
    ``benchmarks/convergence.py``). ``qmodel_fallback``: where the model's cap
    shortens most steps (a batch too small against the model, ``cap_watch.py``), hand
    the step over to ``"regular"`` momentum (``qmodel_fallback.py``; False: warn only).
    ``learning_rate``, ``momentum``: used by ``"regular"`` and ``"adam"``
    (``"qmodel"`` chooses both); a schedule (a callable of the step from 0, as
    ``keras.optimizers.schedules``') is read every step and recorded, and with
    ``"qmodel"`` scales the step the model picks (an annealing). ``damping``:
    the initial ``lambda`` (adapted when ``adapt_damping``, never below
    ``min_damping``: by default ``RELATIVE_MIN_DAMPING`` (1e-4) times the
    initial value, see ``damping.py``). Estimator options (``estimation_mode``,
    ``num_samples``, ``cov_ema_decay``, ``approximations``, ``seed``,
    ``max_factor_size``, ``factor_block_size``) go to ``kg.FisherEstimator``; so
    do ``summary()``, ``memory()``. ``cov_update_period``, ``inverse_update_period``:
    default 1 and 10, or with ``overhead_budget = b`` those that keep the counted
    amortised step within ``b`` SGD steps (``plan.py``; a period given is kept; see
    ``cost_summary()``), and where periods alone do not, a ``factor_block_size``
    and (``"qmodel"``, no ``qmodel_batch_fraction`` given: None is 1) a fraction.
    ``stagger_inverses``: each block refreshes in its own slot of the inverse
    period (``schedule.py`` states the staleness);
    ``spread_covariances``: each step (every ``s``-th under a budget) takes the
    statistics of a slice of its batch, not every ``P``-th step all of it (None:
    with ``overhead_budget``; ``covariance_slices.py``).
    ``graph_optimization``: ``"off"`` (default) skips Grappler's rewrites
    of the step's graph, ``"default"`` keeps TensorFlow's (``kfac_graph/graph_options.py``).
    ``relax_shapes``: a batch of a new shape runs one more step traced with the sizes that
    changed unknown, where it computes what a trace at its own shapes would (else, and with
    False, each new shape traces the step; ``kfac_graph/relaxed_shapes.py``).
    ``summary_writer``: a ``tf.summary`` writer; loss, damping, learning
    rate, momentum, rho and each factor's trace are written every
    ``summary_period`` steps. ``sync_statistics``: under ``tf.distribute``,
    when the replicas' factor statistics are averaged: ``"lazy"`` (at
    inverse updates and other reads) or ``"eager"`` (after every covariance
    update); the steps are the same either way.

    What the step core (``step_core.py``) reads, all public: the options (``momentum_type``,
    ``qmodel_curvature``, ``qmodel_batch_fraction``, ``l2_reg``, ``norm_constraint``,
    ``adapt_damping``, ``damping_adaptation_interval``, ``omega``, ``min_damping``,
    ``schedule``, ``whole_step_jit``), ``fn``, ``estimator``, ``registration``,
    ``estimator_state``, ``dtype``, the state variables (``iterations``, ``skipped_steps``,
    ``damping``, ``learning_rate``, ``momentum``, ``rho``, ``qmodel_change``,
    ``curvature_scale``, ``velocities``, ``cap_watch``) and ``blocks_damping``, ``precondition``,
    ``curvature_multiply``.

    Bad options are one-line ``ValueError``s naming the option (``OPTIONS``:
    what each takes, also checked by ``KFACModel`` and ``kfac-rewrite``).
    """

    OPTIONS = kfac_options.OPTIONS

    @classmethod
    def check_options(cls, owner: str | None = "kg.KFAC", prefix: str = "", **values) -> dict:
        """``values`` (keywords of ``KFAC``) checked and converted (``kfac_options.check``)."""
        return kfac_options.check(cls, owner, prefix, values)

    def __init__(self, fn, learning_rate: float = 0.1, damping: float = 0.1,
                 momentum: float = 0.9, momentum_type: str = "qmodel", l2_reg: float = 0.0,
                 norm_constraint: float | None = 1e-3, cov_update_period: int | None = None,
                 inverse_update_period: int | None = None, stagger_inverses: bool = True,
                 spread_covariances: bool | None = None, overhead_budget: float | None = None,
                 cov_ema_decay: float = 0.95,
                 num_burnin_steps: int = 0, estimation_mode: str = "sampled",
                 num_samples: int = 1, adapt_damping: bool = True,
                 damping_adaptation_interval: int = 5, damping_adaptation_decay: float = 0.95,
                 min_damping: float | None = None, qmodel_curvature: str = "exact",
                 qmodel_batch_fraction: float | None = None, qmodel_fallback: bool = True,
                 approximations=None, seed: int = 0,
                 max_factor_size: int | None = FisherEstimator.DEFAULT_MAX_FACTOR_SIZE,
                 factor_block_size: int | None = None, jit_compile="auto", summary_writer=None,
                 summary_period: int = 1,
                 sync_statistics: str = "lazy", graph_optimization: str = "off",
                 relax_shapes: bool = True, name: str | None = None):
        KFAC.check_options(**{k: v for k, v in locals().items() if k in KFAC.OPTIONS})
        super().__init__(name=name or "kfac")
        self.fn = fn if isinstance(fn, RegisteredFunction) else auto_register(fn)
        # None outside tf.distribute (the default strategy): the plain step
        self._replicated = distributed.for_current_strategy(self, sync_statistics)
        self._core = self._replicated if self._replicated is not None else SingleDeviceCore(self)
        self.momentum_type = momentum_type
        self.learning_rate_schedule, learning_rate = kfac_options.learning_rate_schedule(
            learning_rate)
        self.qmodel_curvature = qmodel_curvature
        self.given_qmodel_fraction, self.qmodel_batch_fraction = (  # plan.py may choose it
            qmodel_batch_fraction, float(qmodel_batch_fraction or 1.0))
        self.l2_reg = float(l2_reg)
        # read by "regular" and "adam" only (the quadratic model sets its own step size)
        self.norm_constraint = None if norm_constraint is None else float(norm_constraint)
        self.qmodel_fallback = bool(qmodel_fallback)
        # explicit periods win over the budget's; the budget's are set by build()
        self.given_periods = (cov_update_period, inverse_update_period)
        self.overhead_budget = None if overhead_budget is None else float(overhead_budget)
        self.stagger_inverses = bool(stagger_inverses)
        self.spread_covariances = (self.overhead_budget is not None if spread_covariances is None
                                   else bool(spread_covariances))
        self.cov_update_period = int(cov_update_period or DEFAULT_COV_UPDATE_PERIOD)
        self.inverse_update_period = int(inverse_update_period or DEFAULT_INVERSE_UPDATE_PERIOD)
        self.num_burnin_steps = int(num_burnin_steps)
        self.schedule = StepSchedule(self.num_burnin_steps, self.cov_update_period,
                                     self.inverse_update_period, None, self.spread_covariances)
        self.period_choice = self.costs = self.cost_batch = None
        self.adapt_damping = bool(adapt_damping)
        self.damping_adaptation_interval = int(damping_adaptation_interval)
        self.omega = float(damping_adaptation_decay) ** self.damping_adaptation_interval
        self.min_damping = (damping_lib.default_min_damping(damping) if min_damping is None
                            else float(min_damping))
        self.jit_compile = jit_compile
        self.graph_optimization, self.relax_shapes = graph_optimization, bool(relax_shapes)
        self.summary_writer = summary_writer
        self.summary_period = int(summary_period)
        self.initial = dict(learning_rate=float(learning_rate), damping=float(damping),
                             momentum=float(momentum))
        # the blocks' own damping is never read: the step passes blocks_damping()
        self.estimator = FisherEstimator(
            self.fn, estimation_mode=estimation_mode, num_samples=num_samples,
            damping=float(damping), cov_ema_decay=cov_ema_decay, approximations=approximations,
            seed=seed, max_factor_size=max_factor_size, factor_block_size=factor_block_size)
        self.iterations, self.skipped_steps = (
            tf.Variable(tf.zeros([], tf.int64), trainable=False, name=n)
            for n in ("iterations", "skipped_steps"))
        self._built, self._compiled = False, _Compiled()

    # -- state -------------------------------------------------------------------------
    @property
    def registration(self):
        return self.estimator.registration

    def summary(self) -> str:
        """The estimator's table of blocks, factors and memory (after ``build``)."""
        return self.estimator.summary()

    def memory(self) -> dict:
        """The estimator's memory report (``FisherEstimator.memory``)."""
        return self.estimator.memory()

    @property
    def strategy(self):
        """The ``tf.distribute`` strategy the step runs under (None: one device)."""
        return None if self._replicated is None else self._replicated.strategy

    @property
    def step_core(self):
        """The ``step_core.StepCore`` that runs the step (single-device or replicated)."""
        return self._core

    @property
    def variables_to_train(self) -> tuple:
        return tuple(self.registration.variables)

    @property
    def estimator_state(self) -> tuple:
        """The estimator's variables (factors, counters, cached inverses), in
        ``tf.Module.variables`` order (set by ``build``)."""
        return tuple(self._estimator_state)

    def blocks_damping(self, lam=None):
        """What the blocks damp with: ``(lam + l2_reg) / c``, by default with
        ``lam = lambda`` (``damping``); the damping rule's undamped model
        passes ``lam = 0``."""
        lam = self.damping if lam is None else lam
        return (lam + as_dtype(self.l2_reg, self.dtype)) / self.curvature_scale

    def precondition(self, vectors, damping=None):
        """``(c F~ + (lambda + l2_reg) I)^{-1} vectors`` from the blocks' cached
        inverses (compiled; the caches must be fresh for the blocks' damping
        ``damping``, by default ``blocks_damping()``)."""
        if damping is None:
            damping = self.blocks_damping()
        out = self._compiled.precondition(list(vectors), as_dtype(damping, self.dtype))
        return [v / tf.cast(self.curvature_scale, v.dtype) for v in out]

    def curvature_multiply(self, vectors, damping=None):
        """``(c F~ + (lambda + l2_reg) I) vectors`` (the damped blocks, current
        factors); ``damping``: the blocks' damping, by default ``blocks_damping()``
        (``blocks_damping(0)`` leaves ``lambda`` out)."""
        if damping is None:
            damping = self.blocks_damping()
        out = self.estimator.multiply(list(vectors), damping=damping)
        return [v * tf.cast(self.curvature_scale, v.dtype) for v in out]

    def refresh_inverses(self):
        """Refreshes the estimator's cached inverses for the blocks' current
        damping ``blocks_damping()`` (one device; in a ``tf.function`` or
        eagerly). The step does this itself when due."""
        self.estimator.refresh_inverses(damping=self.blocks_damping())

    @_plain_python
    def build(self, *args):
        """Registers ``fn`` for ``args`` and creates every state variable
        (called by the first ``step``; call it yourself to restore a
        checkpoint into a built optimizer)."""
        if self._replicated is not None:
            with self._replicated.strategy.scope():
                return self._build(*self._replicated.example_args(args))
        return self._build(*args)

    def _build(self, *args):
        reg = self.estimator.build(*args)
        if self._built:
            return reg
        variables = list(reg.variables)
        dtype = tf.as_dtype(variables[0].dtype) if variables else tf.float32
        if not dtype.is_floating or dtype.size < 4:
            dtype = tf.float32
        self.dtype = dtype
        with tf.init_scope():
            scalar = lambda key, name: tf.Variable(tf.constant(self.initial[key], dtype),
                                                   trainable=False, name=name)
            self.damping = scalar("damping", "damping")
            self.learning_rate = scalar("learning_rate", "learning_rate")
            self.momentum = scalar("momentum", "momentum")
            nan = lambda name: tf.Variable(float("nan"), dtype=dtype, trainable=False, name=name)
            self.rho, self.qmodel_change = nan("rho"), nan("qmodel_change")
            self.curvature_scale = tf.Variable(tf.ones([], dtype), trainable=False,
                                               name="curvature_scale")
            self.velocities = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                           name=f"velocity_{i}")
                               for i, v in enumerate(variables)]
            self.cap_watch = cap_watch.CapWatch(  # the quadratic model's capped steps
                remedy=qmodel_fallback.REMEDY if qmodel_fallback.applies(self) else "")
        # periods, slots, block size, forms' fraction (by overhead_budget where not given)
        self.cost_batch = plan.batch_of(args)
        self.costs, self.period_choice, self.schedule = plan.plan_schedule(self, reg)
        plan.take_choice(self)
        # tracked under this name: it fixes the checkpoint keys and variable order
        self._estimator_state = tuple(self.estimator.variables)
        self.cov_update_period = self.schedule.cov_update_period
        self.inverse_update_period = self.schedule.inverse_update_period
        jit = self.jit_compile
        accelerated = bool(tf.config.list_physical_devices("GPU")
                           or tf.config.list_physical_devices("TPU"))
        self.whole_step_jit = bool(accelerated if jit == "auto" else jit)
        # "auto" on the CPU: TensorFlow's kernels for the preconditioning too
        self.precondition_jit = accelerated if jit == "auto" else True
        # the step refreshes stale inverses before it preconditions
        self._compiled.precondition = tf.function(
            lambda vectors, damping: self.estimator.multiply_inverse(
                vectors, refreshed=True, damping=damping),
            jit_compile=self.precondition_jit, autograph=False)
        self.compile_step()
        self._built = True
        return reg

    def compile_step(self):
        """(Re)makes the compiled step from the options as they are now."""
        # without XLA the core is traced inline (the replicated one compiles its own)
        core = self._core.step
        if self.whole_step_jit and self._replicated is None:
            core = tf.function(core, jit_compile=True, autograph=False)
        self._compiled.core = core
        problem = lambda first, specs: (  # noqa: E731  (under a strategy: one replica's share)
            relaxed_shapes.registration_problem(self.fn, self.registration, specs)
            if self._replicated is None else relaxed_shapes.replica_problem(
                self.fn, self.registration, specs, self._replicated.strategy))
        self._compiled.step = (relaxed_shapes.Relaxed(self._step, problem, "kg.KFAC",
                                                      autograph=False)
                               if self.relax_shapes else tf.function(self._step, autograph=False))

    def cost_summary(self) -> str:
        """The counted multiply-adds per layer, the periods and the counted
        step over an SGD step (and the budget's verdict, if one was given);
        after ``build``."""
        if self.costs is None:
            raise ValueError("kg.KFAC.cost_summary: the optimizer is not built yet "
                             "(call step or build first)")
        return costs_lib.summary(self.costs, self.period_choice, self.cov_update_period,
                                 self.inverse_update_period, plan.cost_options(self))

    # -- the step ----------------------------------------------------------------------
    def step(self, *args):
        """One K-FAC step on the batch ``args``; returns the loss (before the update)."""
        if not self._built:
            self.build(*args)
        with graph_options.call_options(self.graph_optimization):
            loss = self._compiled.step(*args)
        qmodel_fallback.after_step(self)
        return loss

    def _step(self, *args):
        loss, applied, t = self._compiled.core(*args)
        summaries.report(self, loss, applied, t)
        return loss

    @property
    def built(self) -> bool:
        """Whether the state (factors, velocities, counters) exists yet."""
        return self._built

