"""Weights the loss pass reads: data tensors the loss terms are multiplied by,
masked with or divided by (a padding mask, Keras's ``sample_weight`` and
``ignore_class``, the ``sum(w)`` of a masked mean).

Contract: each helper takes the IR ``g``, the op ``node`` on the loss's
path, its ``inputs`` and ``params`` (the nodes that depend on trainable
variables) and returns the path tensor to walk on, or raises
``LossNotFoundError`` naming the op. A weight is data: it reads no
trained variable (a non-trainable one, an annealed KL weight, is read when
the loss runs, as an argument is), so the loss stays linear in its terms and token ``t`` of
example ``i`` weighs ``dL/dterms[i, t]`` with the data held fixed.
"""
from __future__ import annotations

import numpy as np

from passes import ir
from passes.errors import LOSS_HOW_TO as _HOW_TO, LossNotFoundError
from passes.loss_constants import evaluate
from passes.row_axes import axis_in


def data_operand(g, node, inputs, params, verb):
    """``(weight, other)`` of a binary op one of whose operands is data (does
    not depend on the variables) and the other the loss's path."""
    on_path = [ir.split_tensor(t)[0] in params for t in inputs]
    if all(on_path):
        raise LossNotFoundError(f"op {node!r} {verb} two tensors that depend on the "
                                f"variables; {_HOW_TO}")
    if not any(on_path):
        raise LossNotFoundError(f"op {node!r} {verb} two tensors that do not depend on the "
                                f"variables; {_HOW_TO}")
    k = on_path.index(True)
    check_data(g, node, inputs[1 - k], f"{verb} two non-constant tensors, one")
    return inputs[1 - k], inputs[k]


def check_data(g, node, tensor, what):
    """A weight or divisor is data: computed from the arguments, constants
    and variables that are not trained (a KL weight annealed by a callback,
    a loss scale; a teacher's behind a gradient stop, ``gradient_stops``),
    all read when the loss runs. One read from a trained variable is
    refused, naming the op."""
    info = g.graph.get("variables", {})
    variables = [n for n, d in g.nodes(data=True) if d["op"] == "Variable"
                 and getattr(info.get(d.get("variable")), "trainable", True)]
    if ir.split_tensor(tensor)[0] in ir.value_dependents(g, variables):  # (not a shape of one)
        raise LossNotFoundError(f"op {node!r} {what} read from a variable (weights and "
                                f"divisors must be data); {_HOW_TO}")


def masked(g, node, inputs, params):
    """The path tensor of ``where(mask, terms, 0)`` (or ``where(mask, 0,
    terms)``) with a data ``mask``: the mask weighs the terms by 0 or 1."""
    cond, a, b = inputs
    if ir.split_tensor(cond)[0] in params:
        raise LossNotFoundError(f"op {node!r} selects on a tensor that depends on the "
                                f"variables; {_HOW_TO}")
    check_data(g, node, cond, "selects on a tensor")
    for path, other in ((a, b), (b, a)):
        value = evaluate(g, other)
        if (ir.split_tensor(path)[0] in params and value is not None
                and not np.any(np.asarray(value))):
            return path
    raise LossNotFoundError(f"op {node!r} selects between loss terms and something other than "
                            f"zeros; {_HOW_TO}")


def unmasked(g, output, params):
    """The model output seen through ``where(mask, z, constant)`` with a data
    mask (Keras's ``ignore_class`` masks the logits too; the masked tokens
    weigh nothing)."""
    node = g.nodes[ir.split_tensor(output)[0]]
    if node["op"] in ("Select", "SelectV2") and ir.split_tensor(node["inputs"][0])[0] not in params:
        _, a, b = node["inputs"]
        for path, other in ((a, b), (b, a)):
            if ir.split_tensor(path)[0] in params and evaluate(g, other) is not None:
                return path
    return output


def check_class_weights(g, kind, terminal, output, weighted_at):
    """A categorical loss whose terms keep the class axis (``y * log_softmax(z)``)
    must not be weighted unequally across classes: that is no log-likelihood.
    The terms may hold unit axes ``z`` lacks (``log_softmax(z)[:, None]``,
    which the IR sees through): the classes' axis is ``z``'s last there."""
    terms_shape = ir.shape_of(g, ir.tensor_name(terminal))
    output_shape = ir.shape_of(g, output)
    if kind != "categorical" or not terms_shape or not output_shape or (
            len(terms_shape) != len(output_shape) and g.nodes[terminal]["op"] != "Mul"):
        return  # (the Mul form keeps every axis; the others reduce the classes')
    output_rank = len(terms_shape)
    classes = axis_in(output_shape, terms_shape, len(output_shape) - 1) - output_rank
    for node, weight, other in weighted_at:
        now = ir.shape_of(g, other)
        if now is None or len(now) != output_rank:
            continue
        other_shape, weight_shape = (  # as the op reads them (unit axes kept)
            ir.read_shape(g, node, t) if t in g.nodes[node]["inputs"] else ir.shape_of(g, t)
            for t in (other, weight))
        at = axis_in(now, other_shape or now, output_rank + classes) - len(other_shape or now)
        if weight_shape is None or (len(weight_shape) >= -at and weight_shape[at] != 1):
            raise LossNotFoundError(f"op {node!r} weighs the classes of a categorical loss "
                                    f"(may differ from class to class); {_HOW_TO}")
