"""The ``train_function`` that ``kg.KFACModel`` and ``kg.DPModel`` give Keras:
Python drives the steps (so that what a step reports outside the graph,
such as epsilon, can join the logs), each step one call of the model's own
compiled ``train_step``; ``steps_per_execution`` batches per call."""
import tensorflow as tf


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
