"""Unroll functional loops whose trip count is static.

Contract: ``unroll_loops(traced, max_iterations) -> Traced`` returns a
``Traced`` whose graph computes the same values, in which every ``While``
/ ``StatelessWhile`` with a trip count ``T`` known when tracing (at most
``max_iterations``) is replaced by ``T`` copies of its body, iteration
``k`` reading iteration ``k - 1``'s outputs (the loop's inputs for ``k =
0``), the loop's outputs being the last copy's. So a recurrent cell's
``MatMul`` becomes ``T`` uses of a dense layer, each reading that step's
input and giving that step's output gradient, and the rest of the pass and
the runtime see an ordinary graph. A loop variable whose value is static at
iteration ``k`` (a counter) is a ``Const`` there, so a ``TensorList`` read
at the counter reads at a constant index. Copies
are named ``<loop>/iteration_<k>/<body node>`` (``ITERATION_SCOPE``).
Loops nested in a body are unrolled in later rounds (at most
``_MAX_ROUNDS`` deep), with the outer counters then constants.

The trip count is read by running the loop's counters in numpy
(``passes.static_eval``): the loop variables the condition reads, and those
the body computes them from, must be static at the start (a counter started
at a constant, a limit that is a constant or a static shape; TensorFlow's
``maximum_iterations`` is one more such pair), and the condition is
evaluated after each iteration until it is false. A loop is kept as it is,
with the reason in ``Traced.kept_loops``, when its condition is not static
(a trip count known only at run time, a variable read in the condition),
when it runs more than ``max_iterations`` times, or when its body writes
state (an assignment: unrolled copies would lose their order). Its
variables then stay generic, the reason naming the loop.

Why unroll, rather than make the loop also emit every iteration's layer
inputs and output gradients as extra loop outputs: the runtime re-runs the
registered graph and reads each use's input and output gradient by name
(``kfac_graph.taps``); unrolled, every use is a tensor of the graph and
``tf.gradients`` gives its output gradient, so every layer kind, rule,
Fisher block and both runtimes work unchanged. Accumulating inside the loop
would need a second loop-aware path through all of them (gradients of the
loop's body with respect to per-iteration values, which ``tf.gradients``
of a ``While`` does not expose). The cost is graph size: ``T`` copies of
the body (measured in ``benchmarks/recurrent.py``, README).
"""
from __future__ import annotations

import dataclasses
import re

import tensorflow as tf
from tensorflow.python.framework import function_def_to_graph, op_def_registry

from passes import frontends, inline
from passes.errors import TraceError
from passes.static_eval import StaticEvaluator

WHILE_OPS = frozenset({"While", "StatelessWhile"})
DEFAULT_MAX_ITERATIONS = 1024
ITERATION_SCOPE = re.compile(r"/iteration_\d+(?=/|$)")
_MAX_ROUNDS = 8
# stateful ops a body may hold: reads, random draws, prints and assertions
# (their order between copies is lost, nothing else), and ops whose own
# bodies are checked (calls, nested loops and branches)
_HARMLESS_STATEFUL = frozenset({
    "ReadVariableOp", "VarHandleOp", "VariableShape", "While", "If", "Case",
    "StatefulPartitionedCall", "PartitionedCall", "RandomUniform", "RandomUniformInt",
    "RandomStandardNormal", "TruncatedNormal", "Multinomial", "PrintV2", "Assert"})
_FUNCTION_ATTRS = ("f", "body", "cond", "then_branch", "else_branch")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A loop to unroll: its trip count and, per iteration, the static
    values of the loop variables its condition depends on."""
    trips: int
    statics: tuple


def unroll_loops(traced: frontends.Traced,
                 max_iterations: int = DEFAULT_MAX_ITERATIONS) -> frontends.Traced:
    """The module docstring's contract."""
    if max_iterations < 0:
        raise ValueError(f"max_iterations must be >= 0, got {max_iterations}")
    unrolled, kept = dict(traced.unrolled_loops), {}
    for _ in range(_MAX_ROUNDS):
        if not any(n.op in WHILE_OPS for n in traced.graph_def.node):
            break
        graph, _ = frontends.import_graph(traced)
        library = {f.signature.name: f for f in traced.graph_def.library.function}
        plans = {}
        for op in graph.get_operations():
            if op.type in WHILE_OPS:
                plan = _plan(op, graph, library, max_iterations)
                if isinstance(plan, str):
                    kept[op.name] = plan
                else:
                    plans[op.name] = plan
        if not plans:
            break
        graph_def, renames = _rewrite(traced.graph_def, plans, library)
        graph_def, call_renames = inline.inline_calls(graph_def)
        renames.update(call_renames)
        output = inline.follow(renames, traced.output)
        unrolled.update({name: plan.trips for name, plan in plans.items()})
        traced = dataclasses.replace(traced, graph_def=graph_def, output=output)
    else:
        for node in traced.graph_def.node:
            if node.op in WHILE_OPS:
                kept.setdefault(node.name, f"loops nested more than {_MAX_ROUNDS} deep")
    still = {n.name for n in traced.graph_def.node if n.op in WHILE_OPS}
    return dataclasses.replace(traced, unrolled_loops=unrolled,
                               kept_loops={k: v for k, v in kept.items() if k in still})


def _plan(op, graph, library, max_iterations):
    """A ``_Plan`` for the loop ``op``, or why it cannot be unrolled."""
    why = _unsafe_op(library[op.get_attr("body").name], library)
    if why:
        return why
    shapes = [t.shape for t in op.inputs]
    with graph.as_default():
        cond = function_def_to_graph.function_def_to_graph(
            library[op.get_attr("cond").name], input_shapes=shapes)
        body = function_def_to_graph.function_def_to_graph(
            library[op.get_attr("body").name], input_shapes=shapes)
    needed = _needed(cond, body)
    outer = StaticEvaluator()
    values = {j: outer.value(op.inputs[j]) for j in needed}
    dynamic = [j for j in sorted(needed) if values[j] is None]
    if dynamic:
        return (f"its trip count is not static: its condition depends on "
                f"{op.inputs[dynamic[0]].name}, not known when tracing")
    statics = []
    for k in range(max_iterations + 1):
        go = StaticEvaluator({cond.inputs[j].name: v for j, v in values.items()}).value(
            cond.outputs[0])
        if go is None:
            return "its trip count is not static: its condition is not known when tracing"
        if not bool(go):
            return _Plan(k, tuple(statics))
        if k == max_iterations:
            break
        statics.append(values)
        step = StaticEvaluator({body.inputs[j].name: v for j, v in values.items()})
        values = {j: step.value(body.outputs[j]) for j in needed}
        if any(v is None for v in values.values()):
            return f"its trip count is not static: a counter is not known after iteration {k}"
    return (f"it runs more than {max_iterations} iterations "
            "(the limit: auto_register's max_loop_iterations)")


def _needed(cond, body) -> set:
    """The loop variables the condition depends on, and those the body
    computes them from (a fixpoint)."""
    index = {t.name: j for j, t in enumerate(body.inputs)}
    cond_index = {t.name: j for j, t in enumerate(cond.inputs)}
    needed = _arguments_of(cond.outputs[0], cond_index)
    frontier = set(needed)
    while frontier:
        new = set()
        for j in frontier:
            new |= _arguments_of(body.outputs[j], index)
        frontier = new - needed
        needed |= new
    return needed


def _arguments_of(tensor, index) -> set:
    """The arguments (by position) among ``tensor``'s ancestors."""
    found, seen, stack = set(), set(), [tensor]
    while stack:
        t = stack.pop()
        if t.name in seen:
            continue
        seen.add(t.name)
        if t.name in index:
            found.add(index[t.name])
        stack.extend(t.op.inputs)
    return found


def _unsafe_op(fdef, library, depth=0) -> str:
    """Why ``fdef`` (or a function it calls) cannot be copied out: an op
    that writes state (not a read, a random draw, a print or an assertion),
    or one TensorFlow does not know here; "" when there is none."""
    for node in fdef.node_def:
        called = [node.attr[k].func.name for k in _FUNCTION_ATTRS if k in node.attr]
        if node.op in library:
            called.append(node.op)
        else:
            op_def = op_def_registry.get(node.op)
            if op_def is None:
                return f"its body has op {node.name!r} ({node.op}), unknown to TensorFlow here"
            if op_def.is_stateful and node.op not in _HARMLESS_STATEFUL:
                return f"its body writes state (op {node.name!r}, {node.op})"
        for name in called:
            why = (_unsafe_op(library[name], library, depth + 1)
                   if name in library and depth < _MAX_ROUNDS else "")
            if why:
                return why
    return ""


def _rewrite(graph_def, plans, library):
    """The GraphDef with each planned loop replaced by its copies, and the
    renaming of the loops' outputs to the last copy's."""
    names = {n.name for n in graph_def.node}
    out, renames = [], {}
    holder = inline.library_graph(graph_def)  # (a body's nested loops name its functions)
    for node in graph_def.node:
        plan = plans.get(node.name)
        if plan is None:
            out.append(node)
            continue
        with holder.as_default():
            nodes, outputs = _copies(node, plan, library[node.attr["body"].func.name])
        clash = [n.name for n in nodes if n.name in names and n.name != node.name]
        if clash:
            raise TraceError(f"cannot unroll loop {node.name!r}: its copy {clash[0]!r} "
                             "would take the name of a node of the graph")
        out.extend(nodes)
        renames.update({f"{node.name}:{j}": t for j, t in enumerate(outputs)})
    result = tf.compat.v1.GraphDef()
    result.versions.CopyFrom(graph_def.versions)
    result.library.CopyFrom(graph_def.library)
    result.node.extend(out)  # (copies: the input graph stays as it was)
    for node in result.node:
        inline.rename_inputs(node, renames)
    return result, renames


def _copies(loop, plan: _Plan, fdef):
    """The body nodes of every iteration of ``loop`` and the last one's
    output tensor names; a ``NoOp`` named as the loop waits on them all."""
    converted = function_def_to_graph.function_def_to_graph_def(fdef)
    state = [t for t in loop.input if not t.startswith("^")]
    controls = [t for t in loop.input if t.startswith("^")]
    types = loop.attr["T"].list.type
    nodes = []
    for k in range(plan.trips):
        scope = f"{loop.name}/iteration_{k}/"
        inputs = list(state)
        for j, value in plan.statics[k].items():
            const = tf.compat.v1.NodeDef(name=f"{scope}loop_var_{j}", op="Const")
            const.attr["dtype"].type = types[j]
            const.attr["value"].tensor.CopyFrom(
                tf.make_tensor_proto(value, tf.dtypes.as_dtype(types[j])))
            const.input.extend(controls if k == 0 else ())
            nodes.append(const)
            inputs[j] = const.name
        body, state = inline.instantiate(
            fdef, inputs, lambda name, s=scope: s + _relative(loop.name, name),
            controls if k == 0 else (), converted)
        nodes.extend(body)
    referenced = {t.lstrip("^").split(":")[0] for n in nodes for t in n.input}
    waiter = tf.compat.v1.NodeDef(name=loop.name, op="NoOp")
    waiter.input.extend(controls + ["^" + n.name for n in nodes if n.name not in referenced])
    return nodes + [waiter], state


def _relative(loop: str, name: str) -> str:
    """A body node's name without the loop's scope (the longest tail of
    the loop's name that starts it: an inlined loop keeps its body's
    names)."""
    parts = loop.split("/")
    for i in range(len(parts)):
        scope = "/".join(parts[i:]) + "/"
        if name.startswith(scope):
            return name[len(scope):]
    return name
