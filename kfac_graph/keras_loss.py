"""A Keras loss as the callable the registered loss functions of
``kg.KFACModel`` and ``kg.DPModel`` call."""
from __future__ import annotations

import keras
import tensorflow as tf


class _NamedLoss(keras.losses.Loss):
    """A Keras loss function as a ``keras.losses.Loss`` (``call`` is the
    function; the default reduction averages every element)."""

    def __init__(self, fn, name):
        super().__init__(name=name)
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(y_true, y_pred)


def as_loss(loss):
    """A callable ``(y_true, y_pred) -> scalar``; returns ``(callable, keras_loss)``
    where ``keras_loss`` is what ``compile`` passes to Keras (for evaluate)."""
    if loss is None:
        raise ValueError("the model needs a loss: give loss= to the constructor or to "
                         "compile()")
    obj = keras.losses.get(loss) if isinstance(loss, (str, dict)) else loss
    if isinstance(loss, str) and not isinstance(obj, keras.losses.Loss):
        # a loss named as compile() takes it: wrapped as Keras wraps it (a mean
        # over every element, taking sample weights)
        obj = _NamedLoss(obj, loss)
    if isinstance(obj, keras.losses.Loss):
        return obj, obj
    if not callable(obj):
        raise ValueError(f"loss must be a keras loss, its name, or fn(y_true, y_pred); got {loss!r}")

    def mean_loss(y_true, y_pred):
        value = obj(y_true, y_pred)
        return tf.reduce_mean(value) if value.shape.rank else value

    return mean_loss, obj
