"""Einsums that apply a 2-D kernel as a dense layer.

``x,w->y`` with ``w`` two letters ``{c, o}``: ``c`` in ``x`` (contracted),
``o`` not (the output axis), and ``y`` the letters of ``x`` without ``c``,
plus ``o``, in any order. ``x``'s first letter holds the examples: it is
never the contracted one (that would sum the examples), and ``y`` keeps it
first. With ``c`` last in ``x`` and ``y = x[:-1] + o`` it is the plain
dense form; otherwise (a token mixing layer, ``"abc,bd->adc"``: the kernel
mixes positions, the channels are positions) the layer reads ``x`` with
``c`` moved last (``in_perm``) and its output with ``o`` moved last
(``out_perm``): rows are the other axes of ``x``, in order.
"""
from __future__ import annotations

import re


def einsum_2d_form(equation: str):
    """``(layout, in_perm, out_perm)`` (``"io"`` for ``w = [c, o]``, ``"oi"``
    for ``[o, c]``; a permutation is None where it is the identity), or None
    where the Einsum is no such dense use. An ellipsis (``"...c,cd->...d"``)
    is taken in the plain form only."""
    m = re.fullmatch(r"([a-z.]+),([a-z]{2})->([a-z.]+)", equation.replace(" ", ""))
    if not m:
        return None
    x, w, y = m.groups()
    if len(set(w)) != 2 or not x or x[-1] not in w:
        return _permuted(x, w, y)
    o = w.replace(x[-1], "")
    if y != x[:-1] + o or o in x:
        return _permuted(x, w, y)
    return ("io" if w[0] == x[-1] else "oi"), None, None


def _permuted(x, w, y):
    inside = [c for c in w if c in x]
    if "." in x + y or len(set(w)) != 2 or len(set(x)) != len(x) or len(inside) != 1:
        return None
    c, o = inside[0], w.replace(inside[0], "")
    rows = x.replace(c, "")
    if (x.index(c) == 0 or len(y) != len(set(y)) or sorted(y) != sorted(rows + o)
            or y[0] != x[0]):  # the examples stay first
        return None
    in_perm = tuple(x.index(a) for a in rows + c)
    out_perm = tuple(y.index(a) for a in rows + o)
    identity = lambda p: None if p == tuple(range(len(p))) else p  # noqa: E731
    return ("io" if w[0] == c else "oi"), identity(in_perm), identity(out_perm)
