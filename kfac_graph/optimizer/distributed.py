"""``kg.KFAC``'s step under ``tf.distribute``: phases around the replicas.

The contract: with ``R`` replicas on equal shares of a batch, one step
equals the single-device step on the whole batch (up to rounding). It holds
because everything the step decides on is a mean over examples, and the
mean of the replicas' means over equal shares is the whole batch's mean:

- the loss and its gradients are reduced by tf.distribute's convention:
  each replica's loss is its share's (mean or sum, as the loss is
  written), and the replicas' values are averaged for a mean loss and
  summed for a sum (``c = scale * B`` then counts the whole batch);
- factor statistics: every replica folds its own share's batch estimate
  ``x_r`` into its own copy of each moving average (``ON_READ``
  variables, ``ema.py``): ``m_r <- d m_r + (1 - d) x_r``. The update is
  linear, so ``mean_r m_r`` is the average of ``mean_r x_r``, the whole
  batch's estimate, whatever the replicas' copies were: averaging may wait
  until the statistics are read (``"lazy"``: reading an ``ON_READ``
  variable in cross-replica context averages it, which happens at inverse
  updates and wherever the current factors are multiplied), or run after
  every covariance update (``"eager"``: the average is written back to
  every replica, so the copies always agree). Both give the same steps;
  they differ in the bytes reduced (``benchmarks/distributed.py``);
- every scalar the step branches on is reduced first: the loss, the
  gradients' and the replicas' statistics' finiteness (one flag, summed),
  the quadratic model's Fisher forms and the damping rule's new loss.

The step, traced once (``ReplicatedCore.step``, the shared
``step_core.StepCore`` logic on this module's seams), in cross-replica
context:

1. ``strategy.run``: per replica, the forward/backward pass and, on
   covariance steps, the local statistics update; the loss, gradients and
   a non-finite flag come back packed in one vector per replica, reduced
   by one all-reduce;
2. on inverse steps: block ``i``'s factors are averaged onto replica
   ``i mod R``'s device, decomposed there once for the blocks' damping the
   core passes, and the result is written to the (mirrored) inverse caches,
   i.e. broadcast to every replica (staggered: only the blocks due, each in
   its own branch on the owner's path);
3. the update (preconditioning, momentum or quadratic model, damping rule)
   is formed once from the reduced quantities and applied to the mirrored
   variables (broadcast); the batch-dependent parts (the exact Fisher
   forms, the loss at the new parameters) run per replica and are reduced;
4. a skipped step restores the mirrored state centrally and each
   replica's statistics locally.

No synchronisation point sits inside a replica's control flow (the
branches on the step counter are taken in cross-replica context, where
``strategy.run`` and reductions may sit inside ``tf.cond``).
``jit_compile=True`` (or ``"auto"`` on accelerators) compiles each
per-replica function with XLA; the host-side parts are the reductions,
the inverse placement and the update, whose operations are those of the
single-device step (all XLA-compilable; no host callbacks outside the
skip warning and the summaries, which ``KFAC.step`` runs after the core).

With ``MultiWorkerMirroredStrategy`` every worker runs the cross-replica
parts on its own devices, and each block's inverses are computed by the
worker that holds replica ``i mod R`` alone, then shared by one all-reduce
at inverse steps (``refresh_inverses``). Whole (undistributed)
batches must then be the same on every worker: replica ``r`` takes the
``r``-th share by its global index.
"""

from __future__ import annotations

import tensorflow as tf

from kfac_graph.optimizer import exact_fisher, loss_state, replica_reads
from kfac_graph.optimizer import vectors as vec
from kfac_graph.optimizer.example_cuts import batch_tensor
from kfac_graph.optimizer.step_core import Gradients, StepCore
from kfac_graph.optimizer.step_pass import curvature_scale, forward_backward
from kfac_graph.taps import LayerTaps, is_trace_constant

SYNC_MODES = ("lazy", "eager")
_SUPPORTED = (
    tf.distribute.MirroredStrategy,
    tf.distribute.MultiWorkerMirroredStrategy,
    tf.distribute.TPUStrategy,
    tf.distribute.OneDeviceStrategy,
)
MEAN, SUM = tf.distribute.ReduceOp.MEAN, tf.distribute.ReduceOp.SUM


def for_current_strategy(opt, sync_statistics: str = "lazy"):
    """A ``ReplicatedCore`` for the strategy in scope, or ``None`` outside one."""
    if sync_statistics not in SYNC_MODES:
        raise ValueError(f"sync_statistics must be one of {SYNC_MODES}, got {sync_statistics!r}")
    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, _SUPPORTED):
        raise ValueError(f"kg.KFAC does not support {type(strategy).__name__}; use "
                         "MirroredStrategy, MultiWorkerMirroredStrategy or TPUStrategy")
    return ReplicatedCore(opt, strategy, sync_statistics)


def is_replica_local(variable) -> bool:
    """Whether each replica keeps its own copy (``ON_READ``)."""
    return getattr(variable, "synchronization", None) == tf.VariableSynchronization.ON_READ


def is_statistic(variable) -> bool:
    """A replica-local moving average that reads as the replicas' mean."""
    return is_replica_local(variable) and variable.aggregation == tf.VariableAggregation.MEAN


def _refreshed(block, damping):
    block.update_inverses(damping=damping)
    return tf.constant(True)


def _is_distributed(value) -> bool:
    return isinstance(value, tf.distribute.DistributedValues)


def _pack(tensors):
    """One vector in the widest floating dtype of ``tensors``, and how to undo it."""
    dtypes = [t.dtype for t in tensors]
    wide = max((d for d in dtypes if d.is_floating), key=lambda d: d.size)
    shapes = [t.shape for t in tensors]
    flat = tf.concat([tf.reshape(tf.cast(t, wide), [-1]) for t in tensors], 0)

    def unpack(vector):
        out, start = [], 0
        for shape, dtype in zip(shapes, dtypes):
            size = shape.num_elements()
            out.append(tf.cast(tf.reshape(vector[start : start + size], shape), dtype))
            start += size
        return out

    return flat, unpack


class ReplicatedCore(StepCore):
    """The distributed step of one ``kg.KFAC`` (see the module docstring): the
    seams of ``step_core.StepCore`` under ``strategy``.

    A plain object (not tracked as state): the optimizer's variables stay
    the single-device optimizer's, created under ``strategy.scope()``."""

    def __init__(self, opt, strategy, sync_statistics: str):
        super().__init__(opt)
        self.strategy = strategy
        self.sync_statistics = sync_statistics
        self._replica_fns = {}
        self.local_blocks = ()

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    # -- batches ------------------------------------------------------------------------
    def example_args(self, args):
        """One replica's share of ``args`` (what the registration is traced with)."""
        if any(_is_distributed(a) for a in tf.nest.flatten(args)):
            first = lambda a: self.strategy.experimental_local_results(a)[0]
            return tf.nest.map_structure(lambda a: first(a) if _is_distributed(a) else a,
                                         tuple(args))
        return tf.nest.map_structure(lambda a: self._share(a, 0), tuple(args))

    def distribute(self, args):
        """``args`` as per-replica values: distributed values as they are, whole
        batches split evenly along the first axis (replica ``r`` takes share ``r``)."""
        args = tuple(args)
        if any(_is_distributed(a) for a in tf.nest.flatten(args)):
            return args
        return self.strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.nest.map_structure(
                lambda a: self._share(a, ctx.replica_id_in_sync_group), args
            )
        )

    def _share(self, value, replica):
        if is_trace_constant(value):  # a training flag: the same on every replica
            return value
        value = tf.convert_to_tensor(value)
        if value.shape.rank == 0:
            return value
        n = self.num_replicas
        batch = value.shape[0]
        if batch is None:
            batch = tf.shape(value)[0]
        elif batch % n:
            raise ValueError(
                f"kg.KFAC: a batch of {batch} examples does not split evenly over {n} replicas"
            )
        size = batch // n
        if isinstance(batch, tf.Tensor):  # known only when the step runs
            check = tf.debugging.assert_equal(
                batch % n, 0, message=f"kg.KFAC: the batch does not split evenly over {n} replicas"
            )
            with tf.control_dependencies([check]):
                size = tf.identity(size)
        return value[replica * size : (replica + 1) * size]

    # -- helpers ------------------------------------------------------------------------
    def _replica_fn(self, key, fn):
        """``fn`` compiled with XLA when the optimizer compiles its whole step
        (called from a plain function: ``strategy.run`` given a compiled
        ``tf.function`` itself launches it on the first replica's device)."""
        if key not in self._replica_fns:
            jit = self.opt.whole_step_jit
            self._replica_fns[key] = (tf.function(fn, jit_compile=True, autograph=False)
                                      if jit else fn)
        compiled = self._replica_fns[key]
        return lambda *args: compiled(*args)

    @property
    def _loss_op(self):
        return MEAN if self.opt.registration.loss.reduction == "mean" else SUM

    def _local_state(self):
        return [v for v in self.opt.estimator_state if is_replica_local(v)]

    def _shared_state(self):
        return [v for v in self.opt.estimator_state if not is_replica_local(v)]

    # -- the step's seams (step_core.StepCore) --------------------------------------------
    def prepare(self, args):  # (the registration of one replica's share at these shapes)
        replica_reads.refuse(self.opt.registration, self.num_replicas)
        return self.distribute(args), self.opt.estimator.build(*self.example_args(args))

    def rollback_state(self) -> list:
        """The mirrored estimator variables (the cached inverses); each replica
        snapshots and restores its own statistics (``finish``)."""
        return self._shared_state()

    def loss_and_gradients(self, args, registration, scheduled) -> Gradients:
        """Per replica the forward/backward pass (and the local statistics
        update), reduced by one all-reduce; ``extra``: the replicas' snapshots
        of their statistics. With ``"eager"`` syncing, the statistics are then
        averaged; ``statistics_ok`` covers every replica's statistics and the
        mirrored state."""
        opt, strategy = self.opt, self.strategy
        packed, local_snapshot, self._loss_state_before = strategy.run(
            self._replica_fn("gradients", self._gradients), args=(scheduled,) + tuple(args)
        )
        _, unpack = self._gradients_layout
        reduced = unpack(strategy.reduce(self._loss_op, packed, axis=None))
        loss, grads, flagged, batch, size_scale = (reduced[0], reduced[1:-3], reduced[-3],
                                                   reduced[-2], reduced[-1])
        if self._loss_op == SUM:  # (each replica's s alike, step_pass.py)
            size_scale = size_scale / self.num_replicas
        scale = curvature_scale(registration, batch, opt.dtype,
                                size_scale if registration.loss.size_scaled else None)
        if self.sync_statistics == "eager":
            tf.cond(scheduled.do_cov, self._average_statistics, lambda: tf.constant(False))
        statistics_ok = tf.equal(flagged, 0) & vec.all_finite(
            [v.read_value() for v in self._shared_state()])
        return Gradients(loss, grads, statistics_ok, scale, None, local_snapshot)

    def finish(self, applied, gradients: Gradients):
        """Per replica: a skipped step's statistics put back."""
        self.strategy.run(self._replica_fn("restore", self._restore),
                          args=(applied, gradients.extra))

    def _gradients(self, scheduled, *args):
        """Per replica: ``(packed [loss, grads, non-finite flag, batch], snapshot,
        before)``; ``before``: the state the loss writes, as the pass starts."""
        opt, registration = self.opt, self.opt.estimator.build(*args)
        local = self._local_state()
        snapshot = [v.read_value() for v in local]
        before = loss_state.snapshot(loss_state.written(registration))
        found = forward_backward(opt, args, list(registration.variables), scheduled,
                                 size_scaled=registration.loss.size_scaled)
        flagged = 1 - tf.cast(vec.all_finite([v.read_value() for v in local]), opt.dtype)
        first = batch_tensor(args, "kg.KFAC")
        batch = tf.cast(tf.shape(first)[0], opt.dtype)
        size_scale = tf.ones([], opt.dtype) if found.size_scale is None else found.size_scale
        packed, unpack = _pack([found.loss] + list(found.grads) + [flagged, batch, size_scale])
        self._gradients_layout = (packed.shape, unpack)
        return packed, snapshot, before

    def _restore(self, applied, snapshot):
        """Per replica: put back the statistics of a skipped step."""

        def back():
            for v, old in zip(self._local_state(), snapshot):
                v.assign(old)
            return tf.constant(True)

        return tf.cond(applied, lambda: tf.constant(True), back)

    def _average_statistics(self):
        """Every replica's statistics replaced by the replicas' mean (one
        batched all-reduce)."""
        stats = [v for v in self.opt.estimator_state if is_statistic(v)]
        means = self.strategy.extended.batch_reduce_to(MEAN, [(v, v) for v in stats])
        for v, mean in zip(stats, means):
            for component, value in zip(v.values, self.strategy.experimental_local_results(mean)):
                component.assign(value)
        return tf.constant(True)

    def refresh_inverses(self, damping, mask=None):
        """Block ``i``'s inverses, for the blocks' damping ``damping``, from its
        replica-averaged factors, computed once, by replica ``i mod R``, and
        shared with every replica.

        On one worker the owner's device computes them and the assignment to
        the mirrored caches copies them to every device. Across workers only
        the owner's worker computes block ``i``; then one summed all-reduce, in
        which the owner contributes the new caches and every other replica
        zeros, hands every replica the owner's values."""
        strategy = self.strategy
        ids = self._local_replica_ids()
        blocks = self.opt.estimator.blocks
        owned = [i for i in range(len(blocks)) if i % self.num_replicas in ids]
        self.local_blocks = owned  # which blocks this worker's step computes (trace time)
        if len(ids) == self.num_replicas:
            devices = strategy.extended.worker_devices
            for i in owned:
                with tf.device(devices[ids.index(i % self.num_replicas)]):
                    if mask is None:
                        blocks[i].update_inverses(damping=damping)
                    else:
                        tf.cond(mask[i], lambda b=blocks[i]: _refreshed(b, damping),
                                lambda: tf.constant(False))
            return
        # Across workers, reading the statistics here would be a collective only
        # the owners join: average them first (the same collective everywhere),
        # then each owner computes from its own, now equal, copies.
        self._average_statistics()
        caches = [[v for v in block.variables if not is_replica_local(v)] for block in blocks]
        flat = [v for group in caches for v in group]
        due = tf.stack(mask) if mask is not None else tf.ones([len(blocks)], tf.bool)
        contributions = strategy.run(
            self._replica_fn("inverses", lambda d, m: self._owned_inverses(caches, d, m)),
            args=(damping, due),
        )
        shared = strategy.extended.batch_reduce_to(SUM, list(zip(contributions, flat)))
        for v, value in zip(flat, shared):
            for component, local in zip(v.values, strategy.experimental_local_results(value)):
                component.assign(local)

    def _owned_inverses(self, caches, damping, due):
        """Per replica: for every block's cache variables, the refreshed values
        (the current ones where ``due[i]`` is False) where this replica owns
        the block (``i mod R``), zeros elsewhere."""
        replica = tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group)
        out = []
        for i, (block, group) in enumerate(zip(self.opt.estimator.blocks, caches)):
            if i % self.num_replicas == replica:
                def fresh(block=block, group=group):
                    new = {v.ref(): value for v, value in block.inverse_updates(damping=damping)}
                    return [new.get(v.ref(), v.read_value()) for v in group]

                current = lambda group=group: [v.read_value() for v in group]
                out += list(tf.cond(due[i], fresh, current)) if group else []
            else:
                out += [tf.zeros(v.shape, v.dtype) for v in group]
        return out

    def _local_replica_ids(self) -> list:
        """The global indices of this worker's replicas, in device order."""
        ids = self.strategy.experimental_distribute_values_from_function(
            lambda ctx: ctx.replica_id_in_sync_group)
        return [int(i) for i in self.strategy.experimental_local_results(ids)]

    # -- batch-dependent parts of the update ------------------------------------------------
    def batch_loss(self, args):
        """The registered graph's loss on every replica's share, reduced (a
        Keras loss divides itself by the replicas, ``frontends.one_device``),
        each run from its replica's ``before`` (``loss_state.second_run``)."""
        opt = self.opt

        def loss(before, *a):
            def run():
                return LayerTaps.build(opt.estimator.build(*a), a).loss

            return loss_state.second_run(run, loss_state.written(opt.registration), before)

        fn = self._replica_fn("loss", loss)
        losses = self.strategy.run(fn, args=(self._loss_state_before,) + tuple(args))
        return self.strategy.reduce(self._loss_op, losses, axis=None)

    def fisher_forms(self, args, vectors, forward=None):
        """``(forms, part)``: ``[[u_a . F u_b]]``, ``F`` the exact Fisher of the
        whole batch (the replicas' per-example means, averaged), and None; with
        ``qmodel_batch_fraction`` < 1, of each replica's first examples, and
        their ``exact_fisher.Part`` averaged over the replicas; ``forward`` is
        not used (each replica runs its own forward pass)."""
        n = len(vectors)
        partial = self.opt.qmodel_batch_fraction < 1

        def local(vectors, *a):
            opt = self.opt
            forms, part = exact_fisher.batch_forms(opt.fn, opt.estimator.build(*a), a, vectors,
                                                   opt.qmodel_batch_fraction)
            forms = tf.cast(tf.stack([tf.stack(row) for row in forms]), tf.float64)
            return (forms, tf.stack([part.loss] + list(part.linear))) if partial else (forms,)

        fn = self._replica_fn(f"fisher_forms_{n}", local)
        per_replica = self.strategy.run(fn, args=(list(vectors),) + tuple(args))
        forms, *own = (self.strategy.reduce(MEAN, t, axis=None) for t in per_replica)
        matrix = [[forms[a, b] for b in range(n)] for a in range(n)]
        if not own:
            return matrix, None
        return matrix, exact_fisher.Part(own[0][0], [own[0][1 + a] for a in range(n)])
