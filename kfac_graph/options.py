"""Options checked where they are given: one line naming the option, the
value and what it may be.

    SPECS = {"damping": options.Real(low=0.0), "num_samples": options.Integer(1)}
    values = options.check_all("kg.KFAC", SPECS, dict(damping=damping, num_samples=n))
    # ValueError: kg.KFAC: damping must be a finite number >= 0, got -1.0

A spec is a small frozen record that says what values it takes
(``requirement()``) and converts a good one (``convert(value)``, a
``ValueError`` naming nothing otherwise); ``check`` and ``check_all`` put the
owner and the option's name in front. ``bool`` is never a number here
(``damping=True`` is a mistake, not ``1.0``), a string is never a number
(``'0.1'`` neither), and an integer option takes an integral float (``10.0``)
but not ``2.5``. A ``dynamic`` spec lets a tensor, variable or callable
through unchecked (the blocks read it again at every use).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping

import numpy as np
import tensorflow as tf


class _Bad(Exception):
    """The value does not fit (the caller words the message)."""


def _number(value) -> float:
    """``value`` as a float, for real numbers and 0-d arrays or eager tensors;
    ``_Bad`` for bools, strings and anything else."""
    if isinstance(value, (bool, np.bool_, str, bytes)) or value is None:
        raise _Bad
    if isinstance(value, numbers.Real):
        return float(value)
    try:
        return float(value)
    except (TypeError, ValueError, AttributeError) as e:
        raise _Bad from e


def _is_dynamic(value) -> bool:
    return tf.is_tensor(value) or isinstance(value, tf.Variable) or callable(value)


@dataclasses.dataclass(frozen=True)
class Real:
    """A finite number in a range: ``low`` / ``high`` (None: unbounded), each
    end open when ``low_open`` / ``high_open``; ``none``: None is allowed too."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    none: bool = False
    dynamic: bool = False

    def requirement(self) -> str:
        text = "a finite number"
        if self.low is not None and self.high is not None:
            text += (f" in {'(' if self.low_open else '['}{_fmt(self.low)}, "
                     f"{_fmt(self.high)}{')' if self.high_open else ']'}")
        elif self.low is not None:
            text += f" {'>' if self.low_open else '>='} {_fmt(self.low)}"
        elif self.high is not None:
            text += f" {'<' if self.high_open else '<='} {_fmt(self.high)}"
        return text + (", or None" if self.none else "")

    def convert(self, value):
        if value is None and self.none:
            return None
        if self.dynamic and not isinstance(value, (bool, np.bool_)) and _is_dynamic(value):
            return value
        x = _number(value)
        if not math.isfinite(x):
            raise _Bad
        if self.low is not None and (x < self.low or (self.low_open and x == self.low)):
            raise _Bad
        if self.high is not None and (x > self.high or (self.high_open and x == self.high)):
            raise _Bad
        return x


@dataclasses.dataclass(frozen=True)
class Integer:
    """An integer ``>= minimum`` (None: any integer); an integral float counts;
    ``none``: None is allowed too."""

    minimum: int | None = None
    none: bool = False

    def requirement(self) -> str:
        return ("an integer" + ("" if self.minimum is None else f" >= {self.minimum}")
                + (", or None" if self.none else ""))

    def convert(self, value) -> int | None:
        if value is None and self.none:
            return None
        if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
            n = int(value)
        else:
            x = _number(value)
            if not x.is_integer():
                raise _Bad
            n = int(x)
        if self.minimum is not None and n < self.minimum:
            raise _Bad
        return n


@dataclasses.dataclass(frozen=True)
class OneOf:
    """One of ``choices``, compared by type and value (``1`` is not ``True``)."""

    choices: tuple

    def requirement(self) -> str:
        return "one of " + ", ".join(repr(c) for c in self.choices)

    def convert(self, value):
        for choice in self.choices:
            if type(value) is type(choice) and value == choice:
                return choice
        raise _Bad


@dataclasses.dataclass(frozen=True)
class Boolean:
    """``True`` or ``False`` (a NumPy bool too); not ``0``, ``1`` or ``'false'``."""

    def requirement(self) -> str:
        return "True or False"

    def convert(self, value) -> bool:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        raise _Bad


Spec = Real | Integer | OneOf | Boolean


def check(owner: str | None, name: str, value, spec: Spec):
    """``value`` converted by ``spec``; a one-line ``ValueError``
    ``"owner: name must be <requirement>, got <value>"`` if it does not fit
    (without ``owner``, the line starts at ``name``)."""
    try:
        return spec.convert(value)
    except _Bad:
        pass
    prefix = f"{owner}: " if owner else ""
    raise ValueError(f"{prefix}{name} must be {spec.requirement()}, got {shown(value)}") from None


def check_all(owner: str | None, specs: Mapping[str, Spec], values: Mapping[str, Any],
              prefix: str = "") -> dict:
    """``{name: converted value}`` for every name of ``values`` that ``specs``
    has (the others as they are), checked in ``values``' order; ``prefix`` goes
    before each name in the message (``"--"`` for flags)."""
    return {name: check(owner, prefix + name, value, specs[name]) if name in specs else value
            for name, value in values.items()}


def check_at_most(owner: str | None, name: str, value, bound_name: str, bound) -> None:
    """A one-line ``ValueError`` unless ``value <= bound`` (both already checked)."""
    if value is not None and bound is not None and value > bound:
        prefix = f"{owner}: " if owner else ""
        raise ValueError(f"{prefix}{name} must be at most {bound_name} ({shown(bound)}), "
                         f"got {shown(value)}")


def shown(value) -> str:
    """``value`` as the messages show it: strings quoted, on one short line."""
    text = repr(value) if isinstance(value, (str, bytes)) else str(value)
    text = " ".join(text.split())
    return text if len(text) <= 60 else text[:57] + "..."


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)
