"""A wrapped model's own ``compute_loss`` as the loss of ``kg.KFACModel`` and
``kg.DPModel``.

A Keras model whose class overrides ``compute_loss`` (keras-hub's
``RetinaNetObjectDetector`` turns ``{"boxes", "labels"}`` targets into
per-anchor targets and weights there; a subclassed model adds an auxiliary
term) trains under Keras's ``fit`` on

    L(x, y, w) = model.compute_loss(x=x, y=y, y_pred=model(x, training=True),
                                    sample_weight=w)

and the wrappers, given no ``loss=`` (or the model's compiled loss itself,
``loss=model.loss``), train on the same function. ``evaluate`` reports
``L`` at ``model(x, training=False)``, as Keras's does for the model.

Under ``tf.distribute`` Keras's mean losses and ``add_loss`` terms divide
themselves by the number of replicas ``R`` (``scale_loss_for_distribution``,
for a sum of the replicas' gradients), a summed loss or a term the override
computes itself does not, and Keras logs ``R`` times the whole: a model
mixing them logs neither the one-device loss nor a consistent one. Here
``L`` is computed as one device computes it (``passes.frontends.one_device``
hides the strategy; the registration is traced so too), so the wrappers'
step, logged and evaluated losses are the one-device ones; K-FAC and DP-SGD
reduce the replicas themselves.
"""
from __future__ import annotations

import inspect

import keras
import tensorflow as tf

from passes.frontends import one_device


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


def one_device_loss(model, x, y, y_pred, sample_weight=None, training=True):
    """``compute_loss`` as one device computes it (no ``1 / R`` anywhere)."""
    with one_device():
        return tf.convert_to_tensor(compute_loss(model, x, y, y_pred, sample_weight, training))


def loss_function(model):
    """``fn(x, y, *sample_weight) -> scalar``: ``L`` above (one device's), at
    ``model(x, training=True)``. The model's ``losses`` (``add_loss``,
    regularizers) are in it where its ``compute_loss`` adds them (Keras's
    does)."""
    def fn(x, y, *sample_weight):
        y_pred = model(x, training=True)
        return one_device_loss(model, x, y, y_pred, *(sample_weight or (None,)))

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
        value = one_device_loss(model, x, y, y_pred, sample_weight)
    return value, y_pred, x, y, sample_weight


class ModelComputeLoss:
    """Mixin for the wrappers: where they train on the wrapped model's
    ``compute_loss`` (``self._own_loss``), Keras's ``evaluate`` (its
    ``test_step`` calls ``compute_loss``) reports that, not a compiled loss:
    one device's value over ``R`` (Keras's ``test_step`` multiplies by
    ``R``), so each replica logs its share's one-device loss."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        if getattr(self, "_own_loss", False):
            value = one_device_loss(self.model, x, y, y_pred, sample_weight, training)
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            return value / tf.cast(replicas, value.dtype) if replicas > 1 else value
        return super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                    training=training)


def log_step(wrapper, value, y_pred, x, y, sample_weight=None):
    """Updates ``wrapper``'s loss tracker with ``value`` (weighted by the rows
    of ``x``) and its compiled metrics; returns the logs."""
    rows = tf.shape(tf.nest.flatten(x)[0])[0]
    wrapper._loss_tracker.update_state(value, sample_weight=rows)
    return wrapper.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
