"""Custom gradients the re-run graph would not give: replayed, or refused.

``tf.custom_gradient`` marks an ``IdentityN`` over ``results + inputs (+
variables)`` with a gradient registered in Python whose closure holds
tensors of the traced graph; kfac_graph's re-imported graph cannot call it
and differentiates the forward ops instead (``kfac_graph.taps``). That is
the same gradient where the custom one is the forward's derivative written
another way (Keras's swish and silu, a numerically stable softplus,
``tf.recompute_grad``), and a different one, with no error, where the
custom gradient is a surrogate. ``honour(graph_def, loss, name)`` marks
each op on the loss's path whose forward says it is a surrogate to have its
own gradient function replayed in the re-run graph
(``passes.gradient_replay``), and refuses it in one line where that
function cannot be (gone from the process, or holding tensors the graph
lacks). A surrogate is:

- a result that is one of the inputs (through ``Identity`` ops): a forward
  identity with its own gradient, as a gradient reversal or clipping layer
  writes it;
- a forward whose every path from the floating inputs to a result passes
  an op that stops or cuts the gradient (``StopGradient``, ``Sign``, a cast
  to an integer: a straight-through estimator), or that TensorFlow finds
  no gradient through (``Round``, ``Floor``: tested by ``tf.gradients`` on
  the unmarked graph where the forward holds ops other than elementwise
  ones);
- a forward where some such path does, on floating data (a stop, a
  rounding, a cast of floats to integers): Keras's int8 and int4 layers
  quantize their inputs, and only the scales they divide by again are
  differentiable, so the forward's derivative is not the custom gradient's
  (the dequantized kernel's);
- a forward that runs a loop (TensorFlow's CTC loss on dense labels, which
  computes its gradient in its forward pass): its derivative cannot be
  checked against the custom gradient.

A surrogate whose forward is plain arithmetic (``x * 1`` with a gradient of
``dy / 2``) cannot be told apart from an exact custom gradient, and is
differentiated through its forward.

The results are the outputs the graph reads; the other inputs are the
function's inputs and variables.
"""
from __future__ import annotations

import networkx as nx
import tensorflow as tf

from passes import gradient_replay, ir
from passes.errors import KfacGraphError

MARKER = b"CustomGradient-"
_CUTS = frozenset({"StopGradient", "PreventGradient", "Sign"})
_ROUNDING = frozenset({"Round", "Floor", "Ceil", "Rint"})  # TensorFlow gives them no gradient
_PASS = frozenset({"Identity", "Snapshot"})
_LOOPS = frozenset({"While", "StatelessWhile"})
# ops whose registered gradient is their derivative: a forward of these alone
# is differentiable wherever a path from the inputs avoids the cuts
_PLAIN = frozenset({"Identity", "Snapshot", "Const", "Sigmoid", "Tanh", "Relu", "Relu6", "Elu",
                    "Selu", "Softplus", "Softsign", "Mul", "Add", "AddV2", "Sub", "Neg",
                    "RealDiv", "Div", "Exp", "Log", "Log1p", "Expm1", "Abs", "Square", "Sqrt",
                    "Rsqrt", "Pow", "Maximum", "Minimum", "Select", "SelectV2", "Erf", "Cast",
                    "Reshape", "ExpandDims", "Squeeze", "Shape", "Fill", "ZerosLike", "OnesLike",
                    "Greater", "GreaterEqual", "Less", "LessEqual", "Equal", "NotEqual"})


def strip_markers(graph_def):
    """``graph_def`` (a copy) without custom-gradient markers: each marked
    ``IdentityN`` passes gradients to the forward ops it follows."""
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    for node in out.node:
        if "_gradient_op_type" in node.attr and node.attr["_gradient_op_type"].s.startswith(MARKER):
            del node.attr["_gradient_op_type"]
    return out


def honour(graph_def, loss: str, name: str):
    """``graph_def``, each surrogate custom gradient on the path to ``loss``
    (module docstring) marked to be replayed (``passes.gradient_replay``);
    ``KfacGraphError`` for the first one that cannot be."""
    marked = [n for n in graph_def.node if n.op == "IdentityN" and "_gradient_op_type" in n.attr
              and n.attr["_gradient_op_type"].s.startswith(MARKER)]
    if not marked:
        return graph_def
    nodes = {n.name: n for n in graph_def.node}
    g = nx.DiGraph()
    read = set()
    for n in graph_def.node:
        g.add_node(n.name)
        for t in n.input:
            if not t.startswith("^"):
                src, k = ir.split_tensor(t)
                g.add_edge(src, n.name)
                read.add((src, k))
    on_path = nx.ancestors(g, ir.split_tensor(loss)[0])
    surrogates, to_differentiate = [], []
    for node in marked:
        if node.name not in on_path:
            continue
        inputs = [t for t in node.input if not t.startswith("^")]
        types = list(node.attr["T"].list.type) if "T" in node.attr else []
        results = [t for k, t in enumerate(inputs) if (node.name, k) in read]
        sources = [t for k, t in enumerate(inputs) if t not in results
                   and (k >= len(types) or tf.as_dtype(types[k]).is_floating)]
        why, plain = _surrogate(g, nodes, results, {ir.split_tensor(t)[0] for t in sources})
        if why:
            surrogates.append((node, why))
        elif not plain:
            to_differentiate.append((node, results, sources))
    surrogates += _differentiate(graph_def, to_differentiate)
    if not surrogates:
        return graph_def
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    replayed = {n.name: n for n in out.node}
    for node, why in surrogates:
        if not gradient_replay.register(node, nodes):
            raise _error(name, node.name, why)
        replayed[node.name].attr["_gradient_op_type"].s = gradient_replay.replay_name(
            node.attr["_gradient_op_type"].s.decode()).encode()
    return out


def _error(name, op, why):
    return KfacGraphError(
        f"{name}: op {op!r} has a custom gradient (tf.custom_gradient) whose forward {why}, "
        "and whose gradient function cannot be replayed in the graph kfac_graph re-runs (it "
        "is gone, or holds tensors that graph lacks); compute it by ops TensorFlow "
        "differentiates")


def _differentiate(graph_def, ops) -> list:
    """TensorFlow's own verdict where the forward holds other ops (a loop):
    ``[(node, why)]`` for each whose results have no gradient to any floating input."""
    if not ops:
        return []
    ops = [(node, [_tensor(t) for t in results], [_tensor(t) for t in sources])
           for node, results, sources in ops]
    wanted = list(dict.fromkeys(t for _, results, sources in ops for t in results + sources))
    out = []
    with tf.Graph().as_default():
        tensors = dict(zip(wanted, tf.graph_util.import_graph_def(
            strip_markers(graph_def), return_elements=wanted, name="")))
        for node, results, sources in ops:
            grads = tf.gradients([tensors[t] for t in results], [tensors[t] for t in sources])
            if sources and all(gr is None for gr in grads):
                out.append((node, "has no gradient TensorFlow computes from its inputs"))
    return out


def _surrogate(g, nodes, results, sources) -> tuple[str, bool]:
    """``(why the forward from sources (the floating inputs) to results is a
    surrogate's, or '', whether it holds only _PLAIN ops and cuts)``."""
    plain = True
    for t in results:
        src = ir.split_tensor(t)[0]
        while nodes[src].op in _PASS and src not in sources:
            src = ir.split_tensor(nodes[src].input[0])[0]
        if src in sources:
            return f"passes input {src!r} through unchanged", True
        forward = (nx.ancestors(g, src) | {src}) & (
            set().union(*(nx.descendants(g, s) for s in sources)) | sources)
        loops = sorted(op for op in forward if nodes[op].op in _LOOPS)
        if loops:
            return (f"runs a loop ({loops[0]!r}) whose derivative kfac_graph cannot check "
                    "against the custom gradient"), True
        cuts = {op for op in forward if nodes[op].op in _CUTS or _integer_cast(nodes[op])}
        kept = g.subgraph(forward - cuts)
        reached = set().union(*(nx.descendants(kept, s) for s in sources if s in kept))
        if cuts and src not in reached:
            first = min(cuts)
            return (f"reaches its result only through ops that cut the gradient ({first!r}, "
                    f"{nodes[first].op})"), True
        rounded = sorted(op for op in forward if _rounds_data(nodes[op]))
        if rounded:  # a quantized forward whose scales alone are differentiable
            return (f"reaches its result partly through an op that cuts the gradient "
                    f"({rounded[0]!r}, {nodes[rounded[0]].op})"), True
        plain = plain and all(nodes[op].op in _PLAIN or op in sources or op in cuts
                              for op in forward)
    return "", plain


def _tensor(name: str) -> str:
    return ir.tensor_name(*ir.split_tensor(name))


def _rounds_data(node) -> bool:
    """An op that cuts a floating tensor's gradient: a stop, a rounding or a
    cast of floats to integers (not the integer arithmetic of shapes)."""
    if node.op == "Cast":
        return ("SrcT" in node.attr and tf.as_dtype(node.attr["SrcT"].type).is_floating
                and _integer_cast(node))
    return node.op in _CUTS or node.op in _ROUNDING


def _integer_cast(node) -> bool:
    """A cast to an integer or bool (it rounds the gradient away)."""
    if node.op != "Cast" or "DstT" not in node.attr:
        return False
    dtype = tf.as_dtype(node.attr["DstT"].type)
    return dtype.is_integer or dtype.is_bool
