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


class OutputsLoss:
    """One loss per output of a model with several, as ``compile`` takes
    them: a list or tuple in the outputs' order, or a dict by output name
    (``output_names``: the model's, for predictions that come as a list).
    Called (with sample weights per output, or one array for all), the sum
    of the outputs' losses, each times its ``loss_weights`` entry (a list, or
    a dict by output name, as ``compile`` takes them); ``pairs(y_true, y_pred)`` gives ``(loss,
    y_true, y_pred)`` per output and ``per_example`` each example's summed
    over the outputs."""

    def __init__(self, losses, output_names=(), loss_weights=None):
        self.names = list(losses) if isinstance(losses, dict) else None
        self.fns = [as_loss(loss)[0] for loss in
                    (losses.values() if isinstance(losses, dict) else losses)]
        self.output_names = list(output_names)
        self.weights = [1.0] * len(self.fns)
        if isinstance(loss_weights, dict):  # by output name, as compile() takes them
            names = self.names or self.output_names
            unknown = [n for n in loss_weights if n not in names]
            if unknown:
                raise ValueError(f"loss_weights names output {unknown[0]!r}, not one of {names}")
            self.weights = [float(loss_weights.get(n, 1.0)) for n in names]
        elif loss_weights is not None:
            if len(loss_weights) != len(self.fns):
                raise ValueError(f"{len(loss_weights)} loss_weights for {len(self.fns)} losses")
            self.weights = [float(w) for w in loss_weights]

    def _by_output(self, value, what):
        if self.names is None:
            return list(value)
        if isinstance(value, dict):
            missing = [n for n in self.names if n not in value]
            if missing:
                raise ValueError(f"the loss names output {missing[0]!r}, which the {what} lack")
            return [value[n] for n in self.names]
        order = {n: k for k, n in enumerate(self.output_names)}
        unknown = [n for n in self.names if n not in order]
        if unknown:
            raise ValueError(f"the loss names output {unknown[0]!r}, not one of the model's "
                             f"{self.output_names}")
        return [list(value)[order[n]] for n in self.names]

    def pairs(self, y_true, y_pred):
        trues, preds = self._by_output(y_true, "targets"), self._by_output(y_pred, "predictions")
        if not len(trues) == len(preds) == len(self.fns):
            raise ValueError(f"{len(self.fns)} losses for {len(preds)} outputs and "
                             f"{len(trues)} targets")
        return list(zip(self.fns, trues, preds))

    def values(self, y_true, y_pred, sample_weight=None):
        """``[(loss, value)]`` per output, each loss given its output's sample
        weights: ``sample_weight`` a list or dict by output, as Keras's ``fit``
        takes them, or one array for every output; each loss must then be a
        ``keras.losses.Loss``."""
        pairs = self.pairs(y_true, y_pred)
        if sample_weight is None:
            return [(fn, k * fn(t, p)) for (fn, t, p), k in zip(pairs, self.weights)]
        weights = self._weights(sample_weight, len(pairs))
        plain = [fn for fn, _, _ in pairs if not isinstance(fn, keras.losses.Loss)]
        if plain:
            raise ValueError(f"sample weights need a keras.losses.Loss per output; {plain[0]} "
                             "takes none")
        return [(fn, k * (fn(t, p) if w is None else fn(t, p, sample_weight=w)))
                for (fn, t, p), w, k in zip(pairs, weights, self.weights)]

    def __call__(self, y_true, y_pred, sample_weight=None):
        return tf.add_n([value for _, value in self.values(y_true, y_pred, sample_weight)])

    def per_example(self, y_true, y_pred, sample_weight=None):
        """``[B]``: each example's loss summed over the outputs (each output's
        per-example values, times its sample weights where given, averaged
        over their other axes)."""
        pairs = self.pairs(y_true, y_pred)
        values = []
        for (fn, t, p), w, k in zip(pairs, self._weights(sample_weight, len(pairs)),
                                    self.weights):
            v = tf.convert_to_tensor(fn.call(t, p) if isinstance(fn, keras.losses.Loss)
                                     else fn(t, p))
            if w is not None:
                w = tf.cast(w, v.dtype)
                v = v * tf.reshape(w, tf.concat([tf.shape(w), tf.ones(
                    [v.shape.rank - w.shape.rank], tf.int32)], 0))
            values.append(k * (tf.reduce_mean(v, axis=list(range(1, v.shape.rank)))
                               if v.shape.rank > 1 else v))
        return tf.add_n(values)

    def _weights(self, sample_weight, n):
        if sample_weight is None:
            return [None] * n
        if isinstance(sample_weight, (list, tuple, dict)):
            return self._by_output(sample_weight, "sample weights")
        return [sample_weight] * n  # one array for every output


def as_loss(loss, output_names=(), loss_weights=None):
    """A callable ``(y_true, y_pred) -> scalar``; returns ``(callable, keras_loss)``
    where ``keras_loss`` is what ``compile`` passes to Keras (for evaluate). A
    ``keras.losses.Loss`` with ``reduction=None`` or ``"none"`` is averaged
    over the batch, as ``fit`` averages it.
    A list, tuple or dict of losses (a model with several outputs) gives an
    ``OutputsLoss``."""
    if loss is None:
        raise ValueError("the model needs a loss: give loss= to the constructor or to "
                         "compile()")
    if isinstance(loss, (list, tuple)) or (isinstance(loss, dict) and "class_name" not in loss):
        return OutputsLoss(loss, output_names, loss_weights), loss
    if loss_weights is not None:
        raise ValueError("loss_weights weigh the losses of a model with several outputs; "
                         "scale a single loss in the loss itself")
    obj = keras.losses.get(loss) if isinstance(loss, (str, dict)) else loss
    if isinstance(loss, str) and not isinstance(obj, keras.losses.Loss):
        # a loss named as compile() takes it: wrapped as Keras wraps it (a mean
        # over every element, taking sample weights)
        obj = _NamedLoss(obj, loss)
    if isinstance(obj, keras.losses.Loss) and obj.reduction in (None, "none"):
        # unreduced (TensorFlow Privacy's tutorials ask for it): averaged, as fit averages it
        obj = type(obj).from_config({**obj.get_config(), "reduction": "sum_over_batch_size"})
    if isinstance(obj, keras.losses.Loss):
        return obj, obj
    if not callable(obj):
        raise ValueError(f"loss must be a keras loss, its name, or fn(y_true, y_pred); got {loss!r}")

    def mean_loss(y_true, y_pred):
        value = obj(y_true, y_pred)
        return tf.reduce_mean(value) if value.shape.rank else value

    return mean_loss, obj
