"""A ``tf.custom_gradient``'s own gradient, replayed in a re-imported graph.

``tf.custom_gradient`` registers, under the name its ``IdentityN`` carries
(``_gradient_op_type``, ``"CustomGradient-<n>"``), a Python function whose
closures hold tensors of the traced graph: the forward's inputs and results
and whatever the user's ``grad_fn`` kept (the CTC loss on dense labels keeps
the gradient its forward pass computed). A graph kfac_graph imports again
cannot reach those tensors, so the function cannot run there as it is.

``register(node, names)`` registers, under ``replay_name(marker)``, a gradient
that rebuilds the function with every tensor in its closures (through nested
functions, lists and tuples) replaced by the imported graph's tensor of the
same name: one the ``IdentityN`` reads is taken from the imported op's own
inputs (an argument or a variable the import mapped), any other by its name
under the import's prefix. It returns False, and registers nothing, when the
function is gone from this process or a tensor it holds is not in the graph
(``names``: the graph's node names), so the caller can refuse the op instead.
``rebuilt(marker, mapped)`` is that function with each tensor it holds
(``held(marker)``) replaced by ``mapped(tensor)`` in any graph, to build its
ops elsewhere (``passes.gradient_coupling`` reads them).
"""
from __future__ import annotations

import types

import tensorflow as tf
from tensorflow.python.framework import ops

from passes import ir

PREFIX = "KfacGraphReplay-"
_DEPTH = 4


def replay_name(marker: str) -> str:
    return PREFIX + marker


def register(node, names) -> bool:
    """Registers the replay of ``node``'s custom gradient (module docstring);
    whether it could."""
    marker = node.attr["_gradient_op_type"].s.decode()
    original = _original(marker)
    if original is None:
        return False
    inputs = [ir.tensor_name(*ir.split_tensor(t)) for t in node.input if not t.startswith("^")]
    if any(t.name not in inputs and t.op.name not in names for t in _tensors(original, _DEPTH)):
        return False
    name = replay_name(marker)
    try:
        ops._gradient_registry.lookup(name)  # noqa: SLF001 - registered by an earlier trace
        return True
    except LookupError:
        pass
    position = {t: k for k, t in enumerate(inputs)}
    own = node.name

    def replay(op, *grads):
        prefix = op.name[:len(op.name) - len(own)]
        graph = op.graph

        def mapped(t):
            if t.name in position:
                return op.inputs[position[t.name]]
            return graph.get_tensor_by_name(prefix + t.name)

        return _rebound(original, mapped, _DEPTH)(op, *grads)

    tf.RegisterGradient(name)(replay)
    return True


def held(marker: str) -> tuple:
    """The graph tensors the gradient function registered under ``marker``
    holds in its closures (each once); None where it is gone."""
    original = _original(marker)
    if original is None:
        return None
    return tuple({t.name: t for t in _tensors(original, _DEPTH)}.values())


def rebuilt(marker: str, mapped):
    """The gradient function registered under ``marker``, called as
    ``fn(op, *grads)``, with each tensor ``t`` it holds replaced by
    ``mapped(t)``; None where it is gone from this process."""
    original = _original(marker)
    return None if original is None else _rebound(original, mapped, _DEPTH)


def _original(marker: str):
    try:
        return ops._gradient_registry.lookup(marker)  # noqa: SLF001 - TF's registry
    except LookupError:
        return None


def _symbolic(value) -> bool:
    return isinstance(value, tf.Tensor) and not hasattr(value, "numpy")


def _tensors(fn, depth):
    """The graph tensors in ``fn``'s closures, nested functions included."""
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        yield from _values(value, depth)


def _values(value, depth):
    if _symbolic(value):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _values(v, depth)
    elif isinstance(value, types.FunctionType) and depth > 0:
        yield from _tensors(value, depth - 1)


def _rebound(fn, mapped, depth):
    """``fn`` with every graph tensor in its closures ``mapped``."""
    if not fn.__closure__:
        return fn
    cells = []
    for cell in fn.__closure__:
        try:
            value = cell.cell_contents
        except ValueError:
            cells.append(cell)
            continue
        cells.append(types.CellType(_map(value, mapped, depth)))
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                             tuple(cells))
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def _map(value, mapped, depth):
    if _symbolic(value):
        return mapped(value)
    if isinstance(value, (list, tuple)):
        items = [_map(v, mapped, depth) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, types.FunctionType) and depth > 0:
        return _rebound(value, mapped, depth - 1)
    return value
