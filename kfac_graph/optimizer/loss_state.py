"""The state a loss writes when it runs, and the damping rule's second run.

A loss in training mode writes variables besides reading the parameters:
batch normalisation's moving statistics, the seed generators of Keras 3's
Dropout and noise layers, a ``tf.random.Generator``'s state. The K-FAC step
runs the loss once for its gradients, and the damping rule once more at the
new parameters, for

    rho = (h(theta + delta) - h(theta)) / M(delta).

Run as it is, that second run drew other random numbers than the first (so
``rho`` compared the losses of two dropout masks) and updated the moving
statistics a second time (six updates in five steps with the rule every
fifth). ``second_run(fn, args, written, before)`` runs it from the state the
step's first run started from, ``before``, so both losses share one draw,
and puts back the state the first run left: one update and one draw a step.

``written(fn, args)``: the variables ``fn``'s traced graph writes (by an
assignment, a scatter, or a stateful random op on the variable); its
top-level graph only (a write inside a loop's body is not seen).
"""
from __future__ import annotations

import tensorflow as tf

# op types that write the resource variable in their first input
_WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "RngReadAndSkip",
           "RngSkip")
_WRITE_PREFIXES = ("ResourceScatter", "Stateful")


def written(fn, args) -> list:
    """The variables ``fn(*args)`` (a ``tf.function``) writes, in a fixed order."""
    graph = fn.get_concrete_function(*args).graph
    internal_to_external = {id(internal): external for external, internal in graph.captures}
    handles = {id(v.handle): v for v in graph.variables}
    found = {}
    for op in graph.get_operations():
        if not (op.type in _WRITES or op.type.startswith(_WRITE_PREFIXES)) or not op.inputs:
            continue
        external = internal_to_external.get(id(op.inputs[0]))
        variable = handles.get(id(external)) if external is not None else None
        if variable is not None:
            found.setdefault(id(variable), variable)
    return list(found.values())


def snapshot(variables) -> list:
    """Reads of ``variables`` now (a later assignment copies on write)."""
    return [v.value() for v in variables]


def second_run(fn, args, variables, before):
    """``fn(*args)`` run from the state ``before`` (a ``snapshot`` of
    ``variables``), leaving ``variables`` as they were found."""
    if not variables:
        return fn(*args)
    after = snapshot(variables)
    for v, value in zip(variables, before):
        v.assign(value)
    loss = fn(*args)
    with tf.control_dependencies([loss]):
        for v, value in zip(variables, after):
            v.assign(value)
        return tf.identity(loss)
