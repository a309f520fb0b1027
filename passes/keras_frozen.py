"""Variables a Keras model has frozen (``layer.trainable = False``).

Keras 3: a Keras variable wraps a ``tf.Variable`` made with the trainable
flag the Keras variable had at creation. Freezing a layer later (the
fine-tuning idiom ``backbone.trainable = False``) sets the Keras variable's
flag alone: the ``tf.Variable`` a traced function captures still says
trainable, while ``model.trainable_variables`` leaves it out.

Keras 2 (``tf_keras``, TensorFlow's ``tf.keras`` under
``TF_USE_LEGACY_KERAS=1``): the flag is the layer's, not the variable's
(freezing a layer freezes its sublayers; ``trainable_weights`` of a frozen
layer is empty), so a variable held by a frozen layer (in its ``weights``)
is frozen.

``flags(variables)`` finds, among captured ``tf.Variable`` objects, those
that Keras leaves out of ``model.trainable_variables`` in either way, so
that the pass treats them as constants as Keras does (no layer, no
per-example gradient, no update); and the constraints Keras's optimizers
apply after each update (``kernel_constraint=...``), which ``kg.KFAC`` and
``kg.DPSGD`` apply too (``Registration.apply_constraints``).

Neither the variable nor its Keras variable points back to its owner, so
the Keras variables and Keras 2 layers alive in the process are looked up
once per call among the objects the garbage collector tracks (a fraction of
a second); nothing is looked up where neither Keras is imported or no
captured variable is trainable.
A registration reads the flags when it is made: unfreezing a layer later
needs a new registration (a new ``kg.auto_register`` function), as Keras's
``fit`` needs ``make_train_function(force=True)``.
"""
from __future__ import annotations

import gc
import sys
from typing import NamedTuple

import tensorflow as tf


class Flags(NamedTuple):
    frozen: set  # ids of variables Keras leaves out of trainable_variables
    overwritten: set  # ids of variables Keras overwrites with their "gradient"
    constraints: dict  # id -> the constraint Keras applies after each update


@tf.autograph.experimental.do_not_convert  # plain Python, also when traced under autograph
def flags(variables) -> Flags:
    """``id``s of the trainable ``tf.Variable`` objects in ``variables``
    whose Keras variable is not trainable, or that a frozen Keras 2 layer
    holds (under ``tf.distribute``, a replica's copy counts as its mirrored
    variable, whether it points back to it or the mirrored variable lists it);
    and of those whose Keras variable ``overwrite_with_gradient`` (float8
    training's scales: the optimizer assigns them what their custom gradient
    computes, so they are no parameters); and the constraint (``NonNeg``,
    ``MaxNorm``, ...) Keras's optimizers apply after each update, where the
    Keras variable (Keras 3) or the ``tf.Variable`` itself (Keras 2) has one."""
    keras_variable = getattr(sys.modules.get("keras"), "Variable", None)
    legacy_layer = getattr(getattr(sys.modules.get("tf_keras"), "layers", None), "Layer", None)
    ids = {}
    for v in variables:
        if v.trainable:
            container = getattr(v, "_distributed_container", None)
            ids[id(v)] = id(v)
            if container is not None:
                ids[id(container())] = id(v)
    out = Flags(set(), set(), {id(v): v.constraint for v in variables
                                if v.trainable and getattr(v, "constraint", None) is not None})
    if (keras_variable is None and legacy_layer is None) or not ids:
        return out
    for obj in gc.get_objects():
        if keras_variable is not None and isinstance(obj, keras_variable):
            held = [ids[i] for i in _held(getattr(obj, "_value", None)) if i in ids]
            if not obj.trainable:
                out.frozen.update(held)
            elif getattr(obj, "overwrite_with_gradient", False):
                out.overwritten.update(held)
            elif getattr(obj, "constraint", None) is not None:
                out.constraints.update((i, obj.constraint) for i in held)
        elif legacy_layer is not None and isinstance(obj, legacy_layer) and not obj.trainable:
            out.frozen.update(ids[i] for w in obj.weights for i in _held(w) if i in ids)
    return out


def _held(variable) -> list[int]:
    """``id``s of ``variable`` and, for a ``tf.distribute`` variable, of its
    per-replica components (what a replica's traced step captures)."""
    if variable is None:
        return []
    return [id(variable)] + [id(v) for v in getattr(variable, "_values", ())]
