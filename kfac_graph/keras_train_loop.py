"""The ``train_function`` that ``kg.KFACModel`` and ``kg.DPModel`` give Keras:
Python drives the steps (so that what a step reports outside the graph,
such as epsilon, can join the logs), each step one call of the model's own
compiled ``train_step``; ``steps_per_execution`` batches per call. Also
their build before the first step under a strategy (``symbolic_build``),
and the Keras plumbing both wrappers share (``WrapperPlumbing``)."""
import tensorflow as tf


class WrapperPlumbing:
    """Mixin for the wrappers (a ``keras.Model`` holding the trained model as
    ``self.model``): ``call`` and ``export`` are the wrapped model's (the
    artifact serves without kfac_graph); Keras's build under a strategy is
    ``symbolic_build``'s; the ``train_function`` is ``python_driven``."""

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def export(self, filepath, *args, **kwargs):
        """Keras's ``export`` of the wrapped model, whose ``call`` this is."""
        return self.model.export(filepath, *args, **kwargs)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if self._distribute_strategy is None or iterator is None:
            return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)
        symbolic_build(self, iterator)

    def make_train_function(self, force=False):
        if self.train_function is None or force:
            self.train_function = python_driven(self)
        return self.train_function


def python_driven(model):
    """``function(iterator) -> logs`` running ``model.train_step`` on up to
    ``model.steps_per_execution`` batches; ``StopIteration`` when none is left."""
    def function(iterator):
        logs = None
        for _, data in zip(range(model.steps_per_execution), iterator):
            data = tf.nest.map_structure(
                lambda t: None if isinstance(t, tf.experimental.Optional) else t, data)
            logs = model.train_step(data)
        if logs is None:
            raise StopIteration
        return logs
    return function


def log_output_losses(model, y, y_pred, sample_weight=None, live=None):
    """Keras logs each output's unweighted loss (``{output}_loss``) beside
    the total where a model has several, from trackers its compiled loss
    updates when called. The wrappers' steps take their gradient elsewhere,
    so they call it on the step's predictions (the ``live`` rows only: a
    Poisson batch's padding dropped); before, those logs showed 0 or what
    the last ``evaluate`` left."""
    compiled = getattr(model, "_compile_loss", None)
    if compiled is None or y_pred is None or len(tf.nest.flatten(y_pred)) < 2:
        return
    if live is not None:
        keep = tf.cast(live, tf.bool)
        y, y_pred, sample_weight = tf.nest.map_structure(
            lambda t: None if t is None else tf.boolean_mask(t, keep), (y, y_pred, sample_weight))
    names = list(getattr(model, "output_names", None) or ())
    if isinstance(y_pred, (list, tuple)):  # targets or weights by output name, as fit takes them
        y, sample_weight = (
            [t[n] for n in names] if isinstance(t, dict) and set(names) <= set(t) else t
            for t in (y, sample_weight))
    compiled(y, y_pred, sample_weight)


def symbolic_build(model, iterator):
    """Keras's build before the first step under ``model``'s strategy, from
    one local replica's share of the first batch of ``iterator`` (Keras's
    ``TFEpochIterator``): Keras 3.15 reduces the batch across the replicas
    for it, which fails under ``MultiWorkerMirroredStrategy`` (for any
    model; the workers' shares may differ in size)."""
    strategy = model._distribute_strategy
    data_batch = None
    for _, _, it in iterator:
        data_batch = tf.nest.map_structure(
            lambda v: strategy.experimental_local_results(v)[0]
            if isinstance(v, tf.distribute.DistributedValues) else v, next(it))
        break
    with strategy.scope():
        model._symbolic_build(data_batch=data_batch)
