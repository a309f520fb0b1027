"""Where a likelihood's logits are: ``z`` behind Keras's and tf.nn's
cross-entropies written out on probabilities (a clipped, renormalised
softmax; a clipped sigmoid) or as sigmoid cross-entropy's stable form.

Contract: each function takes the IR ``g`` and the tensors (or an op's
inputs) the loss pass stands at, and returns what it reads there, or None
when the tensors are not that form (``passes.match_loss`` tries the next).
"""
from __future__ import annotations

import numpy as np

from passes import ir
from passes.loss_constants import const_operand, evaluate

# ops a loss is read through unchanged (also by passes.match_loss)
PASS_THROUGH = frozenset({"Squeeze", "Reshape", "ExpandDims", "Identity", "Cast"})


def sigmoid_cross_entropy(g, inputs):
    """tf.nn.sigmoid_cross_entropy_with_logits:
    (max(z, 0) - z * y) + log1p(exp(-|z|)), as Select / Mul / Sub / Log1p."""
    ops = {g.nodes[ir.split_tensor(t)[0]]["op"]: t for t in inputs}
    if set(ops) != {"Sub", "Log1p"}:
        return None
    sub = ir.split_tensor(ops["Sub"])[0]
    mul = ir.split_tensor(g.nodes[sub]["inputs"][1])[0]
    if g.nodes[mul]["op"] != "Mul":
        return None
    select = ir.split_tensor(g.nodes[sub]["inputs"][0])[0]
    if g.nodes[select]["op"] not in ("Select", "SelectV2"):
        return None
    logits = g.nodes[select]["inputs"][1]
    z, y = g.nodes[mul]["inputs"]
    if y == logits:
        z, y = y, z
    if z != logits:
        return None
    return "bernoulli", z, y, 1.0


def bernoulli_from_probabilities(g, inputs):
    """``y * log(p) + (1 - y) * log(1 - p)`` with ``p`` a (clipped) sigmoid of
    ``z``: Keras's binary cross-entropy on probabilities where it cannot
    recover the logits itself (it negates the sum, hence the sign -1)."""
    if len(inputs) != 2:
        return None
    logs = []
    for t in inputs:
        mul = g.nodes[ir.split_tensor(t)[0]]
        if mul["op"] != "Mul":
            return None
        found = [(x, w) for x, w in (mul["inputs"], mul["inputs"][::-1])
                 if g.nodes[ir.split_tensor(x)[0]]["op"] == "Log"]
        if len(found) != 1:
            return None
        log_tensor, weight = found[0]
        logs.append((g.nodes[ir.split_tensor(log_tensor)[0]]["inputs"][0], weight))
    for (p, y), (q, y_complement) in (logs, logs[::-1]):
        if _one_minus(g, q) == p and _one_minus(g, y_complement) == y:
            z = logits_of_sigmoid(g, p)
            return None if z is None else ("bernoulli", z, y, -1.0)
    return None


def _one_minus(g, tensor):
    """``x`` when ``tensor`` is ``1 - x``, else None."""
    node = g.nodes[ir.split_tensor(tensor)[0]]
    if node["op"] != "Sub":
        return None
    one = evaluate(g, node["inputs"][0])
    if one is None or np.size(one) != 1 or float(np.asarray(one).reshape(())) != 1.0:
        return None
    return node["inputs"][1]


def _input_of(g, tensor, op, renormalised=False):
    """The input of the ``op`` node that ``tensor`` reads through casts, a clip
    to ``[eps, 1 - eps]`` (Minimum / Maximum with constants) and, with
    ``renormalised``, ``p / sum(p)``; None if it reads anything else."""
    for _ in range(8):
        node = g.nodes[ir.split_tensor(tensor)[0]]
        if node["op"] == op:
            return node["inputs"][0]
        if node["op"] in ("Minimum", "Maximum"):
            _, tensor = const_operand(g, node["inputs"])
            if tensor is None:
                return None
        elif renormalised and node["op"] in ("RealDiv", "Div"):
            total = g.nodes[ir.split_tensor(node["inputs"][1])[0]]
            if total["op"] != "Sum" or total["inputs"][0] != node["inputs"][0]:
                return None
            tensor = node["inputs"][0]
        elif node["op"] in PASS_THROUGH:
            tensor = node["inputs"][0]
        else:
            return None
    return None


def logits_of_sigmoid(g, tensor):
    """``z`` when ``tensor`` is ``sigmoid(z)``, seen through casts and a clip."""
    return _input_of(g, tensor, "Sigmoid")


def logits_of_log_softmax(g, tensor):
    """``z`` when ``tensor`` is ``log(softmax(z))``, seen through casts, a clip
    to ``[eps, 1 - eps]`` and a renormalisation ``p / sum(p)``: Keras's
    (sparse) categorical cross-entropy on probabilities where it cannot recover
    the logits itself. ``softmax(log p) = p``, so the categorical on ``z`` is
    the one the loss reads."""
    node = g.nodes[ir.split_tensor(tensor)[0]]
    if node["op"] == "LogSoftmax":
        return node["inputs"][0]
    if node["op"] != "Log":
        return None
    return _input_of(g, node["inputs"][0], "Softmax", renormalised=True)
