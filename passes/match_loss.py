"""Match the loss: read the predictive distribution and reduction from the graph.

Contract: ``match_loss(g, kind=None) -> LossMatch`` on a canonical IR. It walks
back from the scalar loss through the batch reduction (``Mean``, ``Sum``,
``Neg``, multiplication or division by a constant, an added term that does
not depend on the data such as a weight penalty, a difference of reduced
terms) to the op that computes the per-example negative log-likelihood:

- ``kind``: ``"categorical"`` (softmax cross-entropy, sparse or dense
  targets; ``-sum(y * log_softmax(z))``, also written out on clipped
  softmax probabilities), ``"bernoulli"`` (sigmoid
  cross-entropy, also written out on clipped sigmoid probabilities) or
  ``"normal"`` (squared error; variance 1/2);
- ``reduction``: ``"mean"`` when the batch is averaged, else ``"sum"``;
- ``scale``: the constant ``c`` in ``L = c * (1/B) * sum_i l_i`` (mean) or
  ``L = c * sum_i l_i`` (sum), with ``l_i = -log p(y_i | z_i)`` summed over
  the example's outputs (Keras's mean over outputs gives ``c = 1/K``);
- ``output`` / ``targets``: the model-output tensor ``z`` (logits or mean)
  and the targets tensor (before casts that keep integer labels integers);
- ``terms`` / ``terms_coefficient``: the tensor of per-element loss terms
  (batch axis first) and the constant ``k`` with ``L = k * (1/B) * sum``
  (mean) or ``k * sum`` (sum) of all of them, so example i's own term is
  ``k * sum(terms[i])``;
- ``weights`` / ``divisors``: data tensors (computed from the arguments and
  constants, never from the variables) the terms are multiplied by or the
  loss is divided by on the way: per-token (or per-example) weights such as
  a padding mask or Keras's ``sample_weight``, a ``tf.where(mask, terms, 0)``
  (Keras's ``ignore_class``; the mask is the weight), and a data divisor
  such as the ``sum(w)`` of a masked mean ``sum(l * w) / sum(w)``. The loss
  stays linear in the terms, so token t of example i weighs
  ``dL/dterms[i, t]`` (the runtime reads it by one backward pass, holding
  the data fixed): a divisor computed from the whole batch is a batch
  statistic, treated as the constant it is for the batch. A weighted loss
  without a mean over the batch (the masked mean) has ``reduction="sum"``:
  its per-example terms, each divided by the batch's ``sum(w)``, sum to it.
  ``sizes``: divisors that are sizes known at run time only (a mean over
  positions traced at ``None``, a sum divided by ``shape(z)[1]``), as
  ``loss_sizes.SizeDivisor``s; one that counts the batch makes a mean.

If it cannot read the loss it raises ``LossNotFoundError`` naming the op it
stopped at; ``kind`` given explicitly is always accepted (with the output and
targets found where possible). Given the examples' ``rows``
(``passes.example_rows``; the pipeline passes them), a loss it cannot read
below a tensor that holds the examples on its first axis (a CTC loss's
``[B]``, an L1 loss's ``|z - y|``) is kind ``"opaque"``: no output, no
targets, ``scale`` 1, ``terms`` that tensor, so that example ``i``'s own
loss ``l_i = k sum(terms[i])`` (weighted as above) still gives per-example
gradients; its Fisher can only be the empirical one. An opaque loss whose
terms have a model output below them (``passes.loss_output``: a Huber,
focal, Poisson, KL or cosine loss) is kind ``"ggn"`` with that ``output``:
its curvature is the Gauss-Newton one, the Hessian of ``l_i`` at ``z``.
"""
from __future__ import annotations

import dataclasses

import networkx as nx
import numpy as np

from passes import ir, loss_logits, loss_sizes, loss_terms, loss_weights
from passes.errors import LOSS_HOW_TO, LossNotFoundError
from passes.loss_constants import const_operand, evaluate, from_shapes, ones_column
from passes.joined_outputs import JOINED
from passes.loss_output import ggn_output, joint_outputs, per_position

KINDS = ("categorical", "bernoulli", "normal")  # and "opaque" (module docstring)
_PASS_THROUGH = loss_logits.PASS_THROUGH
_HOW_TO = LOSS_HOW_TO


@dataclasses.dataclass(frozen=True)
class LossMatch:
    kind: str
    reduction: str
    output: str | None
    targets: str | None
    scale: float = 1.0
    op: str | None = None
    terms: str | None = None
    terms_coefficient: float = 1.0
    weights: tuple[str, ...] = ()
    divisors: tuple[str, ...] = ()
    sizes: tuple[loss_sizes.SizeDivisor, ...] = ()
    reason: str = ""  # an "opaque" loss: where and why the walk stopped
    penalties: tuple[str, ...] = ()  # added terms of the variables alone (passes.loss_terms)
    summed_penalties: tuple[str, ...] = ()  # those in every example's term of a summed loss
    extras: tuple[tuple[str, float], ...] = ()  # (terms, coefficient) added beside l_i
    # an opaque sum of several terms: (terms, the likelihood's output and kind, or None, "")
    heads: tuple[tuple[str, str | None, str], ...] = ()
    joined: tuple[str, ...] = ()  # a "ggn" loss over several outputs: those outputs
    blocks: tuple[tuple[int, int], ...] = ()  # their Hessian's (loss_output.hessian_blocks)
    likelihood_blocks: tuple[tuple[str, ...], ...] = ()  # per block, its categorical terms


def match_loss(g: nx.DiGraph, kind: str | None = None, rows=None) -> LossMatch:
    if kind is not None and kind not in KINDS:
        raise LossNotFoundError(f"unknown loss kind {kind!r}; expected one of {', '.join(KINDS)}")
    terms = [] if rows is not None else [None]  # (without rows, no opaque match)
    try:
        found = _walk(g, rows or {}, terms)
    except LossNotFoundError as e:
        if kind is None and terms and terms[0] is not None:
            return _as_ggn(g, dataclasses.replace(terms[0], reason=str(e).split("; ")[0]), rows)
        if kind is None and terms == [] and _batch_size(g) is not None:
            # no tensor of examples met on the way (with the batch known, the walk sees them)
            raise LossNotFoundError(
                f"{str(e).split('; ')[0]}, above every tensor that holds the examples on its "
                "first axis: the loss is no sum of per-example terms (a loss over the whole "
                f"batch, such as Keras's Dice with axis=None, has none); {_HOW_TO}") from None
        if kind is None:
            raise
        return LossMatch(kind, "mean", None, None, reason=str(e).split("; ")[0])
    if kind is not None and kind != found.kind:
        return dataclasses.replace(found, kind=kind)
    if kind is None and found.heads and rows is not None:
        return _as_ggn(g, found, rows)  # terms of several outputs
    return found


def _as_ggn(g, opaque: LossMatch, rows) -> LossMatch:
    """An opaque loss with a model output (``passes.loss_output``), or a sum
    of terms with one output each, is kind ``"ggn"``: its curvature is the
    Gauss-Newton one through that output (several outputs are joined into
    one, ``JOINED``, by ``passes.joined_outputs``). A likelihood with other
    terms beside it stays as it is where the terms have no such outputs."""
    batch = _batch_size(g)
    args = (_parameter_nodes(g), lambda node: _examples_first(
        (g.nodes[node]["shapes"] or [None])[0], rows.get(node), batch))
    if not opaque.heads and opaque.extras:
        return opaque
    if not opaque.heads:
        z, why = ggn_output(g, opaque.terms, *args)
        if z is not None:
            return dataclasses.replace(opaque, kind="ggn", output=z)
    heads = opaque.heads or ((opaque.terms, None, ""),)
    outputs, joint_why, blocks, likelihood_blocks = joint_outputs(g, heads, *args, rows)
    if outputs is None and opaque.kind != "opaque":
        return opaque  # one likelihood, the other terms in its examples' gradients only
    if outputs is None:
        return dataclasses.replace(opaque, reason=f"{opaque.reason}; "
                                   f"{why if not opaque.heads else joint_why}")
    opaque = dataclasses.replace(
        opaque, targets=None, scale=1.0,
        reason=opaque.reason or f"{len(opaque.heads)} terms, each of its own output")
    if len(outputs) == 1 and not blocks and all(per_position(g, outputs[0], t, args[0])
                                 for t, given, _ in heads if given is None):
        return dataclasses.replace(opaque, kind="ggn", output=outputs[0])
    return dataclasses.replace(opaque, kind="ggn", output=ir.tensor_name(JOINED),
                               joined=tuple(outputs), heads=heads, blocks=blocks,
                               likelihood_blocks=likelihood_blocks)


def _walk(g: nx.DiGraph, rows, opaque, tensor=None, coefficient=1.0, batch_mean=False,
          nodes=None) -> LossMatch:
    """The loss read from ``tensor`` (the scalar loss) down; ``opaque`` gets
    the ``"opaque"`` match at the first tensor on the way that holds the
    examples on its first axis (``_examples_first``), for when the walk fails
    below it. A sum of several data terms walks down each (``loss_terms``).
    ``nodes``: ``(data, params, batch)`` where a walk above has them."""
    nodes = nodes or (_data_nodes(g), _parameter_nodes(g), _batch_size(g))
    data, params, batch = nodes
    tensor = tensor or g.graph["output"]
    weights, divisors, sizes, weighted_at, reader = [], [], [], [], None  # reader: op left
    penalties, summed = [], []
    for _ in range(len(g)):
        node, index = ir.split_tensor(tensor)
        d = g.nodes[node]
        if not opaque and _examples_first(d["shapes"][index], rows.get(node), batch):
            # L = k (1/B) sum(terms) (mean; k sum(terms) for a sum): l_i = k sum(terms_i)
            opaque.append(LossMatch("opaque", "mean" if batch_mean else "sum", None, None,
                                    terms=_as_read(g, reader, tensor),
                                    terms_coefficient=float(coefficient),
                                    weights=tuple(weights), divisors=tuple(divisors),
                                    sizes=tuple(sizes), penalties=tuple(penalties),
                                    summed_penalties=tuple(summed)))
        reader = node
        op, inputs = d["op"], d["inputs"]
        terminal = _terminal(g, node, params)
        if terminal is not None:
            kind, output, targets, sign = terminal
            scale = coefficient * sign
            if scale <= 0:
                raise LossNotFoundError(
                    f"the loss at op {node!r} is scaled by {scale:g}; {_HOW_TO}")
            targets = _unflatten(g, _through_casts(g, targets))
            loss_weights.check_class_weights(g, kind, node, output, weighted_at)
            return LossMatch(kind, "mean" if batch_mean else "sum",
                             loss_weights.unmasked(g, _unflatten(g, output), params),
                             targets, float(scale), node,
                             ir.tensor_name(node), float(coefficient),
                             tuple(weights), tuple(divisors), tuple(sizes),
                             penalties=tuple(penalties), summed_penalties=tuple(summed))
        if op == "Mean":
            axes, shape = _axes(g, node)
            if axes is None:
                raise LossNotFoundError(
                    f"op {node!r} reduces over axes not known statically; {_HOW_TO}")
            first = loss_sizes.averages_the_examples(g, rows, inputs[0], batch)
            for a in axes:
                if a == 0 and first:
                    batch_mean = True
                    if shape[0] is not None and batch:
                        coefficient /= shape[0] / batch
                    elif shape[0] is None and loss_sizes.rows_per_example(rows, inputs[0]) != 1:
                        sizes.append(loss_sizes.SizeDivisor(inputs[0], (0,), over_batch=True))
                elif shape[a] is not None:
                    coefficient /= shape[a]
                else:  # a size known at run time only: the weights' derivative holds it
                    sizes.append(loss_sizes.SizeDivisor(inputs[0], (a,)))
            tensor = inputs[0]
        elif op in ("Sum",) or op in _PASS_THROUGH or (op == "MatMul" and ones_column(
                g, inputs[1]) and not any(d["attrs"].get(f"transpose_{s}") for s in "ab")):
            tensor = inputs[0]  # (x @ ones([n, 1]) sums x's rows)
        elif op == "Neg":
            coefficient, tensor = -coefficient, inputs[0]
        elif op == "Mul":
            const, other = const_operand(g, inputs)
            if const is None:
                weight, other = loss_weights.data_operand(g, node, inputs, params, "multiplies")
                weights.append(weight)
                weighted_at.append((node, weight, other))
                tensor = other
                continue
            coefficient, tensor = coefficient * const, other
        elif op in ("Select", "SelectV2"):
            tensor = loss_weights.masked(g, node, inputs, params)
            weights.append(inputs[0])
            weighted_at.append((node, inputs[0], tensor))
        elif op in ("RealDiv", "Div", "DivNoNan"):
            divisor = evaluate(g, inputs[1])
            if divisor is None:
                if from_shapes(g, inputs[1]) and not ir.reads_values_of(
                        g, ir.split_tensor(inputs[1])[0], g.graph["arguments"]):  # a size
                    tensor = inputs[0]
                    batch_mean, size = loss_sizes.size_divisor(g, rows, tensor, inputs[1],
                                                               batch_mean)
                    sizes += [size] if size is not None else []  # (the weights' derivative)
                    continue
                if ir.split_tensor(inputs[1])[0] in params:
                    raise LossNotFoundError(f"op {node!r} divides by a tensor that depends on "
                                            f"the variables; {_HOW_TO}")
                loss_weights.check_data(g, node, inputs[1], "divides by a tensor")
                divisors.append(inputs[1])
                tensor = inputs[0]
                continue
            divisor = float(np.asarray(divisor).reshape(()))
            counts = loss_sizes.counts_the_batch(g, inputs[1])  # a folded tf.shape(z)[k]
            if batch and not batch_mean and (counts is True or (  # (c B: a weight c's mean)
                    divisor >= batch and divisor % batch == 0 and counts is not False)):
                batch_mean = True
                coefficient /= divisor / batch
            else:
                coefficient /= divisor
            tensor = inputs[0]
        elif op in ("AddV2", "Add", "AddN") or loss_terms.reduced_difference(
                op, inputs, data, params, not opaque):
            terms, added = loss_terms.split_sum(g, node, inputs, data, params)
            penalties += added
            if not batch_mean and _examples_first(d["shapes"][index], rows.get(node), batch):
                summed += added  # B copies in the batch's loss, one in example i's
            if len(terms) == 1:
                tensor = terms[0]
                continue
            found = [(t, *_attempt(g, rows, t, coefficient * (-1.0 if op == "Sub" and k else 1.0),
                                   batch_mean, nodes)) for k, t in enumerate(terms)]
            match = loss_terms.combine(node, found)
            return dataclasses.replace(match, penalties=tuple(penalties) + match.penalties,
                                       summed_penalties=tuple(summed) + match.summed_penalties,
                                       weights=tuple(weights) + match.weights,
                                       divisors=tuple(divisors) + match.divisors,
                                       sizes=tuple(sizes) + match.sizes)
        else:
            raise LossNotFoundError(f"cannot read a loss through op {node!r} ({op}); {_HOW_TO}")
    raise LossNotFoundError(f"no loss op found; {_HOW_TO}")


def _attempt(g, rows, tensor, coefficient, batch_mean, nodes):
    """``(match, opaque match, error)`` of the walk down one added term."""
    opaque = [] if rows else [None]
    try:
        return _walk(g, rows, opaque, tensor, coefficient, batch_mean, nodes), None, None
    except LossNotFoundError as e:
        return None, (opaque[0] if opaque else None), e


def _as_read(g, reader, tensor):
    """``tensor`` as ``reader`` reads it in the original graph (through a
    custom gradient's ``IdentityN``, which the terms' gradient must cross)."""
    if reader is None:
        return tensor
    d = g.nodes[reader]
    return next((raw for t, raw in zip(d["inputs"], d["raw_inputs"]) if t == tensor), tensor)


def _examples_first(shape, rows, batch) -> bool:
    """The tensor holds the examples on its first axis: so its rows say, or
    (where they lost the examples: a CTC loss's While loop) its first axis
    has the batch's size."""
    if rows is not None:
        return rows.axis == 0
    return bool(shape) and batch is not None and shape[0] == batch


def _terminal(g, node, params):
    """(kind, model output, targets, sign) when ``node`` computes -log p."""
    d = g.nodes[node]
    op, inputs = d["op"], d["inputs"]
    if op in ("SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits"):
        z = loss_logits.logits_of_log_softmax(g, inputs[0]) or inputs[0]
        return "categorical", z, inputs[1], 1.0
    if op in ("SquaredDifference",):
        return _regression(g, inputs, params)
    if op == "Square":
        sub = ir.split_tensor(inputs[0])[0]
        if g.nodes[sub]["op"] == "Sub":
            return _regression(g, g.nodes[sub]["inputs"], params)
        if sub in params:  # squared error against a target of zero
            return "normal", inputs[0], None, 1.0
    if op == "Mul":
        for k, t in enumerate(inputs):
            src = ir.split_tensor(t)[0]
            if g.nodes[src]["op"] == "LogSoftmax":
                return "categorical", g.nodes[src]["inputs"][0], inputs[1 - k], -1.0
            z = loss_logits.logits_of_log_softmax(g, t)
            if z is not None:
                return "categorical", z, inputs[1 - k], -1.0
    if op in ("AddV2", "Add"):
        return (loss_logits.sigmoid_cross_entropy(g, inputs)
                or loss_logits.bernoulli_from_probabilities(g, inputs))
    return None


def _regression(g, operands, params):
    a, b = operands
    a_model = ir.split_tensor(a)[0] in params
    b_model = ir.split_tensor(b)[0] in params
    if a_model == b_model:
        return None
    return ("normal", a, b, 1.0) if a_model else ("normal", b, a, 1.0)


def _through_casts(g, tensor: str | None) -> str | None:
    """The targets before the casts that keep them integers (or floats):
    Keras's sparse cross-entropy casts int labels to float, then to int64."""
    if tensor is None:
        return None
    def integral(t):
        node, index = ir.split_tensor(t)
        return g.nodes[node]["dtypes"][index].startswith(("int", "uint"))

    kind, source = integral(tensor), tensor
    while g.nodes[ir.split_tensor(tensor)[0]]["op"] == "Cast":
        tensor = g.nodes[ir.split_tensor(tensor)[0]]["inputs"][0]
        if integral(tensor) == kind:
            source = tensor
    return source


def _unflatten(g, tensor: str) -> str:
    """Sees through a Reshape that merges leading axes (tf.nn's cross-entropy
    on [B, T, C] logits flattens them to [B*T, C])."""
    node = ir.split_tensor(tensor)[0] if tensor is not None else None
    if node is None or g.nodes[node]["op"] != "Reshape":
        return tensor
    source = g.nodes[node]["inputs"][0]
    before, after = ir.shape_of(g, source), ir.shape_of(g, tensor)
    if before and after and len(before) > len(after) and (
            len(after) == 1 or tuple(before[-1:]) == tuple(after[-1:])):
        return source
    return tensor


def _axes(g, node):
    # the indices refer to the input as the op reads it, before canonicalize dropped unit axes
    shape = ir.shape_of(g, g.nodes[node]["raw_inputs"][0])
    value = ir.const_value(g, g.nodes[node]["inputs"][1])
    if shape is None or value is None:
        return None, shape
    return sorted({int(a) % len(shape) for a in np.atleast_1d(value)}), shape


def _data_nodes(g) -> set:
    return ir.reachable_from(g, g.graph["arguments"])


def _parameter_nodes(g) -> set:
    """The nodes whose values depend on the trainable variables (a shape of
    one, as Keras's ``ignore_class`` reshapes its mask to the logits', does not)."""
    return ir.value_dependents(g, (
        node for node, d in g.nodes(data=True)
        if d["op"] == "Variable" and g.graph["variables"][d["variable"]].trainable))


def _batch_size(g):
    for arg in g.graph["arguments"]:
        if arg in g:
            shape = g.nodes[arg]["shapes"][0] if g.nodes[arg]["shapes"] else None
            if shape:
                return shape[0]
    return None
