"""Train a Keras 3 model with K-FAC through ``model.fit``.

    kmodel = kg.KFACModel(model, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), learning_rate=0.1, damping=1e-3)
    kmodel.compile(metrics=["accuracy"])        # no optimizer argument
    kmodel.fit(x, y, batch_size=128, epochs=5, callbacks=[...])
    kmodel.evaluate(x, y); kmodel.predict(x)

``KFACModel`` is a ``keras.Model`` that wraps ``model`` (``call``
delegates to it). Its ``train_step`` builds, once, the ``kg.auto_register``ed
closure ``loss(x, y) = loss_obj(y, model(x, training=True)) (+ model.losses)``
and runs ``kg.KFAC.step(x, y)`` on it; every other keyword of the
constructor goes to ``kg.KFAC``. Progress bar, ``History``, ``EarlyStopping``,
``ModelCheckpoint``, ``TensorBoard``, ``LearningRateScheduler`` and
``ReduceLROnPlateau`` work as with any Keras optimizer; ``evaluate`` and
``predict`` are Keras's own.

Semantics:

- The logged ``loss`` is K-FAC's step loss, at the weights before the
  update, as in Keras's own ``train_step``. Compiled metrics are computed at
  the same weights from one extra forward pass in training mode, run in a
  ``keras.StatelessScope`` so batch-norm statistics and seeds move once per
  step. Without compiled metrics there is no extra pass.
- ``model.optimizer`` is a small Keras optimizer, ``KFACKerasOptimizer``
  (``keras_optimizer.py``), that never applies gradients: it carries
  ``iterations``, the ``learning_rate`` that callbacks read and set (copied
  into K-FAC's learning rate before every step; with
  ``momentum_type="qmodel"``, which chooses its own, the other way round,
  so the logs show the chosen step size, until the step hands over to
  regular momentum, ``qmodel_fallback.py``, which ``fit`` checks after each
  batch), and the ``kg.KFAC`` instance (``model.kfac``).
- ``sample_weight`` (per example ``[B]``, or per token ``[B, T]``: a
  keras-hub ``CausalLM``'s padding mask) and ``class_weight`` reach the
  Keras loss as its ``sample_weight``: K-FAC's loss is then ``loss(y,
  y_pred, sample_weight=w)``, which the pass reads as a weighted loss (each
  token's Fisher term scaled by its weight; README, "Per-token losses").
  Every batch of a ``fit`` must have weights, or none (K-FAC's state is
  built for one form); a loss given as ``fn(y_true, y_pred)`` takes none.
- Each step runs eagerly from Python around two compiled calls (the metric
  update and K-FAC's step); K-FAC decides its own XLA use
  (``jit_compile=``), Keras's ``jit_compile`` only affects evaluate/predict.
- Under ``strategy.scope()`` (``MirroredStrategy`` and the others
  ``kg.KFAC`` supports) ``fit`` feeds each replica its share of the batch;
  K-FAC's step is ``kg.KFAC``'s distributed one, the metrics are updated per
  replica and read across them.

What ``ModelCheckpoint`` saves (``.weights.h5`` or ``.keras``): the model's
weights, and under the optimizer's entry its ``iterations`` and
``learning_rate`` followed by every variable of the ``kg.KFAC`` module
(step counter, skipped steps, damping, learning rate, momentum, velocities
and the Fisher factors and their cached inverses, in ``tf.Module.variables``
order). Loading into a model whose K-FAC state is not built yet (before the
first step) keeps the values and assigns them when the first batch builds
it. ``tf.train.Checkpoint(model=kmodel)`` also reaches the K-FAC module
through ``kmodel.optimizer.kfac``.
"""
from __future__ import annotations

import inspect
import warnings

import keras
import tensorflow as tf

from kfac_graph import keras_train_loop
from kfac_graph.auto_register import auto_register
from kfac_graph.keras_compute_loss import ModelComputeLoss, loss_function, uses_compute_loss
from kfac_graph.keras_loss import OutputsLoss, as_loss as _as_loss
from kfac_graph.keras_optimizer import KFACKerasOptimizer
from kfac_graph.optimizer.kfac import KFAC
from kfac_graph.optimizer.qmodel_fallback import after_step as hand_over_when_due

__all__ = ["KFACModel", "KFACKerasOptimizer"]


def _kfac_default(name):
    return inspect.signature(KFAC.__init__).parameters[name].default


def _check_kfac_options(kfac_options: dict) -> None:
    """A one-line ``TypeError`` for a keyword ``kg.KFAC`` does not take, and
    ``kg.KFAC``'s own checks (``KFAC.OPTIONS``), named for ``kg.KFACModel``."""
    known = [k for k in inspect.signature(KFAC).parameters if k not in ("fn", "name")]
    unknown = sorted(set(kfac_options) - set(known))
    if unknown:
        raise TypeError(f"kg.KFACModel: unknown K-FAC option {unknown[0]!r}; "
                        f"kg.KFAC takes {', '.join(known)}")
    KFAC.check_options("kg.KFACModel", **kfac_options)


@keras.saving.register_keras_serializable(package="kfac_graph")
class KFACModel(keras_train_loop.WrapperPlumbing, ModelComputeLoss, keras.Model):
    """``model`` trained by K-FAC through ``fit`` (see the module docstring).

    ``loss``: a ``keras.losses.Loss``, a Keras loss name, or
    ``fn(y_true, y_pred)`` (reduced by a mean if it returns per-example
    values); may also be given to ``compile``. A model whose class overrides
    ``compute_loss`` (keras-hub's ``RetinaNetObjectDetector``, a subclassed
    model) trains, given no loss or its own compiled one, on
    ``model.compute_loss(x, y, model(x, training=True), sample_weight)``
    (``keras_compute_loss.py``). ``loss_kind``: passed to
    ``kg.auto_register(loss=...)`` when the pass cannot read the loss.
    ``**kfac_options``: ``kg.KFAC``'s keywords (``learning_rate``,
    ``damping``, ``momentum``, ``momentum_type``, ``estimation_mode``, ...),
    checked here by ``kg.KFAC``'s ranges (one-line ``ValueError``; an unknown
    keyword is a ``TypeError``).
    """

    def __init__(self, model, loss=None, loss_kind: str | None = None, name=None,
                 **kfac_options):
        _check_kfac_options(kfac_options)
        super().__init__(name=name or f"kfac_{model.name}")
        self.model = model
        self.loss_kind = loss_kind
        self.kfac_options = dict(kfac_options)
        self._loss_spec = loss
        self._kfac_built = False
        self._step_function = None
        self._loss_weights = None  # compile()'s, per output
        self._own_loss = False  # trains on the model's own compute_loss
        self._shim = KFACKerasOptimizer(
            learning_rate=kfac_options.get("learning_rate", _kfac_default("learning_rate")))
        if loss is not None or uses_compute_loss(model, None):
            self._make_kfac(loss)
        if model.built:
            self.built = True

    def fit(self, *args, callbacks=None, **kwargs):
        """Keras's ``fit``. Under ``momentum_type="qmodel"`` the step size is the
        quadratic model's: a callback that sets the learning rate
        (``LearningRateScheduler``, ``ReduceLROnPlateau``) changes nothing,
        and is warned of."""
        setters = [type(c).__name__ for c in callbacks or () if isinstance(c, (
            keras.callbacks.LearningRateScheduler, keras.callbacks.ReduceLROnPlateau))]
        momentum = (self.kfac.momentum_type if self.kfac is not None
                    else self.kfac_options.get("momentum_type", _kfac_default("momentum_type")))
        if setters and momentum == "qmodel":
            warnings.warn(f"KFACModel.fit: {setters[0]} sets a learning rate, which "
                          "momentum_type='qmodel' does not read (the quadratic model "
                          "chooses each step's size); use momentum_type='regular' for a "
                          "schedule", stacklevel=2)
        return super().fit(*args, callbacks=callbacks, **kwargs)

    @property
    def kfac(self):
        """The ``kg.KFAC`` instance (``None`` until a loss is known)."""
        return self._shim.kfac

    def compile(self, optimizer=None, loss=None, metrics=None, **kwargs):
        """Keras's ``compile`` without an optimizer (K-FAC is the optimizer).
        ``loss`` replaces the constructor's. ``jit_compile`` defaults to False and
        applies to evaluate/predict only. No loss scaling (``auto_scale_loss`` is
        False): ``optimizer`` is K-FAC's shim under every dtype policy."""
        if optimizer is not None and not isinstance(optimizer, KFACKerasOptimizer):
            raise ValueError("KFACModel trains with K-FAC: give K-FAC's options to "
                             "KFACModel(...), not an optimizer to compile()")
        weights = kwargs.get("loss_weights")
        if (loss is not None and loss is not self._loss_spec) or weights != self._loss_weights:
            if self.kfac is not None and self._kfac_built:
                warnings.warn("KFACModel.compile: a new loss starts a new K-FAC optimizer "
                              "(its statistics are lost)", stacklevel=2)
            self._loss_weights = weights
            self._make_kfac(loss if loss is not None else self._loss_spec)
        if self._loss_spec is None and not self._own_loss:
            _as_loss(None)  # raises
        kwargs.setdefault("jit_compile", False)
        # under mixed_float16 Keras wraps the optimizer in a LossScaleOptimizer; the shim
        # applies no gradient (K-FAC differentiates the loss itself), so the wrapper scaled
        # nothing and hid ``optimizer.kfac`` (and moved the checkpoint's K-FAC entry)
        kwargs["auto_scale_loss"] = False
        if getattr(self.model, "output_names", None):  # Keras maps a loss per output by them
            self.output_names = list(self.model.output_names)
        super().compile(optimizer=self._shim, loss=self._keras_loss, metrics=metrics, **kwargs)
        self._step_function = None

    def get_compile_config(self):
        config = dict(super().get_compile_config() or {})
        config.pop("optimizer", None)
        config.pop("loss", None)
        return config

    def compile_from_config(self, config):
        config = keras.saving.deserialize_keras_object(config)
        config = {k: v for k, v in config.items() if k not in ("optimizer", "loss")}
        self.compile(**config)

    def get_config(self):
        serializable = {k: v for k, v in self.kfac_options.items()
                        if isinstance(v, (bool, int, float, str, type(None)))}
        return {"name": self.name, "model": keras.saving.serialize_keras_object(self.model),
                "loss": keras.saving.serialize_keras_object(self._loss_spec),
                "loss_kind": self.loss_kind, **serializable}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(config.pop("model"),
                                                      custom_objects=custom_objects)
        loss = keras.saving.deserialize_keras_object(config.pop("loss"),
                                                     custom_objects=custom_objects)
        return cls(model, loss=loss, **config)

    # -- training -----------------------------------------------------------------------
    def _make_kfac(self, loss):
        inner = self.model
        self._own_loss = uses_compute_loss(inner, loss, self._loss_weights, "kg.KFACModel")
        loss_fn, keras_loss = (loss_function(inner), None) if self._own_loss else _as_loss(
            loss, getattr(inner, "output_names", None) or (), self._loss_weights)

        def kfac_loss(x, y, *sample_weight):  # the weights, where fit has them
            y_pred = inner(x, training=True)
            # (each output's loss as Keras scales it, OutputsLoss), traced as one device
            # traces it (passes.frontends.one_device): a Keras loss is not divided by
            # the replicas, K-FAC averages the replicas' (optimizer/distributed.py)
            value = loss_fn(y, y_pred, *sample_weight)
            if inner.losses:
                value = value + tf.add_n([tf.cast(v, value.dtype) for v in inner.losses])
            return value

        kfac_loss.__name__ = f"{inner.name}_loss"
        kfac_loss = loss_fn if self._own_loss else kfac_loss
        self._loss_spec = loss
        self._keras_loss = keras_loss
        self._outputs_loss = loss_fn if isinstance(loss_fn, OutputsLoss) else None
        self.loss_fn = auto_register(kfac_loss, loss=self.loss_kind)
        self._shim.kfac = KFAC(self.loss_fn, **self.kfac_options)
        self._shim.set_model_weights(inner.variables)
        self._kfac_built = False
        self._weighted = None  # whether the steps pass sample weights, once built
        self._step_function = None

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if y is None:
            raise ValueError("KFACModel.fit needs targets y")
        if self.kfac is None:
            _as_loss(None)
        weights = () if sample_weight is None else (sample_weight,)
        if weights and not self._own_loss and not isinstance(
                self._keras_loss, keras.losses.Loss) and not (
                self._outputs_loss and all(isinstance(fn, keras.losses.Loss)
                                           for fn in self._outputs_loss.fns)):
            raise ValueError("KFACModel.fit: sample_weight and class_weight need a "
                             "keras.losses.Loss (a loss given as fn(y_true, y_pred) takes none)")
        if self._kfac_built and self._weighted != bool(weights):
            raise ValueError("KFACModel.fit: every batch needs sample weights or none: K-FAC's "
                             f"state was built {'with' if self._weighted else 'without'} them")
        if not self._kfac_built:
            self._weighted = bool(weights)
            self.kfac.build(x, y, *weights)
            self._shim.restore_pending()
            self._kfac_built = True
        if self._step_function is None:
            step = self._kfac_step
            self._step_function = step if self.run_eagerly else tf.function(step)
        qmodel = self.kfac.momentum_type == "qmodel"
        logs = self._step_function(x, y, *weights)
        hand_over_when_due(self.kfac)  # a traced step cannot (qmodel_fallback.py)
        if qmodel and self.kfac.momentum_type != "qmodel":  # handed over, here or eagerly
            # the logs showed the model's step sizes; regular momentum takes the one given
            self._shim.learning_rate.assign(tf.cast(self.kfac.learning_rate,
                                                    self._shim.learning_rate.dtype))
            self._step_function = None  # traced anew
        return logs

    def _kfac_step(self, x, y, *weights):
        kfac = self.kfac
        if kfac.strategy is not None:
            return self._distributed_kfac_step(x, y, *weights)
        y_pred = None
        if self._compile_metrics is not None or self._outputs_loss is not None:
            with keras.StatelessScope():
                y_pred = self.model(x, training=True)
        if kfac.momentum_type != "qmodel":
            kfac.learning_rate.assign(tf.cast(self._shim.learning_rate, kfac.learning_rate.dtype))
        loss = kfac.step(x, y, *weights)
        if kfac.momentum_type == "qmodel":  # logs show the step size the model chose
            self._shim.learning_rate.assign(tf.cast(kfac.learning_rate,
                                                    self._shim.learning_rate.dtype))
        self._shim.iterations.assign_add(1)
        batch = tf.shape(tf.nest.flatten(x)[0])[0]
        self._loss_tracker.update_state(loss, sample_weight=batch)
        keras_train_loop.log_output_losses(self, y, y_pred, weights[0] if weights else None)
        return self.compute_metrics(x, y, y_pred, sample_weight=weights[0] if weights else None)

    def _distributed_kfac_step(self, x, y, *weights):
        """``_kfac_step`` under ``tf.distribute``: the metrics' forward pass and
        updates run per replica (on its share), K-FAC's step on all of them."""
        kfac, strategy = self.kfac, self.kfac.strategy
        y_pred = None
        if self._compile_metrics is not None or self._outputs_loss is not None:
            y_pred = strategy.run(self._metric_predictions, args=(x,))
        if kfac.momentum_type != "qmodel":
            kfac.learning_rate.assign(tf.cast(self._shim.learning_rate, kfac.learning_rate.dtype))
        loss = kfac.step(x, y, *weights)
        if kfac.momentum_type == "qmodel":
            self._shim.learning_rate.assign(tf.cast(kfac.learning_rate,
                                                    self._shim.learning_rate.dtype))
        self._shim.iterations.assign_add(1)
        strategy.run(self._update_metrics, args=(x, y, y_pred, loss, *weights))
        return self.get_metrics_result()

    def _metric_predictions(self, x):
        with keras.StatelessScope():
            return self.model(x, training=True)

    def _update_metrics(self, x, y, y_pred, loss, sample_weight=None):
        batch = tf.shape(tf.nest.flatten(x)[0])[0]
        self._loss_tracker.update_state(loss, sample_weight=batch)
        if y_pred is not None:
            keras_train_loop.log_output_losses(self, y, y_pred, sample_weight)
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
