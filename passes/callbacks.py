"""Python callbacks in the graph: ``tf.py_function`` (op ``EagerPyFunc``) and
``tf.numpy_function`` / ``tf.compat.v1.py_func`` (``PyFunc``,
``PyFuncStateless``).

Such an op names its Python function by a token (attribute ``token``,
``"pyfunc_<n>"``) in TensorFlow's process-wide registry
(``script_ops._py_funcs``), which holds the function as long as the graph
that traced it lives (for a ``tf.function`` traced eagerly: the process).
kfac_graph re-imports the registration's GraphDef into its own functions;
the re-imported op still names the function by the token, so it runs when,
and only when, the token names the traced function in this process:

- a traced function (``from_concrete_function`` of a function traced
  here): the token is checked to be registered, and the callbacks' static
  output shapes, which a GraphDef does not carry, are written into their
  ``_output_shapes`` (the importer reads them), so the layers after a
  callback keep their shapes;
- a SavedModel or GraphDef: its tokens were made by another process (or
  name an unrelated function of this one), so the callback is refused.

Gradients are TensorFlow's own: ``EagerPyFunc``'s registered gradient,
none through ``PyFunc`` (the layers before it get zero gradients, as
``tf.GradientTape`` gives them none).
"""
from __future__ import annotations

from tensorflow.python.ops import script_ops

from passes.errors import KfacGraphError

CALLBACK_OPS = {"EagerPyFunc": "tf.py_function", "PyFunc": "tf.numpy_function",
                "PyFuncStateless": "tf.numpy_function"}


def callback_nodes(graph_def) -> list:
    """The callback ops of ``graph_def`` (top level: inlined bodies included)."""
    return [n for n in graph_def.node if n.op in CALLBACK_OPS]


def refuse_callbacks(graph_def, name: str, source: str) -> None:
    """Raises for the first callback op: ``source`` (a SavedModel, a
    GraphDef) cannot carry its Python function."""
    for node in callback_nodes(graph_def):
        raise KfacGraphError(f"{name}: {CALLBACK_OPS[node.op]} op {node.name!r} cannot be re-run "
                             f"by kfac_graph: {source} does not carry its Python function "
                             f"(token {_token(node)!r}); register the Python function instead")


def check_live_callbacks(graph_def, name: str, graph=None) -> None:
    """Checks that every callback op's token names a function registered in
    this process, and (with ``graph``, the traced graph the nodes came from)
    writes the ops' static output shapes into ``_output_shapes``."""
    for node in callback_nodes(graph_def):
        token = _token(node)
        if script_ops._py_funcs.get(token) is None:  # noqa: SLF001 - TF's registry
            raise KfacGraphError(
                f"{name}: {CALLBACK_OPS[node.op]} op {node.name!r} cannot be re-run by "
                f"kfac_graph: its Python function (token {token!r}) is no longer registered "
                "in this process (the graph that traced it is gone)")
        if graph is not None and "_output_shapes" not in node.attr:
            try:
                op = graph.get_operation_by_name(node.name)
            except KeyError:
                continue
            if op.type != node.op:
                continue
            shapes = node.attr["_output_shapes"].list.shape
            for output in op.outputs:
                shapes.add().CopyFrom(output.shape.as_proto())


def _token(node) -> str:
    return node.attr["token"].s.decode()
