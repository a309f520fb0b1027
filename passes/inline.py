"""Inline function calls in a GraphDef so layers inside them are visible.

Contract: ``inline_calls(graph_def)`` returns a GraphDef that
computes the same values in which every ``PartitionedCall`` /
``StatefulPartitionedCall`` (nested ``tf.function``s, loaded SavedModel
functions) and every direct call of a library function is replaced by the
function's body. Body nodes are named ``<call node>/<body node>`` (and their
colocations follow them); the call
node's name is kept by a ``NoOp`` that waits on the body, so control
dependencies on the call still hold. Control-flow ops (``While``, ``If``) keep
their bodies as functions. The function library keeps the functions the
inlined nodes still name (their bodies, and the functions those name), and
only them: an inlined call's function (say, one Keras compiled with XLA) would
otherwise travel into every graph built from this one, unused.
"""
from __future__ import annotations

import tensorflow as tf
from tensorflow.python.framework import function_def_to_graph

from passes.errors import LoadError

_CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")
_MAX_DEPTH = 64


def inline_calls(graph_def: tf.compat.v1.GraphDef
                 ) -> tuple[tf.compat.v1.GraphDef, dict[str, str]]:
    """Returns the inlined GraphDef and the renaming of call outputs
    (``"call:0"`` -> the body tensor that now computes it); apply
    ``follow(renames, name)`` to map an old tensor name to the new one."""
    all_renames: dict[str, str] = {}
    library = {f.signature.name: f for f in graph_def.library.function}
    holder = library_graph(graph_def)
    nodes = list(graph_def.node)
    for _ in range(_MAX_DEPTH):
        calls = [n for n in nodes if _callee(n, library)]
        if not calls:
            break
        renames: dict[str, str] = {}
        out = []
        for node in nodes:
            callee = _callee(node, library)
            if callee:
                with holder.as_default():
                    body, outputs = _body(node, library[callee])
                out.extend(body)
                renames.update({f"{node.name}:{i}": t for i, t in enumerate(outputs)})
            else:
                out.append(node)
        for node in out:
            rename_inputs(node, renames)
        all_renames.update(renames)
        nodes = out
    else:
        raise LoadError(f"function calls nested deeper than {_MAX_DEPTH} levels")
    result = tf.compat.v1.GraphDef()
    result.versions.CopyFrom(graph_def.versions)
    kept = _named_functions(nodes, library)
    result.library.CopyFrom(graph_def.library)
    del result.library.function[:]
    result.library.function.extend(f for name, f in library.items() if name in kept)
    result.node.extend(nodes)
    drop_lost_colocations(result)
    return result, all_renames


def drop_lost_colocations(graph_def) -> None:
    """Drops, in place, each colocation (``_class: loc:@node``) with a node
    ``graph_def`` does not hold: a function body names the caller's graph's
    nodes there (Keras 2's embedding lookup, with its table's handle), which
    an import refuses. Colocation only guides placement; a resource op is
    placed with its resource anyway."""
    names = {node.name for node in graph_def.node}
    for node in graph_def.node:
        if "_class" in node.attr:
            kept = [c for c in node.attr["_class"].list.s
                    if c[len(b"loc:@"):].decode() in names]
            if kept:
                node.attr["_class"].list.s[:] = kept
            else:
                del node.attr["_class"]


def _named_functions(nodes, library) -> set[str]:
    """The library functions ``nodes`` name in their ops or attributes, and
    those their bodies name, transitively."""
    def names(node_defs):
        for node in node_defs:
            if node.op in library:
                yield node.op
            for value in node.attr.values():
                funcs = [value.func] if value.HasField("func") else list(value.list.func)
                yield from (f.name for f in funcs if f.name in library)

    kept, todo = set(), list(names(nodes))
    while todo:
        name = todo.pop()
        if name not in kept:
            kept.add(name)
            todo.extend(names(library[name].node_def))
    return kept


def library_graph(graph_def) -> tf.Graph:
    """A graph holding ``graph_def``'s function library: a body that calls a
    library function directly (its op is the function's name) is read
    against it, whatever graph is the default (saving traces in a fresh one)."""
    graph = tf.Graph()
    library_only = tf.compat.v1.GraphDef()
    library_only.library.CopyFrom(graph_def.library)
    with graph.as_default():
        tf.graph_util.import_graph_def(library_only, name="")
    return graph


def _callee(node, library) -> str | None:
    if node.op in _CALL_OPS:
        name = node.attr["f"].func.name
        return name if name in library else None
    return node.op if node.op in library else None


def _body(call, fdef):
    """The call's body nodes (prefixed) and the tensor names of its outputs."""
    data_inputs = [t for t in call.input if not t.startswith("^")]
    call_controls = [t for t in call.input if t.startswith("^")]
    prefix = call.name + "/"
    nodes, outputs = instantiate(fdef, data_inputs, lambda name: prefix + name, call_controls)
    referenced = {t.lstrip("^").split(":")[0] for n in nodes for t in n.input}
    waiter = tf.compat.v1.NodeDef(name=call.name, op="NoOp")
    waiter.input.extend("^" + n.name for n in nodes if n.name not in referenced)
    return nodes + [waiter], outputs


def instantiate(fdef, inputs, rename, controls=(), converted=None):
    """The nodes of function ``fdef``'s body applied to ``inputs`` (tensor
    names, one per input argument), each renamed by ``rename(name)``; nodes
    with no inputs wait on ``controls``; and the tensor names of its outputs
    (an output that is an argument is that input). ``converted``: the
    ``function_def_to_graph_def(fdef)`` pair, when the caller has it."""
    body_def, flat = converted or function_def_to_graph.function_def_to_graph_def(fdef)
    args = {a.name: inputs[i] for i, a in enumerate(fdef.signature.input_arg)}

    def outer(t: str) -> str:
        control = t.startswith("^")
        bare = t[1:] if control else t
        node = bare.split(":")[0]
        if node in args:
            target = args[node]
            return "^" + target.split(":")[0] if control else target
        return ("^" if control else "") + rename(node) + bare[len(node):]

    nodes = []
    for node in body_def.node:
        if node.name in args:
            continue
        new = tf.compat.v1.NodeDef()
        new.CopyFrom(node)
        new.name = rename(node.name)
        if "_class" in new.attr:  # colocation with a body node (or argument): its new name
            new.attr["_class"].list.s[:] = [
                b"loc:@" + outer(c[len(b"loc:@"):].decode()).split(":")[0].encode()
                for c in node.attr["_class"].list.s]
        inputs_ = [outer(t) for t in node.input] or list(controls)
        del new.input[:]
        new.input.extend(inputs_)
        nodes.append(new)
    return nodes, [outer(flat[fdef.ret[a.name]]) for a in fdef.signature.output_arg]


def rename_inputs(node, renames) -> None:
    inputs = [t if t.startswith("^") else follow(renames, t) for t in node.input]
    if inputs != list(node.input):
        del node.input[:]
        node.input.extend(inputs)


def follow(renames: dict[str, str], t: str) -> str:
    """Maps a tensor name through ``renames`` (transitively)."""
    seen = set()
    while t not in seen:
        seen.add(t)
        key = t if ":" in t else t + ":0"
        if key not in renames:
            return t
        t = renames[key]
    return t
