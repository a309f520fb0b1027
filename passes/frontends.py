"""Front ends: a traced function, a SavedModel or a GraphDef, to one IR.

Each front end produces a ``Traced``: the GraphDef with function calls
inlined, the argument placeholders, the loss tensor, and the variables the
graph reads (with the objects behind them where there are any). ``to_ir``
turns a ``Traced`` into the IR of ``passes.ir``.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Sequence

import networkx as nx
import tensorflow as tf
from google.protobuf import message

from passes import callbacks, custom_gradients, inline, ir, keras_frozen, keras_reach
from passes.one_device import one_device  # noqa: F401  (passes.frontends.one_device)
from passes.errors import LoadError, TraceError
from passes.table_shapes import shaped_table_finds

_VARIABLE_PREFIX = "kfac_graph_variable"


@dataclasses.dataclass(frozen=True)
class Traced:
    """A function's graph, ready for the passes.

    ``placeholder_variables`` maps each node that holds a variable (a captured
    resource placeholder, or a ``VarHandleOp``) to the variable's key;
    ``objects`` maps keys to the ``tf.Variable`` objects where known.
    ``unrolled_loops``: loop name -> its trip count, for the loops
    ``passes.unroll`` copied out; ``kept_loops``: loop name -> why it was
    not unrolled. ``batch_axes``: op name -> the axes of its output that
    hold the batch, where the batch is known at run time only
    (``passes.shape_probe``); ``probed_values``: op name -> the value of
    its operand that the probes evaluated, one per probe (a dilated
    convolution's paddings and crops, computed from a size known at run
    time only). ``constraints``: key -> the constraint Keras
    applies to the variable after each update (``keras_frozen.flags``).
    ``resources``: placeholder node -> the captured resource handle it
    stands for, other than a variable's (a lookup table's).
    ``replica_reads``: the name scopes where the trace read across replicas
    (``passes.one_device``; one device's trace reads its own values there).
    """
    graph_def: Any
    arguments: tuple[str, ...]
    output: str
    variables: dict[str, ir.VariableInfo]
    placeholder_variables: dict[str, str]
    objects: dict[str, Any]
    name: str = "fn"
    kept_loops: dict = dataclasses.field(default_factory=dict)
    unrolled_loops: dict = dataclasses.field(default_factory=dict)
    batch_axes: dict = dataclasses.field(default_factory=dict)
    probed_values: dict = dataclasses.field(default_factory=dict)
    constraints: dict = dataclasses.field(default_factory=dict)
    resources: dict = dataclasses.field(default_factory=dict)
    replica_reads: tuple = ()


def trace(fn: Callable, args: Sequence[Any], kwargs: dict | None = None) -> Traced:
    """Traces ``fn(*args, **kwargs)`` with ``tf.function`` (or uses ``fn``'s own
    if it is one) as one device (``one_device``) and returns its graph."""
    tf_fn = fn if hasattr(fn, "get_concrete_function") else tf.function(fn)
    try:
        with one_device() as probe:
            concrete = tf_fn.get_concrete_function(*args, **(kwargs or {}))
    except (TypeError, ValueError) as e:
        raise TraceError(f"could not trace {_name(fn)}: {error_line(e)}") from e
    return from_concrete_function(concrete, name=_name(fn), reached=keras_reach.reached(fn),
                                  replica_reads=replica_reads(concrete, probe))


def replica_reads(concrete, probe, traced: bool | None = None) -> tuple | None:
    """Where ``concrete``'s trace read across replicas (``passes.one_device``):
    ``probe``'s record, kept on the function's graph for a later trace that
    finds it in ``tf.function``'s cache. ``traced``: whether ``concrete`` was
    traced inside ``probe`` (None: unknown); if it was not and its graph has
    no record, it was traced outside any probe, and its reads are unknown
    (None)."""
    if traced or probe.reads:
        concrete.graph.kfac_graph_replica_reads = tuple(probe.reads)
    recorded = getattr(concrete.graph, "kfac_graph_replica_reads", None)
    if recorded is None and traced is None:
        return ()
    return recorded


def from_concrete_function(concrete, name: str = "fn", extra_variables=(),
                           source: str | None = None, reached=None,
                           replica_reads: tuple = ()) -> Traced:
    """The ``Traced`` of a concrete function (traced here or loaded: then
    ``source`` names where from, and Python callbacks are refused, see
    ``callbacks.py``); ``reached``: what the traced Python function holds
    (``keras_reach.reached``), ``replica_reads``: where its trace read across
    replicas (``replica_reads``)."""
    graph = concrete.graph
    # what the function returns: once a tape has differentiated it, the graph
    # also outputs the intermediates its gradient reads
    structured = getattr(concrete, "structured_outputs", None)
    returned = graph.outputs[:len(tf.nest.flatten(structured, expand_composites=True))]
    outputs = [t for t in returned if t.dtype != tf.resource]
    if len(outputs) != 1:
        raise TraceError(f"{name} returns {len(outputs)} tensors; it must return one scalar loss")
    loss = outputs[0]
    if loss.shape.rank != 0:
        raise TraceError(f"{name} returns a tensor of shape {loss.shape}; it must return a scalar loss")
    if not loss.dtype.is_floating:
        raise TraceError(f"{name} returns a {loss.dtype.name} tensor; the loss must be floating point")
    by_handle = {}
    for v in list(getattr(concrete, "variables", ())) + list(graph.variables) + list(extra_variables):
        by_handle.setdefault(id(v.handle), v)
    placeholders, objects, infos, constraints = {}, {}, {}, {}
    flags = keras_frozen.flags(by_handle.values(), reached)
    for external, internal in graph.captures:
        var = by_handle.get(id(external))
        if internal.dtype != tf.resource or var is None:
            continue
        if id(var) in flags.overwritten:
            raise TraceError(f"{name} reads variable {var.name}, which Keras overwrites with "
                             "its gradient (float8 training's scales): it is no parameter, "
                             "and kfac_graph does not train such a model")
        key = _unique(var.name.split(":")[0], infos)
        trainable = bool(var.trainable) and id(var) not in flags.frozen
        infos[key] = ir.VariableInfo(key, var.name, tuple(var.shape.as_list()),
                                     var.dtype.name, trainable)
        objects[key] = var
        if trainable and id(var) in flags.constraints:
            constraints[key] = flags.constraints[id(var)]
        placeholders[internal.op.name] = key
    n_args = len(graph.inputs) - len(graph.captures)
    arguments = tuple(t.op.name for t in graph.inputs[:n_args])
    graph_def = freeze_captured_constants(graph.as_graph_def(), graph.captures)
    resources = {internal.op.name: external for external, internal in graph.captures
                 if internal.dtype == tf.resource and internal.op.name not in placeholders}
    graph_def, renames = inline.inline_calls(graph_def)
    graph_def = shaped_table_finds(graph_def)
    graph_def = custom_gradients.honour(graph_def, inline.follow(renames, loss.name), name)
    if source is None:
        callbacks.check_live_callbacks(graph_def, name, graph)
    else:
        callbacks.refuse_callbacks(graph_def, name, source)
    return Traced(graph_def, arguments, inline.follow(renames, loss.name),
                  infos, placeholders, objects, name, constraints=constraints,
                  resources=resources, replica_reads=replica_reads)


def freeze_captured_constants(graph_def, captures):
    """``graph_def`` with the placeholder of every captured eager tensor (a
    constant the function closes over: ``tf.function`` captures one with more
    than a few elements by reference, and a Keras functional model holds
    what it computed at construction that way) turned into a ``Const`` node
    holding its value, so the graph runs on its own once re-imported.
    Captured variables stay placeholders (the runtime maps them)."""
    values = {internal.op.name: external for external, internal in captures
              if internal.dtype != tf.resource and hasattr(external, "numpy")}
    if not values:
        return graph_def
    frozen = type(graph_def)()
    frozen.CopyFrom(graph_def)
    for node in frozen.node:
        if node.name in values and node.op == "Placeholder":
            value = values[node.name].numpy()
            node.op = "Const"
            node.ClearField("attr")
            node.attr["dtype"].type = tf.as_dtype(value.dtype).as_datatype_enum
            node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value))
    return frozen


def read_saved_model(path: str):
    """The SavedModel at ``path``, loaded; a one-line ``LoadError`` for a
    missing directory, one that is not a SavedModel, or a failed load."""
    if not os.path.isdir(path):
        raise LoadError(f"no SavedModel directory at {path}")
    if not tf.saved_model.contains_saved_model(path):
        raise LoadError(f"{path} is not a SavedModel (no saved_model.pb in it)")
    try:
        return tf.saved_model.load(path)
    except Exception as e:  # noqa: BLE001 - TF raises many types here
        raise LoadError(f"could not load the SavedModel at {path}: {error_line(e)}") from e


def load_saved_model(path: str, function: str, args: Sequence[Any] | None = None) -> Traced:
    """The ``Traced`` of the saved ``tf.function`` (or signature) ``function``
    of the SavedModel at ``path``. ``args`` picks one of several traces."""
    loaded = read_saved_model(path)
    fn = getattr(loaded, function, None)
    if fn is None and function in getattr(loaded, "signatures", {}):
        fn = loaded.signatures[function]
    if fn is None:
        found = sorted(set(getattr(loaded, "signatures", {}).keys()) |
                       {k for k in dir(loaded) if not k.startswith("_") and
                        hasattr(getattr(loaded, k, None), "concrete_functions")})
        raise LoadError(f"the SavedModel at {path} has no function {function!r}; "
                        f"it has: {', '.join(found) or 'none'}")
    if args is not None and hasattr(fn, "get_concrete_function"):
        concrete = fn.get_concrete_function(*args)
    elif hasattr(fn, "concrete_functions"):
        concretes = list(fn.concrete_functions)
        if len(concretes) != 1:
            raise LoadError(f"{function!r} in {path} has {len(concretes)} traces; "
                            "pass example arguments to pick one")
        concrete = concretes[0]
    else:
        concrete = fn
    check_dense_arguments(getattr(concrete, "structured_input_signature", ()),
                          f"{function!r} in {path}", LoadError)
    extra = list(getattr(loaded, "variables", ()) or ())
    return from_concrete_function(concrete, name=function, extra_variables=extra,
                                  source=f"the SavedModel at {path}")


def check_dense_arguments(args, name, error=TraceError):
    """Sparse and ragged arguments (values or specs) are refused in one line:
    the pass follows the examples along the first axis of each argument's
    tensors, and a ``tf.SparseTensor``'s ``indices`` and ``values`` (a
    ``tf.RaggedTensor``'s ``flat_values``) lead with the nonzeros."""
    for i, arg in enumerate(tf.nest.flatten(args)):
        if isinstance(arg, (tf.SparseTensor, tf.SparseTensorSpec)):
            raise error(
                f"{name}: argument {i} is a tf.SparseTensor, whose indices and values lead "
                "with the nonzeros, not the examples; pass tf.sparse.to_dense(x) (a Keras Dense "
                "on a sparse Input computes the same on it) or make the sparse tensor inside "
                "the function (tf.sparse.from_dense)")
        if isinstance(arg, (tf.RaggedTensor, tf.RaggedTensorSpec)):
            raise error(
                f"{name}: argument {i} is a tf.RaggedTensor, whose values lead with the items, "
                "not the examples; pass x.to_tensor() and a mask, or make the ragged tensor "
                "inside the function (tf.RaggedTensor.from_tensor)")


def load_graph_def(path_or_graph_def, output: str, arguments: Sequence[str] = ()) -> Traced:
    """The ``Traced`` of a GraphDef (a file, binary or text, or a proto).

    ``output`` names the loss tensor; ``arguments`` the input placeholders
    (default: every non-resource ``Placeholder``). Variables are the
    ``VarHandleOp`` nodes and the resource placeholders a ``ReadVariableOp``
    reads (a traced function's captures); there are no variable objects, so
    layers list ``GraphVariable`` stand-ins. A resource placeholder's shape
    is read from its ``ReadVariableOp``'s ``_output_shapes``: write such a
    graph with ``as_graph_def(add_shapes=True)``, else its shape is unknown
    and its layer is generic.
    """
    graph_def = path_or_graph_def
    if isinstance(path_or_graph_def, (str, os.PathLike)):
        graph_def = read_graph_def(os.fspath(path_or_graph_def))
    names = {n.name for n in graph_def.node}
    if ir.split_tensor(output)[0] not in names:
        raise LoadError(f"the GraphDef has no node {output!r} for the loss")
    reads = {}
    for node in graph_def.node:
        if node.op == "ReadVariableOp" and node.input:
            reads.setdefault(node.input[0].split(":")[0], node)
    infos, placeholders = {}, {}
    for node in graph_def.node:
        if node.op == "VarHandleOp":
            key = _unique(node.attr["shared_name"].s.decode() or node.name, infos)
            shape = _dims(node.attr["shape"].shape)
            dtype = node.attr["dtype"].type
        elif node.op == "Placeholder" and node.attr["dtype"].type == tf.resource.as_datatype_enum:
            read = reads.get(node.name)
            if read is None:
                continue
            key = _unique(node.name, infos)
            shapes = read.attr["_output_shapes"].list.shape
            shape = _dims(shapes[0]) if shapes else None
            dtype = read.attr["dtype"].type
        else:
            continue
        infos[key] = ir.VariableInfo(key, key, shape, tf.dtypes.as_dtype(dtype).name)
        placeholders[node.name] = key
    if not arguments:
        arguments = tuple(n.name for n in graph_def.node if n.op == "Placeholder"
                          and n.name not in placeholders
                          and n.attr["dtype"].type != tf.resource.as_datatype_enum)
    inlined, renames = inline.inline_calls(graph_def)
    callbacks.refuse_callbacks(inlined, "graph_def", "a GraphDef")
    return Traced(inlined, tuple(arguments), inline.follow(renames, ir.tensor_name(*ir.split_tensor(output))),
                  infos, placeholders, {}, "graph_def")


def to_ir(traced: Traced) -> nx.DiGraph:
    """Imports the inlined GraphDef (so TensorFlow infers static shapes, with
    each variable's shape known to its reads) and builds the IR; the loops
    the graph still has are in ``g.graph["loops"]`` (name -> why not unrolled)."""
    graph, holders = import_graph(traced)
    g = ir.from_tf_graph(graph, traced.arguments, traced.output, traced.variables, holders)
    g.graph["loops"] = dict(traced.kept_loops)
    g.graph["batch_axes"] = dict(traced.batch_axes)
    g.graph["probed_values"] = dict(traced.probed_values)
    return g


def import_graph(traced: Traced):
    """``(tf.Graph, holders)``: the GraphDef imported with a ``VarHandleOp``
    of the right shape for each variable placeholder (``holders``: its name
    -> the variable's key)."""
    graph = tf.Graph()
    input_map, holders = {}, {}
    with graph.as_default():
        for node, key in traced.placeholder_variables.items():
            info = traced.variables[key]
            handle = tf.raw_ops.VarHandleOp(
                dtype=tf.dtypes.as_dtype(info.dtype), shape=tf.TensorShape(info.shape),
                shared_name=key, name=f"{_VARIABLE_PREFIX}_{len(holders)}")
            holders[handle.op.name] = key
            input_map[ir.tensor_name(node)] = handle
        try:
            tf.graph_util.import_graph_def(traced.graph_def, input_map=input_map, name="")
        except (ValueError, tf.errors.OpError) as e:
            raise LoadError(f"could not import the graph of {traced.name}: {error_line(e)}") from e
    return graph, holders


def read_graph_def(path: str):
    """The GraphDef in the file at ``path`` (binary ``.pb`` or text ``.pbtxt``);
    ``LoadError`` when there is none."""
    if not os.path.isfile(path):
        raise LoadError(f"no GraphDef file at {path}")
    with open(path, "rb") as f:
        data = f.read()
    graph_def = tf.compat.v1.GraphDef()
    try:
        graph_def.ParseFromString(data)
        if graph_def.node:
            return graph_def
    except message.DecodeError:
        pass
    from google.protobuf import text_format
    try:
        text_format.Parse(data.decode("utf-8"), graph_def)
    except (UnicodeDecodeError, text_format.ParseError) as e:
        raise LoadError(f"{path} is not a GraphDef (binary or text): {error_line(e)}") from e
    return graph_def


def _dims(shape_proto):
    if shape_proto.unknown_rank:
        return None
    return tuple(d.size if d.size >= 0 else None for d in shape_proto.dim)


def _unique(name: str, taken) -> str:
    key, i = name, 1
    while key in taken:
        key, i = f"{name}_{i}", i + 1
    return key


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def error_line(e: BaseException) -> str:
    """The line of a TensorFlow error that says what went wrong (autograph
    wraps it after "in user code:" and a traceback)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # Keras bolds its message
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    # Keras lists the call's arguments after the message: not what went wrong
    cut = [i for i, line in enumerate(lines) if line.startswith("Arguments received by")]
    lines = lines[:cut[0]] if cut else lines
    if not lines:
        return type(e).__name__
    return lines[-1] if lines[0].startswith("in user code") else lines[0]
