"""Dense layers whose kernel is several variables: ``x @ W + h @ R (+ b)``.

A sum of MatMuls that share their output is one dense layer on the
concatenated input: ``x @ W + h @ R + b = [x, h] @ [W; R] + b``, its kernel
the rows of ``W`` then ``R`` stacked. Keras's LSTM cell writes it so
(``z = x @ kernel + h @ recurrent_kernel + bias``, the bias added to the
sum), and its SimpleRNN cell with the bias on the first product
(``(x @ kernel + bias) + h @ recurrent_kernel``). Registered as one layer,
the cell has one output gradient where two dense layers and a shift had
three copies of it: one ``G`` factor of the layer's width instead of
three, and a Kronecker block over ``[x, h, 1]`` that keeps the input and
recurrent kernels' cross terms (``kfac_graph/layers/dense.py``, the use
attribute ``stacked_rows``; ``fisher/blocks_compose.StackedKernelBlock``).

The patterns ask for two whole variables (no slice: a cell that slices its
kernels per gate keeps one layer per product), each a rank-2 kernel applied
as stored (``[d_in, d_out]``), the products' order fixed by the sum's input
slots (so every time step names the kernels alike), and each intermediate
sum read by the next op alone (another reader would bypass the layer's
output gradient).
"""
from __future__ import annotations

from passes.patterns import ADD, ANY, VAR, Pattern, bias_fits, ops, var_shape

_ADD = ops("Add", "AddV2")


def _io_matmul(data) -> bool:
    a = data["attrs"]
    return not any(a.get(k, False) for k in ("transpose_a", "transpose_b", "adj_x", "adj_y"))


_MATMUL = ops("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", where=_io_matmul)


def _only_reader(g, node, reader) -> bool:
    return set(g.successors(node)) == {reader}


def _kernels_fit(g, m) -> bool:
    """Two different rank-2 kernels of one output width, each product read
    by the sum (or the inner bias add) alone."""
    w, r = var_shape(g, m["w"]), var_shape(g, m["w2"])
    if len(w) != 2 or len(r) != 2 or w[1] != r[1]:
        return False
    if g.nodes[m["w"]]["variable"] == g.nodes[m["w2"]]["variable"]:
        return False
    first = m.get("inner", m["sum"])
    return _only_reader(g, m["op"], first) and _only_reader(g, m["op2"], m["sum"])


_PRODUCTS = {"x": ANY, "op": _MATMUL, "w": VAR, "x2": ANY, "op2": _MATMUL, "w2": VAR}
_PRODUCT_EDGES = (("x", "op", 0), ("w", "op", 1), ("x2", "op2", 0), ("w2", "op2", 1))
_INPUTS = (("op", "in", 0), ("op2", "in", 0))

# z = (x @ W + h @ R) + b   (Keras's LSTM cell)
STACKED_DENSE_BIAS = Pattern(
    "stacked_dense_bias", "dense",
    {**_PRODUCTS, "sum": _ADD, "b": VAR, "add": ADD},
    _PRODUCT_EDGES + (("op", "sum", 0), ("op2", "sum", 1), ("sum", "add", None),
                      ("b", "add", None)),
    anchor="op", output="add", params=("w", "w2", "b"), inputs=_INPUTS,
    check=lambda g, m: (_kernels_fit(g, m) and _only_reader(g, m["sum"], m["add"])
                        and bias_fits(g, m, -1)))
# z = (x @ W + b) + h @ R   (Keras's SimpleRNN cell)
STACKED_DENSE_INNER_BIAS = Pattern(
    "stacked_dense_inner_bias", "dense",
    {**_PRODUCTS, "inner": ADD, "b": VAR, "sum": _ADD},
    _PRODUCT_EDGES + (("op", "inner", None), ("b", "inner", None), ("inner", "sum", 0),
                      ("op2", "sum", 1)),
    anchor="op", output="sum", params=("w", "w2", "b"), inputs=_INPUTS,
    check=lambda g, m: (_kernels_fit(g, m) and _only_reader(g, m["inner"], m["sum"])
                        and bias_fits(g, {**m, "add": m["inner"]}, -1)))
# z = x @ W + h @ R
STACKED_DENSE = Pattern(
    "stacked_dense", "dense",
    {**_PRODUCTS, "sum": _ADD},
    _PRODUCT_EDGES + (("op", "sum", 0), ("op2", "sum", 1)),
    anchor="op", output="sum", params=("w", "w2"), inputs=_INPUTS, check=_kernels_fit)

STACKED_PATTERNS: tuple[Pattern, ...] = (STACKED_DENSE_BIAS, STACKED_DENSE_INNER_BIAS,
                                         STACKED_DENSE)
