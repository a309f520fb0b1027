"""Train a Keras 3 model with DP-SGD through ``model.fit``.

    dp = kg.DPModel(model, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    l2_norm_clip=1.0, noise_multiplier=1.1, delta=1e-5)
    dp.compile(optimizer=keras.optimizers.SGD(0.5), metrics=["accuracy"])
    dp.fit(x, y, batch_size=64, epochs=20, callbacks=[...])   # logs epsilon
    dp.evaluate(x_test, y_test); dp.epsilon(); print(dp.privacy_statement())

``DPModel`` is a ``keras.Model`` wrapping ``model`` (``call`` delegates to
it). Its step privatises the gradient of ``loss(x, y) = loss_obj(y,
model(x, training=True))`` (``kg.dp_gradients``: clipping, mask, noise,
normalisation; a model overriding ``compute_loss`` trains on it,
``keras_compute_loss.py``) and hands it to the compiled Keras optimizer (any of them:
SGD, Adam, ...; optimizers only post-process the private gradient). The
constructor's keywords are ``kg.DPSGD``'s (``clipping``,
``automatic_clipping``, ``seed``, ``secure_mode``, ``method``).

Sampling and accounting:

- ``fit(x, y, batch_size=b)`` with arrays draws Poisson batches at rate
  ``b / N`` (``kg.privacy.poisson_batches``; ``sampling="fixed"`` in the
  constructor draws fixed-size batches instead), ``floor(N / b)`` steps per
  epoch (so ``E`` epochs stay within what ``noise_for_epsilon(epochs=E)``
  planned); Keras's ``shuffle`` is not used.
- ``fit(dataset)`` with a dataset from ``poisson_batches`` /
  ``fixed_size_batches`` reads its sampler (``dataset.privacy_sampling``);
  for another dataset give ``sample_rate`` / ``num_examples`` and
  ``batch_size`` to the constructor, which then vouches for the sampler.
- Poisson batches come as ``(x, y, mask)``: the mask arrives as Keras's
  ``sample_weight``, is taken as the padding mask (padded examples count for
  nothing), and the mean divides by the expected batch size ``qN``.
- ``fit(x, y, sample_weight=w)`` on arrays (per example, or per token: a
  causal LM's padding mask ``[B, T]``) samples the weights with their
  examples and gives them to the Keras loss, ``loss(y, y_pred,
  sample_weight=w)``: each example's clipped gradient is that of its own
  weighted terms. The batches carry ``(w, mask)`` as their third element.
  ``class_weight``, and ``sample_weight`` with a dataset, are refused.
- Epsilon at ``delta`` (default 1e-5) for the steps taken
  (``optimizer.iterations``, saved with checkpoints) is in the logs as
  ``epsilon`` after every step, so the progress bar, ``History`` and
  ``TensorBoard`` show it; ``accountant="pld"`` logs it at the end of each
  epoch only (each PLD evaluation takes about a second).
- A ``fit`` whose sampler differs from the last one's (another batch size,
  another number of examples) starts a phase: epsilon composes every
  phase's steps at its own rate (``privacy/ledger.py``; saved with the
  model's config), and a switch between Poisson and fixed-size sampling is
  refused.

The logged ``loss`` and metrics are computed on the training batch at the
weights before the update (one extra forward pass in a
``keras.StatelessScope``, real examples only): they are *not* private. The
loss holds the model's own losses (``add_loss`` terms, weight and activity
regularizers), as Keras logs it and as the gradient holds them.
Checkpoints (``ModelCheckpoint``, ``.weights.h5`` or ``.keras``) hold the
model's and optimizer's variables; the noise generator's state is never
saved (``privacy/noise.py``). Under ``MirroredStrategy`` or
``MultiWorkerMirroredStrategy`` (the model and the DPModel made in its
scope) each replica clips its share of the batch and adds ``1 / R`` of one
noise, drawn from replica 0's key, and of a penalty's gradient; a mean
divides by all replicas' examples, and the optimizer sums the replicas: one
device's step (``privacy/replicas.py``: what the workers agree on). Other
strategies are refused in one line.
"""
from __future__ import annotations

import contextlib
import inspect
import warnings

import keras
import tensorflow as tf

from kfac_graph.auto_register import auto_register
from kfac_graph import keras_compute_loss as own, keras_train_loop, options, relaxed_shapes
from kfac_graph.keras_loss import OutputsLoss, as_loss as _as_loss
from kfac_graph.privacy.privatize import OPTIONS, check_clip, privatize
from kfac_graph.privacy import accounting, replicas
from kfac_graph.privacy.ledger import Ledger, LedgerAccounting
from kfac_graph.privacy.noise import NoiseSource
from kfac_graph.privacy.sampling import check_padding_mask, sample_arrays


@keras.saving.register_keras_serializable(package="kfac_graph")
class DPModel(LedgerAccounting, keras_train_loop.WrapperPlumbing, own.ModelComputeLoss,
              keras.Model):
    """``model`` trained by DP-SGD through ``fit`` (see the module docstring)."""

    def __init__(self, model, loss=None, l2_norm_clip=1.0, noise_multiplier=1.0, *,
                 delta: float = 1e-5, accountant: str = "rdp", clipping="flat",
                 automatic_clipping: bool = False, seed: int | None = None,
                 secure_mode: bool = False, method: str = "auto", sampling="poisson",
                 sample_rate: float | None = None, num_examples: int | None = None,
                 batch_size: float | None = None, loss_kind: str | None = None, name=None,
                 privacy_phases=()):
        if not isinstance(model, keras.Layer):  # a Keras 2 (tf_keras) model: its variables
            # are not Keras 3's, which the wrapper's optimizer applies the gradient to
            raise TypeError(f"kg.DPModel wraps a Keras 3 model, got a "
                            f"{type(model).__module__}.{type(model).__name__}; train a Keras 2 "
                            "(tf_keras) model with kg.DPSGD on a kg.auto_register loss")
        options.check_all("kg.DPModel", OPTIONS, dict(
            noise_multiplier=noise_multiplier, method=method,
            **({} if seed is None else {"seed": seed})))
        check_clip("kg.DPModel", clipping, l2_norm_clip)
        if accountant not in accounting.ACCOUNTANTS:
            raise ValueError(f"kg.DPModel: accountant must be one of {accounting.ACCOUNTANTS}, "
                             f"got {accountant!r}")
        if not 0.0 < delta < 1.0:
            raise ValueError(f"kg.DPModel: delta must be in (0, 1), got {delta!r}")
        super().__init__(name=name or f"dp_{model.name}")
        self.model = model
        self._ledger = Ledger.from_config(privacy_phases)  # phases of other samplers
        self.l2_norm_clip = l2_norm_clip
        self.noise_multiplier = noise_multiplier
        self.delta = float(delta)
        self.accountant = accountant
        self.clipping = clipping
        self.automatic_clipping = bool(automatic_clipping)
        self.method = method
        self.loss_kind = loss_kind
        self.sampler_kind = sampling
        self.noise = NoiseSource(seed, secure_mode)
        self.sampling = None
        if sample_rate is not None or num_examples is not None or batch_size is not None:
            self.sampling = accounting.Sampling.make(sampling, sample_rate, num_examples,
                                                     batch_size)
        self._loss_spec, self._own_loss = None, False  # (own: the model's compute_loss)
        self._loss_weights = None  # compile()'s, per output
        self._step_function = None
        if loss is not None or own.uses_compute_loss(model, None):
            self._set_loss(loss)
        if model.built:
            self.built = True

    def compile(self, optimizer="sgd", loss=None, metrics=None, **kwargs):
        """Keras's ``compile``; ``optimizer`` applies the private gradient.
        ``loss`` replaces the constructor's."""
        weights = kwargs.get("loss_weights")
        if loss is not None or weights != self._loss_weights:
            self._loss_weights = weights
            self._set_loss(loss if loss is not None else self._loss_spec)
        if self._loss_spec is None and not self._own_loss:
            _as_loss(None)  # raises: no loss
        replicas.check_strategy(self._distribute_strategy, self.model)
        kwargs.setdefault("jit_compile", False)
        if getattr(self.model, "output_names", None):  # Keras maps a loss per output by them
            self.output_names = list(self.model.output_names)
        super().compile(optimizer=optimizer, loss=self._keras_loss, metrics=metrics, **kwargs)
        self._step_function = None

    def get_compile_config(self):
        config = dict(super().get_compile_config() or {})
        config.pop("loss", None)
        return config

    def compile_from_config(self, config):
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**{k: v for k, v in config.items() if k != "loss"})
        if self.built and self.optimizer is not None:
            self.optimizer.build(self.trainable_variables)

    def get_config(self):
        return {"name": self.name, "model": keras.saving.serialize_keras_object(self.model),
                "loss": keras.saving.serialize_keras_object(self._loss_spec),
                "l2_norm_clip": self.l2_norm_clip, "noise_multiplier": self.noise_multiplier,
                "delta": self.delta, "accountant": self.accountant,
                "clipping": self.clipping, "automatic_clipping": self.automatic_clipping,
                "method": self.method, "sampling": self.sampler_kind,
                "loss_kind": self.loss_kind, "privacy_phases": self._ledger.to_config(),
                **({} if self.sampling is None else {
                    "sample_rate": self.sampling.rate,
                    "num_examples": self.sampling.num_examples,
                    "batch_size": self.sampling.batch_size})}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(config.pop("model"),
                                                      custom_objects=custom_objects)
        loss = keras.saving.deserialize_keras_object(config.pop("loss"),
                                                     custom_objects=custom_objects)
        return cls(model, loss=loss, **config)

    # -- data ---------------------------------------------------------------------------
    def fit(self, x=None, y=None, batch_size=None, epochs=1, callbacks=None,
            validation_split=0.0, validation_data=None, **kwargs):
        """Keras's ``fit`` with DP sampling (module docstring)."""
        replicas.check_validation(self._distribute_strategy, validation_split, validation_data)
        weights = kwargs.pop("sample_weight", None)
        streamed = isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)) or (
            inspect.isgenerator(x))  # batches as they come, not arrays to sample from
        if kwargs.get("class_weight") is not None or (weights is not None and streamed):
            raise ValueError("kg.DPModel.fit: class_weight, and sample_weight with a dataset, "
                             "are not supported (give arrays and sample_weight=, or train with "
                             "kg.DPSGD on a kg.auto_register loss that takes the weights)")
        if streamed:
            sampling = getattr(x, "privacy_sampling", None)
            replicas.check_sampler(self._distribute_strategy, x)  # (workers: the same batches)
            if sampling is not None:
                self._use_sampling(sampling)
            elif self.sampling is None:
                warnings.warn("kg.DPModel.fit: the dataset does not say how it was sampled, "
                              "so no epsilon is logged; use kg.privacy.poisson_batches or "
                              "give sample_rate= to DPModel", stacklevel=2)
        elif x is not None:
            if y is None:
                raise ValueError("kg.DPModel.fit needs targets y")
            x, validation_data = sample_arrays(
                (x, y) if weights is None else (x, y, weights), batch_size or 32,
                self.sampler_kind, validation_split, validation_data,
                seed=replicas.sampler_seed(self._distribute_strategy))
            replicas.check_sampler(self._distribute_strategy, x)
            sampling = x.privacy_sampling
            if weights is not None:  # the weights and the mask (Poisson's) as one element
                x = x.map(lambda x, y, w, *mask: (x, y, (w, *mask)))
            self._use_sampling(sampling)
            y, batch_size = None, None
        kwargs["shuffle"] = False  # the sampler draws the batches
        callbacks = list(callbacks or [])
        if self.sampling is not None and self.accountant == "pld":
            callbacks.insert(0, _EpochEpsilon(self))
        return super().fit(x, y, batch_size=batch_size, epochs=epochs, callbacks=callbacks,
                           validation_data=validation_data, **kwargs)

    # -- training -----------------------------------------------------------------------
    def _set_loss(self, loss):
        inner = self.model
        self._own_loss = own.uses_compute_loss(inner, loss, self._loss_weights, "kg.DPModel")
        loss_fn, keras_loss = (own.loss_function(inner), None) if self._own_loss else _as_loss(
            loss, getattr(inner, "output_names", None) or (), self._loss_weights)
        per_example = (loss_fn.per_example if isinstance(loss_fn, OutputsLoss) else
                       keras_loss.call if isinstance(keras_loss, keras.losses.Loss) else keras_loss)

        def dp_loss(x, y, *sample_weight):  # the weights, where fit has them
            value = loss_fn(y, inner(x, training=True), *sample_weight)
            if inner.losses:
                value = value + tf.add_n([tf.cast(v, value.dtype) for v in inner.losses])
            return value

        dp_loss.__name__ = f"{inner.name}_loss"
        dp_loss = loss_fn if self._own_loss else dp_loss
        self._loss_spec, self._keras_loss, self._per_example_loss = loss, keras_loss, per_example
        self._outputs_loss = loss_fn if isinstance(loss_fn, OutputsLoss) else None
        self.loss_fn = auto_register(dp_loss, loss=self.loss_kind)
        self._step_function = None

    def train_step(self, data):
        x, y, mask = keras.utils.unpack_x_y_sample_weight(data)
        weights = ()
        if isinstance(mask, tuple):  # fit's arrays with sample weights: (w,) or (w, mask)
            weights, mask = mask[:1], (mask[1] if len(mask) > 1 else None)
            if not self._own_loss and not isinstance(self._keras_loss, keras.losses.Loss) and not (
                    self._outputs_loss and all(isinstance(fn, keras.losses.Loss)
                                               for fn in self._outputs_loss.fns)):
                raise ValueError("kg.DPModel.fit: sample_weight needs a keras.losses.Loss (a "
                                 "loss given as fn(y_true, y_pred) takes none)")
        if y is None:
            raise ValueError("kg.DPModel.fit needs targets y")
        strategy = self._distribute_strategy  # (None, or the one the model was made under)
        local = strategy.experimental_local_results if strategy is not None else (
            lambda t: (t,))
        for part in local(mask):
            check_padding_mask(part, self.sampling)
        first = lambda t: tf.nest.map_structure(lambda v: local(v)[0], t)  # noqa: E731
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            if not self.model.built:  # (a Sequential without an Input): its variables first
                self.model(first(x), training=False)
            if self._step_function is None and not self.optimizer.built:
                self.optimizer.build(self.trainable_variables)
        key = self.noise.next_key()
        args = (x, y, key) if mask is None and not weights else (x, y, key, mask, *weights)
        # the pass runs eagerly, not inside strategy.run's trace: at the first shape, and
        # under a strategy at each shape traced at its own sizes (a relaxed step's check
        # registers one replica's share at the sizes left unknown)
        first_call = self._step_function is None
        if first_call:
            self._step_function = self._make_step(strategy)
        if first_call or (strategy is not None and (
                self.run_eagerly or self._step_function.takes_exact(*args))):
            self.loss_fn.registration(*first((x, y, *weights)))
        logs = self._step_function(*args)
        logs = dict(logs if strategy is None else self.get_metrics_result())
        if self.sampling is not None and self.accountant == "rdp":
            logs["epsilon"] = self.epsilon()
        return logs

    def _make_step(self, strategy):
        """The step, relaxed for batches of new shapes (``relaxed_shapes``; under a
        strategy its per-replica values, the loss checked on one replica's share)."""
        step = self._dp_step if strategy is None else (
            lambda *a: strategy.run(self._dp_step, args=a))
        if self.run_eagerly:
            return step
        # the step's (x, y, key[, mask, *weights]): the loss's (x, y, *weights)
        check = relaxed_shapes.kinds_check(
            self.loss_fn, lambda s: relaxed_shapes.one_share((*s[:2], *s[4:])))
        scope = strategy.scope if strategy is not None else contextlib.nullcontext

        def in_scope(first, specs):
            with scope():
                return check(first, specs)
        return relaxed_shapes.Relaxed(step, in_scope, "kg.DPModel.fit", autograph=False)

    def _dp_step(self, x, y, key, mask=None, *weights):
        if self._own_loss:  # the model's compute_loss at the real rows, before the update
            logged = own.loss_at_live_rows(self.model, x, y, mask, *weights)
        else:
            with keras.StatelessScope(collect_losses=True) as scope:  # add_loss terms
                y_pred = self.model(x, training=True)
            penalties = [tf.cast(v, tf.float32) for v in list(scope.losses) + [
                v.regularizer(v) for v in self.model.trainable_weights
                if getattr(v, "regularizer", None) is not None]]
        expected = self.sampling.batch_size if mask is not None else None
        if mask is not None and expected is None:
            raise ValueError("kg.DPModel: padded Poisson batches need the expected batch size "
                             "(num_examples= and batch_size=, or sample_rate= with "
                             "num_examples=)")
        # one noise (replica 0's key), 1/R of it on each replica's clipped sum; the
        # optimizer sums the replicas' gradients, and a mean divides by all examples
        key, share, total = replicas.replica_terms(key, x)
        _, grads = privatize(self.loss_fn, x, y, *weights, l2_norm_clip=self.l2_norm_clip,
                             noise_multiplier=self.noise_multiplier, seed=key,
                             method=self.method, clipping=self.clipping,
                             automatic_clipping=self.automatic_clipping, mask=mask,
                             expected_batch_size=expected, owner="kg.DPModel", share=share,
                             batch_total=total)
        reg = self.loss_fn.registration(x, y, *weights)
        by_ref = {v.ref(): g for v, g in zip(reg.variables, grads)}
        pairs = []
        for kv in self.trainable_variables:
            g = by_ref.get(_tf_variable(kv).ref())
            if g is not None:
                pairs.append((tf.cast(g, kv.dtype), kv))
        # under mixed_float16 Keras wraps the optimizer in a LossScaleOptimizer, which
        # divides by its scale: the private gradient is of the unscaled loss
        getattr(self.optimizer, "inner_optimizer", self.optimizer).apply_gradients(pairs)
        if self._own_loss:
            return own.log_step(self, *logged)
        return self._step_logs(x, y, y_pred, mask, *weights,
                               penalty=tf.add_n(penalties) if penalties else 0.0)

    def _step_logs(self, x, y, y_pred, mask, *sample_weight, penalty=0.0):
        keras_train_loop.log_output_losses(self, y, y_pred, *sample_weight[:1], live=mask)
        if self._outputs_loss is not None:  # each output's loss times its weights
            values = self._outputs_loss.per_example(y, y_pred, *sample_weight)
            metric_weight = sample_weight[0] if sample_weight else mask
            if sample_weight and mask is not None:
                live = tf.cast(mask, values.dtype)
                metric_weight = tf.nest.map_structure(
                    lambda w: tf.cast(w, live.dtype) * _trailing(live, w.shape.rank),
                    sample_weight[0])
            sample_weight = ()
        else:
            values = tf.convert_to_tensor(self._per_example_loss(y, y_pred))
            metric_weight = mask
        if sample_weight:  # per example or per token, as the loss weighs them
            w = tf.cast(sample_weight[0], values.dtype)
            values = values * _trailing(w, values.shape.rank)
            metric_weight = w if mask is None else w * _trailing(
                tf.cast(mask, w.dtype), w.shape.rank)
        if values.shape.rank > 1:
            values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
        weights = tf.ones_like(values) if mask is None else tf.cast(mask, values.dtype)
        count = tf.reduce_sum(weights)
        loss = tf.reduce_sum(values * weights)
        if getattr(self._keras_loss, "reduction", None) != "sum":  # as the loss reduces
            loss = loss / tf.maximum(count, 1.0)
        loss += tf.cast(penalty, loss.dtype)  # what the gradient is of, as Keras logs it
        self._loss_tracker.update_state(loss, sample_weight=count)
        if mask is not None:  # a Poisson batch's padding dropped (plain metrics take no weight)
            x, y, y_pred, metric_weight = tf.nest.map_structure(
                lambda t: None if t is None else tf.boolean_mask(t, tf.cast(mask, tf.bool)),
                (x, y, y_pred, metric_weight))
        return self.compute_metrics(x, y, y_pred, sample_weight=metric_weight)


class _EpochEpsilon(keras.callbacks.Callback):
    """Adds PLD epsilon to each epoch's logs (before the progress bar and
    TensorBoard read them: it runs first)."""

    def __init__(self, dp_model):
        super().__init__()
        self._dp = dp_model

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["epsilon"] = self._dp.epsilon()


def _tf_variable(v):
    """The ``tf.Variable`` behind a Keras variable (the registration holds those)."""
    return getattr(v, "_value", v) if isinstance(v, keras.Variable) else v


def _trailing(t, rank):
    """``t`` with unit axes appended up to ``rank``."""
    return tf.reshape(t, tf.concat([tf.shape(t), tf.ones([rank - t.shape.rank], tf.int32)], 0))
