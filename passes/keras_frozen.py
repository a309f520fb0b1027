"""Variables a Keras 3 model has frozen (``layer.trainable = False``).

A Keras 3 variable wraps a ``tf.Variable`` made with the trainable flag the
Keras variable had at creation. Freezing a layer later (the fine-tuning
idiom ``backbone.trainable = False``) sets the Keras variable's flag alone:
the ``tf.Variable`` a traced function captures still says trainable, while
``model.trainable_variables`` leaves it out. ``frozen(variables)`` finds,
among captured ``tf.Variable`` objects, those whose Keras variable is not
trainable, so that the pass treats them as constants as Keras does (no
layer, no per-example gradient, no update).

The ``tf.Variable`` does not point back to its Keras variable, so the Keras
variables alive in the process are looked up once per call among the
objects the garbage collector tracks (a fraction of a second); nothing is
looked up where Keras is not imported or no captured variable is trainable.
A registration reads the flags when it is made: unfreezing a layer later
needs a new registration (a new ``kg.auto_register`` function), as Keras's
``fit`` needs ``make_train_function(force=True)``.
"""
from __future__ import annotations

import gc
import sys

import tensorflow as tf


@tf.autograph.experimental.do_not_convert  # plain Python, also when traced under autograph
def frozen(variables) -> set[int]:
    """``id``s of the trainable ``tf.Variable`` objects in ``variables``
    (under ``tf.distribute``, a replica's copy counts as its mirrored
    variable) whose Keras variable is not trainable."""
    keras = sys.modules.get("keras")
    keras_variable = getattr(keras, "Variable", None) if keras is not None else None
    ids = {}
    for v in variables:
        if v.trainable:
            container = getattr(v, "_distributed_container", None)
            ids[id(v)] = id(v)
            if container is not None:
                ids[id(container())] = id(v)
    if keras_variable is None or not ids:
        return set()
    out = set()
    for obj in gc.get_objects():
        if isinstance(obj, keras_variable) and not obj.trainable:
            inner = getattr(obj, "_value", None)
            if inner is not None and id(inner) in ids:
                out.add(ids[id(inner)])
    return out
