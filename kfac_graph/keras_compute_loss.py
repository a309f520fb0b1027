"""A wrapped model's own ``compute_loss`` as the loss of ``kg.KFACModel`` and
``kg.DPModel``.

A Keras model whose class overrides ``compute_loss`` (keras-hub's
``RetinaNetObjectDetector`` turns ``{"boxes", "labels"}`` targets into
per-anchor targets and weights there; a subclassed model adds an auxiliary
term) trains under Keras's ``fit`` on

    L(x, y, w) = model.compute_loss(x=x, y=y, y_pred=model(x, training=True),
                                    sample_weight=w)

and the wrappers, given no ``loss=`` (or the model's compiled loss itself,
``loss=model.loss``), train on the same function. Under ``tf.distribute``
Keras scales that value by ``1 / replicas`` (``scale_loss_for_distribution``,
for summed gradients) and logs it times ``replicas``; the wrappers' loss is
the value times ``replicas`` too (each replica's own loss; K-FAC and DP-SGD
average the replicas themselves). ``evaluate`` reports the model's
``compute_loss`` at ``training=False``, as Keras's does for the model.
"""
from __future__ import annotations

import inspect

import keras
import tensorflow as tf


def overrides_compute_loss(model) -> bool:
    """Whether ``model``'s class has its own ``compute_loss`` (not Keras's)."""
    method = getattr(type(model), "compute_loss", None)
    return method is not None and method is not keras.Model.compute_loss


def uses_compute_loss(model, loss, loss_weights=None, owner="") -> bool:
    """Whether a wrapper given ``loss`` trains on ``model.compute_loss``: the
    model overrides it and no other loss was given (``None``, or the model's
    own compiled loss). ``loss_weights`` (``compile``'s) are then refused."""
    own = overrides_compute_loss(model) and (
        loss is None or loss is getattr(model, "loss", None))
    if own and loss_weights is not None:
        raise ValueError(f"{owner}: loss_weights weigh the outputs' losses given as loss=; "
                         "without one the model trains on its own compute_loss")
    return own


def compute_loss(model, x, y, y_pred, sample_weight=None, training=True):
    """``model.compute_loss(...)`` as Keras's trainers call it (``training``
    only where its signature takes it); Keras's scaling under a strategy kept.
    It gets copies of the nests (RetinaNet's converts the boxes of ``y`` in
    place, which ``tf.function`` refuses for its arguments)."""
    x, y, sample_weight = tf.nest.map_structure(lambda t: t, (x, y, sample_weight))
    if "training" in inspect.getfullargspec(model.compute_loss).args:
        return model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                  training=training)
    return model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)


def unscaled(value):
    """``value`` times the replicas in sync: Keras's ``1 / replicas`` undone."""
    value = tf.convert_to_tensor(value)
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    return value * tf.cast(replicas, value.dtype) if replicas > 1 else value


def loss_function(model):
    """``fn(x, y, *sample_weight) -> scalar``: ``L`` above (unscaled), at
    ``model(x, training=True)``. The model's ``losses`` (``add_loss``,
    regularizers) are in it where its ``compute_loss`` adds them (Keras's
    does)."""
    def fn(x, y, *sample_weight):
        y_pred = model(x, training=True)
        return unscaled(compute_loss(model, x, y, y_pred, *(sample_weight or (None,))))

    fn.__name__ = f"{model.name}_compute_loss"
    return fn


def loss_at_live_rows(model, x, y, mask=None, sample_weight=None):
    """``(L, y_pred, x, y, sample_weight)`` at the rows ``mask`` keeps (all
    where ``None``: a Poisson batch's padding dropped), from one forward pass
    in a ``keras.StatelessScope`` (no state moves; the ``add_loss`` terms
    ``compute_loss`` reads are this pass's)."""
    if mask is not None:
        keep = tf.cast(mask, tf.bool)
        x, y, sample_weight = tf.nest.map_structure(
            lambda t: None if t is None else tf.boolean_mask(t, keep), (x, y, sample_weight))
    with keras.StatelessScope(collect_losses=True):
        y_pred = model(x, training=True)
        value = unscaled(compute_loss(model, x, y, y_pred, sample_weight))
    return value, y_pred, x, y, sample_weight


class ModelComputeLoss:
    """Mixin for the wrappers: where they train on the wrapped model's
    ``compute_loss`` (``self._own_loss``), Keras's ``evaluate`` (its
    ``test_step`` calls ``compute_loss``) reports that, not a compiled loss."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        if getattr(self, "_own_loss", False):
            return compute_loss(self.model, x, y, y_pred, sample_weight, training)
        return super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                    training=training)


def log_step(wrapper, value, y_pred, x, y, sample_weight=None):
    """Updates ``wrapper``'s loss tracker with ``value`` (weighted by the rows
    of ``x``) and its compiled metrics; returns the logs."""
    rows = tf.shape(tf.nest.flatten(x)[0])[0]
    wrapper._loss_tracker.update_state(value, sample_weight=rows)
    return wrapper.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
