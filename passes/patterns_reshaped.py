"""A dense layer whose kernel is a variable reshaped to another matrix.

``MatMul(x, Reshape(w, [d_in, d_out]))`` with ``w`` of any shape holding
``d_in * d_out`` entries (a flat ``[d_in * d_out]`` parameter vector, or a
matrix read in another factorisation) is the dense layer

    s = x K (+ b),   K = reshape(w, [d_in, d_out])  (row-major),

its kernel's gradient ``dK`` read back into ``w``'s shape by the same
row-major reshape (``dw = reshape(dK, w.shape)``). The match records
``kernel_matrix = (d_in, d_out)``; the runtime builds the layer on ``K``
and reshapes its kernel's gradients and the Fisher block's vectors to ``w``
(``kfac_graph/layers/dense.py``, ``fisher/blocks_kron.py``). A kernel of
rank > 2 that the Reshape only splits at an axis
(``prod(w[:k]), prod(w[k:])``) is ``passes.patterns_multiaxis``'s (its
``kernel_in_axes``); a transposed product (``transpose_b``) is no such
form (its layout would be ``K^T``'s), and stays generic.
"""
from __future__ import annotations

import math

from passes.patterns import ADD, ANY, VAR, Pattern, bias_fits, ops, var_shape


def _plain_matmul(data) -> bool:
    a = data["attrs"]
    return not any(a.get(k, False) for k in ("transpose_a", "transpose_b", "adj_x", "adj_y"))


def kernel_matrix(g, m) -> tuple[int, int] | None:
    """``(d_in, d_out)`` of a matched reshaped kernel (role ``"wm"``), or None
    where ``w``'s shape is that matrix's, or splits into it at an axis, or
    the sizes are not all static and equal."""
    if "wm" not in m:
        return None
    w, flat = tuple(var_shape(g, m["w"])), g.nodes[m["wm"]]["shapes"][0]
    if (not w or None in w or flat is None or len(flat) != 2 or None in flat
            or math.prod(w) != math.prod(flat)):
        return None
    if any((math.prod(w[:k]), math.prod(w[k:])) == tuple(flat) for k in range(1, len(w))):
        return None
    return int(flat[0]), int(flat[1])


_NODES = {"x": ANY, "wm": ops("Reshape"),
          "op": ops("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3",
                    where=_plain_matmul), "w": VAR}
_EDGES = (("w", "wm", 0), ("x", "op", 0), ("wm", "op", 1))
_OK = lambda g, m: kernel_matrix(g, m) is not None  # noqa: E731

RESHAPED_MATRIX_DENSE_BIAS = Pattern(
    "reshaped_matrix_dense_bias", "dense", {**_NODES, "b": VAR, "add": ADD},
    _EDGES + (("op", "add", None), ("b", "add", None)), anchor="op", output="add",
    params=("w", "b"), inputs=(("op", "in", 0),),
    check=lambda g, m: _OK(g, m) and bias_fits(g, m, -1))
RESHAPED_MATRIX_DENSE = Pattern(
    "reshaped_matrix_dense", "dense", _NODES, _EDGES, anchor="op", output="op",
    params=("w",), inputs=(("op", "in", 0),), check=_OK)

RESHAPED_PATTERNS: tuple[Pattern, ...] = (RESHAPED_MATRIX_DENSE_BIAS, RESHAPED_MATRIX_DENSE)
