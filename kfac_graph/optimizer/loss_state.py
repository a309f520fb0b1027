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
fifth). ``second_run(run, written, before)`` runs it from the state the
step's first run started from, ``before``, so both losses share one draw,
and puts back the state the first run left: one update and one draw a step.

``written(registration)``: the variables the registered graph writes (by an
assignment, a scatter, or a stateful random op on the variable), its
function calls inlined (a write inside a loop's body is not seen). Reads and
writes go through ``variable.handle``: under ``tf.distribute`` that is the
replica's own copy in ``strategy.run``, so each replica snapshots and puts
back its own state.
"""
from __future__ import annotations

import tensorflow as tf

# op types that write the resource variable in their first input
_WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "RngReadAndSkip",
           "RngSkip")
_WRITE_PREFIXES = ("ResourceScatter", "Stateful")


def written(registration) -> list:
    """The variables the registered graph writes, in a fixed order."""
    placeholders = registration.variable_placeholders
    found = {}
    for node in registration.graph_def.node:
        if not (node.op in _WRITES or node.op.startswith(_WRITE_PREFIXES)) or not node.input:
            continue
        variable = placeholders.get(node.input[0].split(":")[0])
        if variable is not None:
            found.setdefault(id(variable), variable)
    return list(found.values())


def snapshot(variables) -> list:
    """Reads of ``variables`` now (a later assignment copies on write)."""
    return [tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=v.dtype) for v in variables]


def _assign(variables, values):
    return [tf.raw_ops.AssignVariableOp(resource=v.handle, value=value)
            for v, value in zip(variables, values)]


def second_run(run, variables, before):
    """``run()`` (the loss) from the state ``before`` (a ``snapshot`` of
    ``variables``), leaving ``variables`` as they were found."""
    if not variables:
        return run()
    after = snapshot(variables)
    _assign(variables, before)
    # ordered after the assignments by the function's automatic control
    # dependencies on those resources (an import of a graph inside
    # ``tf.control_dependencies`` does not build)
    loss = run()
    with tf.control_dependencies([loss]):
        with tf.control_dependencies(_assign(variables, after)):
            return tf.identity(loss)
