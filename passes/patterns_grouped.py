"""The grouped dense pattern: a kernel ``[G, d_in, d_out]`` applied group by
group, ``einsum("gnc,gco->gno", x, w)`` (each of G dense layers on its own
input: keras-hub's mixture-of-experts output projections, ``"eti,eih->eth"``).

The layer's rows ``n`` must hold the examples' tokens in groups (on ``x``'s
second axis, ``passes.example_rows``); ``example_rows.unflatten_rows``
records the input as ``[G, B, k, d_in]``, or marks the use unsupported (the
kernel is then generic, with the reason) where they do not.
"""
from __future__ import annotations

import re

from passes.patterns import ANY, VAR, Pattern, ops, var_shape


def grouped_dense_form(equation: str) -> bool:
    """Whether an Einsum ``x,w->y`` is ``"gnc,gco->gno"`` up to the letters:
    one group letter leading all three, the rows' letter, the contracted
    one, the output one, all distinct."""
    m = re.fullmatch(r"([a-z])([a-z])([a-z]),([a-z])([a-z])([a-z])->([a-z])([a-z])([a-z])",
                     equation.replace(" ", ""))
    if not m:
        return False
    g, n, c, g2, c2, o, g3, n2, o2 = m.groups()
    return (g == g2 == g3 and c == c2 and n == n2 and o == o2
            and len({g, n, c, o}) == 4)


GROUPED_DENSE = Pattern(
    "grouped_dense", "grouped_dense",
    {"x": ANY, "op": ops("Einsum", where=lambda d: grouped_dense_form(
        d["attrs"].get("equation", ""))), "w": VAR},
    (("x", "op", 0), ("w", "op", 1)), anchor="op", output="op", params=("w",),
    inputs=(("op", "in", 0),), check=lambda g, m: len(var_shape(g, m["w"])) == 3)

GROUPED_PATTERNS = (GROUPED_DENSE,)
