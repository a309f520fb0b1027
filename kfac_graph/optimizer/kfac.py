"""``kg.KFAC``: the K-FAC optimizer, one compiled step per call.

Each ``step(*args)`` runs one ``tf.function`` that, on the step counter
``t`` (only steps that were applied count) and ``k = t - num_burnin_steps``:

1. runs the loss forward and backward once; on covariance steps (every
   step of the burn-in, then ``k % cov_update_period == 0``) the same
   re-run of the registered graph also folds the batch's statistics into
   the estimator's factors (``cov_ema_decay``);
2. on inverse steps (``k % inverse_update_period == 0``, never in the
   burn-in), and after the damping has changed (the blocks cache damped
   inverses), refreshes the estimator's cached inverses, after (1);
3. outside the burn-in, preconditions the gradient ``g`` (plus
   ``l2_reg * theta``) with the damped blocks' inverses (an inner
   ``tf.function(jit_compile=True)``), forms the update by the momentum
   rule and applies it:

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
     (``"kfac"``); ``learning_rate`` and ``momentum`` then record
     ``-alpha`` and ``mu``.

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

The curvature is that of the loss as written: ``c F`` with ``c`` the
loss's ``scale`` times ``B`` for a sum over the batch (1 for a mean), so
the damping is in the loss's units (the blocks see ``lambda / c``).

``l2_reg``: the optimizer minimises ``L + l2_reg/2 |theta|^2`` (do not
add the penalty to the loss yourself): ``l2_reg theta`` joins the
gradient and ``l2_reg`` the damping; the loss returned is ``L`` alone.

A non-finite loss, gradient, factor, inverse or update leaves every
variable (parameters, factors, inverses, velocities, damping, counter) as
it was, adds one to ``skipped_steps`` and logs a warning.

``jit_compile``: ``True`` compiles the whole step with XLA; ``"auto"`` does
so on accelerators only. On the CPU, XLA's convolutions are about 10x
slower than oneDNN's and its Cholesky factorisations about 20x slower than
TensorFlow's (the inverse refresh of the digits autoencoder), and even
its matmuls trail oneDNN's, so even convolution-free models train faster
without it there (``benchmarks/step_overhead.py``). The preconditioning
is compiled in every case. Summaries and the skip warning run outside XLA.

Under ``tf.distribute`` (``MirroredStrategy``, ``MultiWorkerMirroredStrategy``,
``TPUStrategy``; the strategy in scope when the optimizer is made) the same
``step`` takes distributed batches, or whole batches that it splits evenly
over the replicas, and runs the step in phases (``distributed.py``): the
replicas' statistics are averaged lazily, at inverse steps
(``sync_statistics="lazy"``), or after every covariance update
(``"eager"``); the result is the single-device step's on the whole batch.
"""
from __future__ import annotations

import tensorflow as tf

from kfac_graph.auto_register import RegisteredFunction, auto_register
from kfac_graph.fisher.estimator import FisherEstimator
from kfac_graph.fisher import linalg
from kfac_graph.optimizer import damping as damping_lib
from kfac_graph.optimizer import distributed
from kfac_graph.optimizer import exact_fisher
from kfac_graph.optimizer import qmodel
from kfac_graph.optimizer import vectors as vec

MOMENTUM_TYPES = ("regular", "adam", "qmodel")
_plain_python = tf.autograph.experimental.do_not_convert


class _Compiled:
    """Plain holder for the traced functions (kept out of checkpoints)."""

    def __init__(self):
        self.step = None
        self.core = None
        self.precondition = None


class KFAC(tf.Module):
    """K-FAC for a ``kg.auto_register``ed loss ``fn`` (a plain one is wrapped).

    Defaults follow Martens & Grosse 2015: the quadratic model picks the
    step size and momentum, and the damping (from 0.1) adapts by the
    Levenberg-Marquardt rule; measured on the digits autoencoder this reaches
    Adam's 1000-step loss in 110 steps (``benchmarks/convergence.py``).
    ``learning_rate``, ``momentum``: used by ``"regular"`` and ``"adam"``
    (ignored by ``"qmodel"``, which chooses both each step). ``damping``:
    the initial ``lambda`` (adapted when ``adapt_damping``, never below
    ``min_damping``: by default ``RELATIVE_MIN_DAMPING`` (1e-4) times the
    initial value, see ``damping.py``). Estimator
    options (``estimation_mode``, ``num_samples``, ``cov_ema_decay``,
    ``approximations``, ``seed``) go to ``kg.FisherEstimator``.
    ``summary_writer``: a ``tf.summary`` writer; loss, damping, learning
    rate, momentum, rho and each factor's trace are written every
    ``summary_period`` steps. ``sync_statistics``: under ``tf.distribute``,
    when the replicas' factor statistics are averaged: ``"lazy"`` (at
    inverse updates and other reads) or ``"eager"`` (after every covariance
    update); the steps are the same either way.
    """

    def __init__(self, fn, learning_rate: float = 0.1, damping: float = 0.1,
                 momentum: float = 0.9, momentum_type: str = "qmodel", l2_reg: float = 0.0,
                 norm_constraint: float | None = 1e-3, cov_update_period: int = 1,
                 inverse_update_period: int = 10, cov_ema_decay: float = 0.95,
                 num_burnin_steps: int = 0, estimation_mode: str = "sampled",
                 num_samples: int = 1, adapt_damping: bool = True,
                 damping_adaptation_interval: int = 5, damping_adaptation_decay: float = 0.95,
                 min_damping: float | None = None, qmodel_curvature: str = "exact",
                 approximations=None, seed: int = 0,
                 jit_compile="auto", summary_writer=None, summary_period: int = 1,
                 sync_statistics: str = "lazy", name: str | None = None):
        super().__init__(name=name or "kfac")
        if momentum_type not in MOMENTUM_TYPES:
            raise ValueError(f"momentum_type must be one of {MOMENTUM_TYPES}, got {momentum_type!r}")
        if momentum_type == "qmodel" and norm_constraint is not None:
            norm_constraint = None  # the quadratic model sets the step size itself
        for label, value in (("cov_update_period", cov_update_period),
                             ("inverse_update_period", inverse_update_period),
                             ("damping_adaptation_interval", damping_adaptation_interval),
                             ("summary_period", summary_period)):
            if int(value) < 1:
                raise ValueError(f"{label} must be at least 1, got {value}")
        if int(num_burnin_steps) < 0:
            raise ValueError(f"num_burnin_steps must be >= 0, got {num_burnin_steps}")
        if jit_compile not in (True, False, "auto"):
            raise ValueError(f"jit_compile must be True, False or 'auto', got {jit_compile!r}")
        self.fn = fn if isinstance(fn, RegisteredFunction) else auto_register(fn)
        # None outside tf.distribute (the default strategy): the plain step
        self._replicated = distributed.for_current_strategy(self, sync_statistics)
        self.momentum_type = momentum_type
        if qmodel_curvature not in ("exact", "kfac"):
            raise ValueError(f"qmodel_curvature must be 'exact' or 'kfac', got {qmodel_curvature!r}")
        self.qmodel_curvature = qmodel_curvature
        self.l2_reg = float(l2_reg)
        self.norm_constraint = None if norm_constraint is None else float(norm_constraint)
        self.cov_update_period = int(cov_update_period)
        self.inverse_update_period = int(inverse_update_period)
        self.num_burnin_steps = int(num_burnin_steps)
        self.adapt_damping = bool(adapt_damping)
        self.damping_adaptation_interval = int(damping_adaptation_interval)
        self.omega = float(damping_adaptation_decay) ** self.damping_adaptation_interval
        self.min_damping = (damping_lib.default_min_damping(damping) if min_damping is None
                            else float(min_damping))
        self.jit_compile = jit_compile
        self.summary_writer = summary_writer
        self.summary_period = int(summary_period)
        self._initial = dict(learning_rate=float(learning_rate), damping=float(damping),
                             momentum=float(momentum))
        self.estimator = FisherEstimator(self.fn, estimation_mode=estimation_mode,
                                         num_samples=num_samples, damping=self._block_damping,
                                         cov_ema_decay=cov_ema_decay,
                                         approximations=approximations, seed=seed)
        self.iterations = tf.Variable(tf.zeros([], tf.int64), trainable=False, name="iterations")
        self.skipped_steps = tf.Variable(tf.zeros([], tf.int64), trainable=False,
                                         name="skipped_steps")
        self._built = False
        self._undamped = False
        self._compiled = _Compiled()

    # -- state -------------------------------------------------------------------------
    @property
    def registration(self):
        return self.estimator.registration

    @property
    def strategy(self):
        """The ``tf.distribute`` strategy the step runs under (None: one device)."""
        return None if self._replicated is None else self._replicated.strategy

    @property
    def variables_to_train(self) -> tuple:
        return tuple(self.registration.variables)

    def _block_damping(self):
        """What the blocks damp with: ``(lambda + l2_reg) / c`` (``l2_reg / c``
        while the damping rule evaluates its undamped model, a trace-time switch)."""
        lam = tf.zeros([], self.dtype) if self._undamped else self.damping
        return (lam + tf.cast(self.l2_reg, self.dtype)) / self.curvature_scale

    def precondition(self, vectors):
        """``(c F~ + (lambda + l2_reg) I)^{-1} vectors`` (the compiled blocks' inverses)."""
        out = self._compiled.precondition(list(vectors))
        return [v / tf.cast(self.curvature_scale, v.dtype) for v in out]

    def curvature_multiply(self, vectors):
        """``(c F~ + (lambda + l2_reg) I) vectors`` (the damped blocks, current factors)."""
        out = self.estimator.multiply(list(vectors))
        return [v * tf.cast(self.curvature_scale, v.dtype) for v in out]

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
            scalar = lambda key, name: tf.Variable(tf.constant(self._initial[key], dtype),
                                                   trainable=False, name=name)
            self.damping = scalar("damping", "damping")
            self.learning_rate = scalar("learning_rate", "learning_rate")
            self.momentum = scalar("momentum", "momentum")
            nan = lambda name: tf.Variable(tf.constant(float("nan"), dtype), trainable=False,
                                           name=name)
            self.rho = nan("rho")
            self.qmodel_change = nan("qmodel_change")
            self.curvature_scale = tf.Variable(tf.ones([], dtype), trainable=False,
                                               name="curvature_scale")
            self.velocities = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                           name=f"velocity_{i}")
                               for i, v in enumerate(variables)]
        self._estimator_state = tuple(self.estimator.variables)
        jit = self.jit_compile
        if jit == "auto":
            accelerated = bool(tf.config.list_physical_devices("GPU")
                               or tf.config.list_physical_devices("TPU"))
            jit = accelerated
        self.whole_step_jit = bool(jit)
        # the step refreshes stale inverses before it preconditions
        self._compiled.precondition = tf.function(
            lambda vectors: self.estimator.multiply_inverse(vectors, refreshed=True),
            jit_compile=True, autograph=False)
        # without XLA the core is traced inline into the step (no nested call)
        self._compiled.core = (tf.function(self._core, jit_compile=True, autograph=False)
                               if self.whole_step_jit else self._core)
        if self._replicated is not None:
            self._compiled.core = self._replicated.core
        self._compiled.step = tf.function(self._step, autograph=False)
        self._built = True
        return reg

    # -- the step ----------------------------------------------------------------------
    def step(self, *args):
        """One K-FAC step on the batch ``args``; returns the loss (before the update)."""
        if not self._built:
            self.build(*args)
        return self._compiled.step(*args)

    def _step(self, *args):
        loss, applied, t = self._compiled.core(*args)

        def warn():
            tf.print("kfac_graph.KFAC: non-finite loss or statistics at step", t,
                     "; update skipped (", self.skipped_steps, "skipped so far)",
                     output_stream=tf.compat.v1.logging.warning)
            return tf.constant(True)

        tf.cond(applied, lambda: tf.constant(True), warn)
        if self.summary_writer is not None:
            self._write_summaries(loss, t)
        return loss

    @property
    def built(self) -> bool:
        """Whether the state (factors, velocities, counters) exists yet."""
        return self._built

    def _schedule(self):
        """``(t, in_burnin, k, do_cov, do_inv)`` for this step: the counter, whether
        it is a burn-in step, the steps since the burn-in, and whether this step
        updates the covariances and refreshes the inverses."""
        t = self.iterations.read_value()
        in_burnin = t < self.num_burnin_steps
        k = t - self.num_burnin_steps
        do_cov = in_burnin | tf.equal(k % self.cov_update_period, 0)
        do_inv = ~in_burnin & tf.equal(k % self.inverse_update_period, 0)
        return t, in_burnin, k, do_cov, do_inv

    def _core(self, *args):
        reg = self.estimator.build(*args)
        variables = list(reg.variables)
        t, in_burnin, k, do_cov, do_inv = self._schedule()
        self.curvature_scale.assign(self._loss_scale(reg, args))
        # reads taken before the updates keep the old values (assignments copy on write)
        snapshot = [v.read_value() for v in self._estimator_state]
        loss, grads, forward = self._loss_and_gradients(args, variables, do_cov)
        if self.l2_reg:
            grads = [g + tf.cast(self.l2_reg, g.dtype) * v for g, v in zip(grads, variables)]
        statistics_ok = (tf.reduce_all(tf.math.is_finite(loss)) & vec.all_finite(grads)
                         & tf.cond(do_cov, self._statistics_finite, lambda: tf.constant(True)))

        def refresh_inverses():
            self.estimator.refresh_inverses()
            return tf.constant(True)

        applied = self._finish_step(args, variables, loss, grads, statistics_ok, k, do_inv,
                                    in_burnin, refresh_inverses, self._estimator_state, snapshot,
                                    forward)
        return loss, applied, t

    def _statistics_finite(self):
        """Whether the moving averages a covariance update writes are finite.
        The cached decompositions change only at inverse refreshes, which
        ``_finish_step`` checks, so a step without a covariance update needs
        no check of the estimator's state (a committed step left it finite)."""
        written = [v for v in self._estimator_state if distributed.is_replica_local(v)]
        return vec.all_finite([v.read_value() for v in written])

    def _finish_step(self, args, variables, loss, grads, statistics_ok, k, do_inv, in_burnin,
                     refresh_inverses, state, snapshot, forward=None):
        """After the gradients: on inverse steps ``refresh_inverses()``, then
        (outside the burn-in) the update; commits the step counter if every
        value was finite, else puts ``state`` back to ``snapshot`` and counts
        the skip. True if the step was applied. ``forward``: the step's
        forward pass (``LayerTaps``) when it sits in this graph's top level,
        for the quadratic model's Fisher forms; they can use it only if the
        update does too (no burn-in branch around it)."""
        # a damping changed by the Levenberg-Marquardt rule also refreshes the
        # (damped) inverses, so the compiled preconditioning reads them as cached
        stale = ~in_burnin & self.estimator.inverses_stale()
        refreshed = tf.cond((do_inv | stale) & statistics_ok, refresh_inverses,
                            lambda: tf.constant(False))
        inverses_ok = tf.cond(refreshed, lambda: vec.all_finite(
            [v.read_value() for v in state]), lambda: tf.constant(True))
        statistics_ok = statistics_ok & inverses_ok

        if self.num_burnin_steps:
            applied = tf.cond(in_burnin, lambda: statistics_ok, lambda: self._update(
                args, variables, loss, grads, statistics_ok, k))
        else:  # never in the burn-in: the update, and the forward pass, at the top level
            applied = self._update(args, variables, loss, grads, statistics_ok, k, forward)

        def commit():
            self.iterations.assign_add(1)
            return tf.constant(True)

        def roll_back():
            for v, old in zip(state, snapshot):
                v.assign(old)
            self.skipped_steps.assign_add(1)
            return tf.constant(True)

        tf.cond(applied, commit, roll_back)
        return applied

    def _loss_and_gradients(self, args, variables, do_cov):
        """The loss and its gradients on ``args``; on covariance steps the same
        forward pass also folds the batch's statistics into the factors. Third:
        that forward pass (``LayerTaps``) when every step is a covariance
        step, so that it is not inside a branch (else None)."""
        if self.cov_update_period == 1:
            taps = self.estimator.accumulate_taps(*args)
            return taps.loss, _dense(tf.gradients(taps.loss, variables), variables), taps

        def with_statistics():
            loss = self.estimator.accumulate(*args)
            return [loss] + _dense(tf.gradients(loss, variables), variables)

        def without_statistics():
            with tf.GradientTape() as tape:
                loss = self.fn.tf_function(*args)
            grads = tape.gradient(loss, variables,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return [loss] + _dense(grads, variables)

        out = tf.cond(do_cov, with_statistics, without_statistics)
        return out[0], out[1:], None

    def _batch_loss(self, args):
        """The loss on the batch at the current parameters (all replicas')."""
        if self._replicated is not None:
            return self._replicated.batch_loss(args)
        return self.fn.tf_function(*args)

    def _fisher_forms(self, args, vectors, forward=None):
        """``[[u_a . F u_b]]`` with the exact Fisher ``F`` of the batch (all
        replicas'), differentiating ``forward`` when given."""
        if self._replicated is not None:
            return self._replicated.fisher_forms(args, vectors)
        return exact_fisher.quadratic_forms(self.registration, args, vectors, forward)

    def _loss_scale(self, reg, args):
        """``c``: the loss's curvature is ``c F`` (``F`` per example, averaged)."""
        c = tf.constant(float(reg.loss.scale), self.dtype)
        if reg.loss.reduction == "sum":
            first = tf.convert_to_tensor(tf.nest.flatten(args)[0])
            c = c * tf.cast(tf.shape(first)[0], self.dtype)
        return c

    def _update(self, args, variables, loss, grads, statistics_ok, k, forward=None):
        """Forms and (if everything is finite) applies the update; True if applied."""
        delta, velocity, lr, mu, model_change = self._direction(args, grads, forward)
        ok = statistics_ok & vec.all_finite(delta) & vec.all_finite(velocity)

        def apply():
            theta_dot_delta = vec.dot(variables, delta) if self.l2_reg else None
            for v, d in zip(variables, delta):
                v.assign_add(tf.cast(d, v.dtype))
            for slot, new in zip(self.velocities, velocity):
                slot.assign(new)
            if self.momentum_type == "qmodel":
                self.learning_rate.assign(tf.cast(lr, self.dtype))
                self.momentum.assign(tf.cast(mu, self.dtype))
            if self.adapt_damping:
                adapt_now = tf.equal((k + 1) % self.damping_adaptation_interval, 0)
                tf.cond(adapt_now,
                        lambda: self._adapt_damping(args, loss, grads, delta, theta_dot_delta,
                                                    model_change),
                        lambda: tf.constant(True))
            return tf.constant(True)

        return tf.cond(ok, apply, lambda: tf.constant(False))

    def _direction(self, args, grads, forward=None):
        """``(delta, new velocities, lr, mu, model change or None)`` by the momentum rule."""
        dtype = self.dtype
        lr = tf.cast(self.learning_rate, dtype)
        mu = tf.cast(self.momentum, dtype)
        old = [v.read_value() for v in self.velocities]
        if self.momentum_type == "regular":
            p = self._clip(grads, self.precondition(grads), lr)
            velocity = vec.axpy(mu, old, p)
            return vec.scale(-lr, velocity), velocity, lr, mu, None
        if self.momentum_type == "adam":
            velocity = vec.axpy(mu, old, grads)
            p = self._clip(velocity, self.precondition(velocity), lr)
            return vec.scale(-lr, p), velocity, lr, mu, None
        p = self.precondition(grads)
        (m11, m12), (_, m22) = self._curvature_quadratics(args, [p, old], forward)
        c1, c2 = tf.cast(vec.dot(grads, p), dtype), tf.cast(vec.dot(grads, old), dtype)
        alpha, mu = qmodel.solve(m11, m12, m22, c1, c2)
        delta = vec.combine(alpha, p, mu, old)
        dd = tf.cast(vec.dot(delta, delta), dtype)
        change = qmodel.model_value(alpha, mu, m11, m12, m22, c1, c2) - 0.5 * self.damping * dd
        return delta, delta, -alpha, mu, change

    def _curvature_quadratics(self, args, vectors, forward=None):
        """``[[u_a . C u_b]]`` for the quadratic model's curvature ``C``:
        ``c F + (lambda + l2_reg) I`` with the exact Fisher ``F`` of this
        batch (``qmodel_curvature="exact"``) or the damped K-FAC matrix."""
        dtype = self.dtype
        n = len(vectors)
        if self.qmodel_curvature == "kfac":
            products = [self.curvature_multiply(u) for u in vectors]
            return [[tf.cast(vec.dot(vectors[a], products[b]), dtype) for b in range(n)]
                    for a in range(n)]
        fisher = self._fisher_forms(args, vectors, forward)
        total = self.damping + tf.constant(self.l2_reg, dtype)
        return [[self.curvature_scale * tf.cast(fisher[a][b], dtype)
                 + total * tf.cast(vec.dot(vectors[a], vectors[b]), dtype) for b in range(n)]
                for a in range(n)]

    def _clip(self, vectors, preconditioned, lr):
        if self.norm_constraint is None:
            return preconditioned
        sq = lr * lr * tf.cast(vec.dot(vectors, preconditioned), lr.dtype)
        tiny = tf.constant(1e-30, lr.dtype)
        coeff = tf.minimum(tf.ones([], lr.dtype),
                           tf.sqrt(tf.cast(self.norm_constraint, lr.dtype) / tf.maximum(sq, tiny)))
        return vec.scale(coeff, preconditioned)

    def _adapt_damping(self, args, loss, grads, delta, theta_dot_delta, model_change):
        dtype = self.dtype
        new_loss = tf.cast(self._batch_loss(args), dtype)
        loss_change = new_loss - tf.cast(loss, dtype)
        dd = tf.cast(vec.dot(delta, delta), dtype)
        if self.l2_reg:
            l2 = tf.constant(self.l2_reg, dtype)
            loss_change += l2 * tf.cast(theta_dot_delta, dtype) + 0.5 * l2 * dd
        if model_change is None:
            self._undamped = True
            try:
                curvature = tf.cast(vec.dot(delta, self.curvature_multiply(delta)), dtype)
            finally:
                self._undamped = False
            model_change = tf.cast(vec.dot(grads, delta), dtype) + 0.5 * curvature
        new_damping, rho = damping_lib.adapt(self.damping.read_value(), loss_change, model_change,
                                             self.omega, self.min_damping)
        self.damping.assign(new_damping)
        self.rho.assign(rho)
        self.qmodel_change.assign(model_change)
        return tf.constant(True)

    # -- summaries ------------------------------------------------------------------------
    def _write_summaries(self, loss, t):
        record = tf.equal(t % self.summary_period, 0)
        with self.summary_writer.as_default(step=t), tf.summary.record_if(record):
            tf.summary.scalar("kfac/loss", loss)
            tf.summary.scalar("kfac/damping", self.damping)
            tf.summary.scalar("kfac/learning_rate", self.learning_rate)
            tf.summary.scalar("kfac/momentum", self.momentum)
            if self.adapt_damping:
                tf.summary.scalar("kfac/rho", self.rho)
            tf.summary.scalar("kfac/skipped_steps", self.skipped_steps)
            for layer, block in zip(self.registration.layers, self.estimator.blocks):
                for label, factor in factors_of(block):
                    trace = linalg.trace(factor.value(), factor.diagonal)
                    tf.summary.scalar(f"factors/{layer.name}/{label}_trace",
                                      tf.reduce_sum(trace))


def factors_of(block):
    """``[(label, factor)]``: the covariance factors a block keeps."""
    inner = getattr(block, "block", None)
    if inner is not None:
        return factors_of(inner)
    out = []
    for label in ("input_factor", "output_factor", "factor"):
        factor = getattr(block, label, None)
        if factor is not None and hasattr(factor, "value"):
            out.append((label.replace("_factor", "") or label, factor))
    return out


def _dense(grads, variables):
    """Gradients as dense tensors (zeros where a variable is unused)."""
    out = []
    for g, v in zip(grads, variables):
        if g is None:
            g = tf.zeros(v.shape, v.dtype)
        out.append(tf.convert_to_tensor(g))
    return out
