"""The grouped dense pattern: a kernel ``[G, d_in, d_out]`` applied group by
group, ``einsum("gnc,gco->gno", x, w)`` (each of G dense layers on its own
input: keras-hub's mixture-of-experts output projections, ``"eti,eih->eth"``),
with a bias ``[G, d_out]`` per group or without.

The layer's rows ``n`` must hold the examples' tokens in groups (on ``x``'s
second axis, ``passes.example_rows``); ``example_rows.unflatten_rows``
records the input as ``[G, B, k, d_in]``, or marks the use unsupported (the
kernel is then generic, with the reason) where they do not.
"""
from __future__ import annotations

import re

from passes import ir
from passes.patterns import ADD, ANY, VAR, Pattern, ops, var_shape


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


_NODES = {"x": ANY, "op": ops("Einsum", where=lambda d: grouped_dense_form(
    d["attrs"].get("equation", ""))), "w": VAR}
_EDGES = (("x", "op", 0), ("w", "op", 1))


def _kernel_ok(g, m) -> bool:
    return len(var_shape(g, m["w"])) == 3


def _bias_ok(g, m) -> bool:
    """A bias ``[G, d_out]`` read as ``[G, 1, d_out]`` (``b[:, None, :]``,
    GPT-OSS's experts'), one per group, added to the product."""
    if not _kernel_ok(g, m):
        return False
    groups, _, d_out = var_shape(g, m["w"])
    read = ir.read_shape(g, m["add"], ir.tensor_name(m["b"]))
    return (tuple(var_shape(g, m["b"])) == (groups, d_out) and read is not None
            and tuple(read) == (groups, 1, d_out))


GROUPED_DENSE_BIAS = Pattern(
    "grouped_dense_bias", "grouped_dense", {**_NODES, "b": VAR, "add": ADD},
    _EDGES + (("op", "add", None), ("b", "add", None)), anchor="op", output="add",
    params=("w", "b"), inputs=(("op", "in", 0),), check=_bias_ok)
GROUPED_DENSE = Pattern(
    "grouped_dense", "grouped_dense", _NODES, _EDGES, anchor="op", output="op",
    params=("w",), inputs=(("op", "in", 0),), check=_kernel_ok)

GROUPED_PATTERNS = (GROUPED_DENSE_BIAS, GROUPED_DENSE)
