"""The variables a traced Python function reaches through its own objects.

``reached(fn)``: the Keras variables and plain ``tf.Variable`` objects found
by walking what ``fn`` holds: its closure cells, defaults, bound ``self``,
the globals its code (and the code nested in it) names, a ``functools.
partial``'s function and arguments, a ``tf.function``'s or a registered
function's Python function, the attributes of plain objects and the items
of containers; a Keras layer or model gives its ``variables`` and a
``tf.Module`` its own, without walking further. Modules and classes are
not walked; the walk stops after ``LIMIT`` objects.

``keras_frozen.flags`` reads a captured variable's Keras variable from here
where it finds every captured variable so (held by a reached Keras
variable, or reached itself as a plain ``tf.Variable``), with no scan of
the process's objects (0.1 s a registration in a process of 450k
objects, 6% of the fast test set); anything not found so falls back to
the scan.
"""
from __future__ import annotations

import functools
import sys
import types
from typing import NamedTuple

import tensorflow as tf

LIMIT = 20000  # objects visited at most


class Reached(NamedTuple):
    keras: list  # Keras variables (Keras 3)
    plain: list  # tf.Variable objects reached as themselves


def reached(fn) -> Reached | None:
    """What ``fn`` reaches (module docstring); None where Keras 3 is not imported."""
    keras = sys.modules.get("keras")
    keras_variable = getattr(keras, "Variable", None)
    layer_type = getattr(getattr(keras, "layers", None), "Layer", None)
    if keras_variable is None or layer_type is None:
        return None
    out, seen, todo = Reached([], []), set(), [fn]
    while todo and len(seen) < LIMIT:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, keras_variable):
            out.keras.append(obj)
        elif isinstance(obj, tf.Variable):
            out.plain.append(obj)
        elif isinstance(obj, (layer_type, tf.Module)):
            todo.extend(obj.variables)
        else:
            todo.extend(_held(obj))
    return out


def _held(obj) -> list:
    """What the walk goes on to from ``obj``."""
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, types.FunctionType):
        cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        names = _names(obj.__code__)
        return [*cells, *(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values(),
                *(obj.__globals__[n] for n in names if n in obj.__globals__)]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, dict):
        return list(obj.values())
    inner = getattr(obj, "python_function", None)  # a tf.function, a kg.auto_register
    if inner is not None:
        return [inner]
    return list(vars(obj).values()) if hasattr(obj, "__dict__") else []


def _names(code) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True
