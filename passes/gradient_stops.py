"""Trainable variables the loss's gradient never reaches.

A variable whose every path to the loss passes a ``StopGradient`` (or a
``PreventGradient``) has ``dL/dv = 0`` whatever the inputs: a teacher's
logits under ``tf.stop_gradient`` in knowledge distillation, a target
network in BYOL or DQN. ``unreached(g) -> g`` marks such variables not
trainable, as a frozen Keras layer's are, so that no layer registers them,
K-FAC neither preconditions nor moves them, and no curvature is spent on
their outputs (before, their layers were registered, with zero per-example
gradients, and the teacher's logits joined the loss's Gauss-Newton output
beside the student's, which changed the student's steps).

The paths are the IR's edges before ``canonicalize``, through every op: a
custom gradient's ``IdentityN`` still reads its inputs and variables
there, so a straight-through estimator's variable (its forward stopped,
its gradient the custom one) stays reached, and so does a variable whose
shape alone is read (conservative).
"""
from __future__ import annotations

import dataclasses

import networkx as nx

from passes import ir


def unreached(g: nx.DiGraph) -> nx.DiGraph:
    """``g``, with the trainable variables that reach the loss only through
    gradient stops marked not trainable (a copy where there are any)."""
    output = ir.split_tensor(g.graph["output"])[0]
    if output not in g:
        return g
    kept = g.subgraph(n for n, d in g.nodes(data=True) if d["op"] not in ir.GRADIENT_STOPS)
    reaching = nx.ancestors(kept, output) if output in kept else set()
    variables = g.graph["variables"]
    cut = {d["variable"] for n, d in g.nodes(data=True)
           if d["op"] == "Variable" and n not in reaching and variables[d["variable"]].trainable}
    if not cut:
        return g
    g = g.copy()
    g.graph["variables"] = {key: dataclasses.replace(info, trainable=False) if key in cut
                            else info for key, info in variables.items()}
    return g
