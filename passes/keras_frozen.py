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

Neither the variable nor its Keras variable points back to its owner. The
Keras variables are first looked for in what the traced function holds
(``passes.keras_reach``: its closure, globals, a model's variables); where
that does not account for every captured variable, among the objects the
garbage collector tracks (0.05-0.15 s in a process holding a model).
Either way the flags are read as they are then. Keras 2's flags are its
layers', looked up among those objects on every call. Nothing is looked up
where neither Keras is imported or no captured variable is trainable.
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
def flags(variables, reached=None) -> Flags:
    """``id``s of the trainable ``tf.Variable`` objects in ``variables``
    whose Keras variable is not trainable, or that a frozen Keras 2 layer
    holds (under ``tf.distribute``, a replica's copy counts as its mirrored
    variable, whether it points back to it or the mirrored variable lists it);
    and of those whose Keras variable ``overwrite_with_gradient`` (float8
    training's scales: the optimizer assigns them what their custom gradient
    computes, so they are no parameters); and the constraint (``NonNeg``,
    ``MaxNorm``, ...) Keras's optimizers apply after each update, where the
    Keras variable (Keras 3) or the ``tf.Variable`` itself (Keras 2) has one.
    ``reached``: what the traced function reaches (``keras_reach.reached``),
    read instead of scanning where it accounts for every captured variable."""
    keras_variable = getattr(sys.modules.get("keras"), "Variable", None)
    legacy_layer = getattr(getattr(sys.modules.get("tf_keras"), "layers", None), "Layer", None)
    captured = {id(v): v for v in variables if v.trainable}
    out = Flags(set(), set(), {id(v): v.constraint for v in variables
                                if v.trainable and getattr(v, "constraint", None) is not None})
    if (keras_variable is None and legacy_layer is None) or not captured:
        return out
    owners = _reached_owners(captured.values(), reached) if legacy_layer is None else None
    if owners is None:
        owners, legacy_frozen = _scan(captured.values(), keras_variable, legacy_layer)
        out.frozen.update(legacy_frozen)
    for i, held_by in owners.items():
        for obj in held_by:
            if not obj.trainable:
                out.frozen.add(i)
            elif getattr(obj, "overwrite_with_gradient", False):
                out.overwritten.add(i)
            elif getattr(obj, "constraint", None) is not None:
                out.constraints[i] = obj.constraint
    return out


def _scan(captured, keras_variable, legacy_layer):
    """``({id(v): [Keras variables holding v]}, {ids held by a frozen Keras 2
    layer})`` for the captured variables ``captured``, from one pass over the
    objects the garbage collector tracks."""
    ids = {k: id(v) for v in captured for k in _keys(v)}
    owners, legacy_frozen = {id(v): [] for v in captured}, set()
    keras_types = _subclasses(keras_variable)  # a set lookup: faster than isinstance
    for obj in gc.get_objects():
        if type(obj) in keras_types:
            for i in {ids[i] for i in _held(getattr(obj, "_value", None)) if i in ids}:
                owners[i].append(obj)
        elif legacy_layer is not None and isinstance(obj, legacy_layer) and not obj.trainable:
            legacy_frozen.update(ids[i] for w in obj.weights for i in _held(w) if i in ids)
    return owners, legacy_frozen


def _subclasses(cls) -> set:
    """``cls`` (if not None) and its subclasses, at any depth."""
    out, todo = set(), [cls] if cls is not None else []
    while todo:
        c = todo.pop()
        if c not in out:
            out.add(c)
            todo.extend(c.__subclasses__())
    return out


def _reached_owners(captured, reached):
    """``{id(v): [its Keras variables]}`` from ``reached``; None unless each
    captured variable is held by a reached Keras variable or was reached
    itself as a plain ``tf.Variable``."""
    if reached is None:
        return None
    held_by, plain = {}, {id(v) for v in reached.plain}
    for obj in reached.keras:
        for i in _held(getattr(obj, "_value", None)):
            held_by.setdefault(i, []).append(obj)
    owners = {}
    for v in captured:
        keys = _keys(v)
        found = [obj for k in keys for obj in held_by.get(k, ())]
        if not found and not plain & set(keys):
            return None
        owners[id(v)] = found
    return owners


def _keys(variable) -> list[int]:
    """The ``id``s a captured variable is known by: its own and, for a
    replica's copy, its mirrored variable's."""
    container = getattr(variable, "_distributed_container", None)
    return [id(variable)] + ([id(container())] if container is not None else [])


def _held(variable) -> list[int]:
    """``id``s of ``variable`` and, for a ``tf.distribute`` variable, of its
    per-replica components (what a replica's traced step captures)."""
    if variable is None:
        return []
    return [id(variable)] + [id(v) for v in getattr(variable, "_values", ())]
