"""Per-example gradients of a dense (matmul) layer, with positions and uses.

Math: for `s_{i,t} = a_{i,t} W (+ b)` at positions `t` (any middle axes of
`a [B, ..., d_in]`, flattened) and over every use of `W`, the gradient of
example i's loss is

    dW_i = sum_{u,t} a_{i,u,t}^T g_{i,u,t}   [d_in, d_out]   (transposed: dW_i^T)
    db_i = sum_{u,t} g_{i,u,t}               [d_out]

Uses are concatenated along the position axis, so one formula covers tied
weights, and the Gram norm below counts the cross terms between uses.

Kernel choice: with one position the gradient is an outer product and its
cost is writing `B d_in d_out` floats, which XLA's fused broadcast multiply
`a[:, :, None] * g[:, None, :]` does at memory speed and TF's own kernels
(broadcasting, or a batched matmul with inner size 1) do not. So when
tracing a graph that is not itself compiled, the outer product runs in a
small `jit_compile=True` function (an "XLA island", `xla_island=True`);
under XLA it is simply inlined, and eagerly it is the plain broadcast. With
positions (`T > 1`) the batched matmul `a^T g` is used. See README's
kernel-choice table, measured by
`python benchmarks/per_example_rules.py --only layers` (and `--only mlp`).

Kernels of rank > 2 (an Einsum projection `[d, heads, head_dim]` or
`[heads, head_dim, d]`; `layer.attrs["kernel_in_axes"]` = k leading axes
contracted): the same layer with `W` reshaped row-major to `[d_in, d_out]`,
`d_in = prod(shape[:k])`, `d_out = prod(shape[k:])`; `operands` flattens the
activation to `[B, T, d_in]` and the output gradient to `[B, T, d_out]`, and the
rule reshapes `dW_i` (and `db_i`, a bias of the output's trailing axes with
`d_out` entries) back to the variables' shapes. A kernel contracted on a
later axis (`"btd,ndh->btnh"`: the op applies `W' = transpose(W, perm)`,
`attrs["kernel_perm"]`) is the same layer on `W'`, its gradient transposed
back by the inverse permutation. A kernel that the op reads as another
matrix, `K = reshape(W, [d_in, d_out])` row-major (a flat parameter vector;
`attrs["kernel_matrix"] = (d_in, d_out)`, `passes/patterns_reshaped.py`), is
the layer on `K`, `dW_i = reshape(dK_i, W.shape)`.

Stacked kernels (a sum of products `x @ W + h @ R (+ b)` sharing one
output, a recurrent cell's; `attrs["stacked_rows"]` = the rows of each
variable): one layer on the concatenated input `a = [x, h]` with the kernel
`[W; R]` (`d_in` = the rows' sum); `operands` concatenates the use's inputs
and the rule splits `dW_i` back into the variables' rows. The layer's
variables are the kernels in that order, then the bias.

Norms: Gram form iff `T (d_in + d_out) < d_in d_out` (see `norms.py`), else the
materialised gradient is squared; the bias norm is always `|sum_t g_t|^2`.
"""

import dataclasses

import numpy as np
import tensorflow as tf

from kfac_graph.layers import lora, norms, parts
from kfac_graph.layers import uses as uses_lib
from kfac_graph.layers import xla as xla_lib
from kfac_graph.layers.kind import LayerKind, reshape_like, split_operands, variable_shapes


@dataclasses.dataclass(frozen=True)
class DenseSpec:
    """A matmul `s = a @ W (+ b)` applied at every position of `a`.

    Attributes:
      has_bias: the layer has a bias `[d_out]` (its gradient comes second).
      transpose_kernel: the kernel is stored `[d_out, d_in]` (`s = a @ W^T`).
      kernel_shape, bias_shape: the variables' shapes when they are not
        `[d_in, d_out]` and `[d_out]` (a multi-axis kernel; the kernel's as
        applied, after `kernel_perm`); () otherwise.
      kernel_perm: the op applies `transpose(kernel, kernel_perm)` (a kernel
        contracted on a later axis); () when it applies the kernel as stored.
      kernel_rows: the rows of each variable of a stacked kernel `[W; R]`
        (its gradient comes as one tensor per variable); () for one kernel.
    """

    has_bias: bool = False
    transpose_kernel: bool = False
    kernel_shape: tuple = ()
    bias_shape: tuple = ()
    kernel_perm: tuple = ()
    kernel_rows: tuple = ()


def _outer(left, right):
    """`[B, m, n]` from `[B, m]`, `[B, n]`."""
    return left[:, :, None] * right[:, None, :]


def outer_product(left, right, xla_island=True):
    """`_outer`, compiled by XLA when traced outside an XLA context."""
    if xla_island and not tf.executing_eagerly() and not xla_lib.in_xla_context():
        return tf.function(_outer, jit_compile=True, autograph=False)(left, right)
    return _outer(left, right)


def flatten_positions(uses):
    """Concatenates all uses along one position axis.

    Returns `a [B, T, d_in]`, `g [B, T, d_out]` with `T` the total number of
    positions over uses (static when every use's middle axes are).
    """
    a_parts, g_parts = [], []
    for a, g in uses:
        if a.shape.rank == 2:
            a, g = a[:, None, :], g[:, None, :]
        elif a.shape.rank != 3:
            batch = uses_lib.batch_size(a)
            a = tf.reshape(a, [batch, -1, a.shape[-1]])
            g = tf.reshape(g, [batch, -1, g.shape[-1]])
        a_parts.append(a)
        g_parts.append(g)
    if len(a_parts) == 1:
        return a_parts[0], g_parts[0]
    return tf.concat(a_parts, axis=1), tf.concat(g_parts, axis=1)


@dataclasses.dataclass(frozen=True)
class DenseRule:
    """Rule for kind `"dense"` (spec: `DenseSpec`).

    Attributes:
      method: `"auto"` (outer product when there is one position, else matmul),
        `"outer"` (only valid with one position) or `"matmul"`.
      norm_method: `"auto"` (the cost rule), `"gram"` or `"materialize"`.
      xla_island: compile the outer product with XLA inside non-XLA graphs.
    """

    method: str = "auto"
    norm_method: str = "auto"
    xla_island: bool = True

    def _kernel_grad(self, a, g, spec):
        left, right = (g, a) if spec.transpose_kernel else (a, g)
        method = self.method
        if method == "auto":
            method = "outer" if a.shape[1] == 1 else "matmul"
        if method == "outer":
            if a.shape[1] != 1:
                raise ValueError("method='outer' needs exactly one position")
            return outer_product(left[:, 0], right[:, 0], self.xla_island)
        if method == "matmul":
            return tf.matmul(left, right, transpose_a=True)
        raise ValueError(f"unknown dense method {self.method!r}")

    def per_example_grads(self, uses, spec):
        """`[B, *kernel.shape]` and, if `spec.has_bias`, `[B, d_out]`."""
        a, g = flatten_positions(uses_lib.as_uses(uses))
        out = [self._kernel_grad(a, g, spec)]
        if spec.has_bias:
            out.append(tf.reduce_sum(g, axis=1))
        if spec.kernel_shape:
            shapes = [spec.kernel_shape, spec.bias_shape][:len(out)]
            out = [tf.reshape(t, [-1, *shape]) for t, shape in zip(out, shapes)]
        if spec.kernel_perm:  # back to the stored layout
            out[0] = tf.transpose(out[0], [0, *(1 + int(i) for i in np.argsort(spec.kernel_perm))])
        if spec.kernel_rows:  # one gradient per variable of a stacked kernel
            out = tf.split(out[0], list(spec.kernel_rows), axis=1) + out[1:]
        return out

    def squared_norms(self, uses, spec):
        """`[B]`: squared norm of each example's gradient over kernel (+ bias)."""
        a, g = flatten_positions(uses_lib.as_uses(uses))
        use_gram = {"gram": True, "materialize": False}.get(self.norm_method)
        if use_gram is None:
            if self.norm_method != "auto":
                raise ValueError(f"unknown norm_method {self.norm_method!r}")
            use_gram = norms.gram_is_cheaper(a.shape[1], a.shape[-1], g.shape[-1])
        if use_gram:
            total = norms.gram_squared_norms(a, g)
        else:
            total = norms.sum_of_squares(self._kernel_grad(a, g, spec))
        if spec.has_bias:
            total += norms.sum_of_squares(tf.reduce_sum(g, axis=1))
        return total


# -- factor statistics (the Kronecker factors' rows) -------------------------------


def input_rows(a):
    """The A factor's rows: every position of `a [B, ..., d_in]`, `[N, d_in]`."""
    return tf.reshape(a, [-1, a.shape[-1]])


def output_rows(g):
    """The G factor's rows: every position of `g [B, ..., d_out]`, `[N, d_out]`."""
    return tf.reshape(g, [-1, g.shape[-1]])


# -- the record --------------------------------------------------------------------


def matrix_shape(kernel_shape, kernel_in_axes=None) -> tuple:
    """`(d_in, d_out)` of a kernel whose first `kernel_in_axes` axes (default:
    all but the last) are contracted with the input."""
    k = kernel_in_axes or len(kernel_shape) - 1
    return int(np.prod(kernel_shape[:k])), int(np.prod(kernel_shape[k:]))


def kernel_matrix_shape(kernel_shape, attrs) -> tuple:
    """`(d_in, d_out)` of a kernel stored in `kernel_shape` that a use with
    attributes `attrs` applies: `attrs["kernel_matrix"]` where the op reads
    it as another matrix, else `matrix_shape` (`kernel_in_axes`)."""
    if attrs.get("kernel_matrix"):
        return tuple(int(d) for d in attrs["kernel_matrix"])
    return matrix_shape(kernel_shape, attrs.get("kernel_in_axes"))


def applied_kernel_shape(layer, use) -> tuple:
    """The kernel's shape as use `use` applies it: the variable's, permuted
    by `use_attrs[use]["kernel_perm"]` when the op transposes it first."""
    shape = variable_shapes(layer)[0]
    perm = layer.use_attrs[use].get("kernel_perm")
    return tuple(shape[p] for p in perm) if perm else shape


def kernel_variables(layer) -> int:
    """How many of `layer`'s variables make its kernel (more than one when
    stacked); the bias, if any, comes after them."""
    return max([len(a.get("stacked_rows", ())) for a in layer.use_attrs] + [1])


def spec(layer, use):
    """`DenseSpec` of one use: a bias if the layer has a variable after its
    kernel's; the kernel transposed if the op multiplies by `W^T`; the
    variables' shapes for a multi-axis kernel (the kernel's as applied, and
    its permutation, or the kernel read as another matrix); a stacked kernel's rows."""
    attrs = layer.use_attrs[use]
    reshaped = attrs.get("kernel_in_axes") or attrs.get("kernel_matrix")
    shapes = variable_shapes(layer) if reshaped else [(), ()]
    if reshaped:
        shapes[0] = applied_kernel_shape(layer, use)
    return DenseSpec(has_bias=len(layer.variables) == kernel_variables(layer) + 1,
                     kernel_rows=tuple(attrs.get("stacked_rows", ())),
                     transpose_kernel=bool(attrs.get("transpose_kernel")),
                     kernel_shape=shapes[0], bias_shape=shapes[-1] if len(shapes) > 1 else (),
                     kernel_perm=tuple(attrs.get("kernel_perm") or ()))


def operands(layer, use, tensors, grads, batch=None):
    """`a` reshaped to the op's static input shape (Conv1D's unit axis, which
    the pass saw through), each `g` to the same positions with `d_out`; for a
    multi-axis kernel `a [B, T, d_in]` and `g [B, T, d_out]` (T: all positions);
    for a use of a box of the kernel (`parts.py`), both zero-padded to the
    whole kernel's `d_in` and `d_out`; for a stacked kernel the use's inputs
    concatenated along their last axis; an Einsum whose output interleaves
    positions and outputs (``output_perm``) has ``g`` transposed first, and
    one contracting an earlier axis of its input (``input_perm``, a token
    mixing layer, ``passes/einsum_2d.py``) has ``a`` transposed; an
    input with the examples on a later axis (time-major, ``batch_axis``)
    has that axis moved first in ``a`` and ``g``; a low-rank adapter's A or
    B (``attrs["lora"]``, ``passes/lora.py``) has its kernel's operands
    turned into its own by `lora.operands`."""
    attrs = layer.use_attrs[use]
    if attrs.get("lora"):  # a low-rank adapter's A or B: read through its kernel's use
        if attrs["lora"]["lookup"]:  # B of a looked-up table's adapter: on s A[ids]
            return lora.lookup_operands(attrs["lora"], tensors[0], grads, tensors[1])
        kernel = attrs["lora"]["kernel_shape"]
        a, grads = applied_operands({**attrs, "kernel_in_axes": attrs["lora"]["kernel_in_axes"]},
                                    kernel, tensors[:1], grads)
        return lora.operands(attrs["lora"], a, grads, tensors[1])
    a, grads = applied_operands(attrs, applied_kernel_shape(layer, use), tensors, grads, batch)
    box = parts.part(layer, use, 0)
    if box is not None:
        kernel = [int(d) for d in layer.variables[0].shape]
        into, out = (1, 0) if layer.use_attrs[use].get("transpose_kernel") else (0, 1)
        a = parts.pad_axis(a, box, -1, into, kernel[into])
        grads = [parts.pad_axis(g, box, -1, out, kernel[out]) for g in grads]
    return a, list(grads)


def applied_operands(attrs, kernel_shape, tensors, grads, batch=None):
    """`operands` of a use with attributes `attrs` of a kernel applied in
    `kernel_shape`, before a part's padding. `batch`: the batch, for rows
    `[k B, ..]` whose `k` is known at run time only (`run_time_rows`)."""
    shape = attrs.get("input_shape")
    rows = attrs.get("stacked_rows")
    if attrs.get("input_perm"):  # an Einsum contracting an earlier axis: it moved last
        tensors = [tf.transpose(t, attrs["input_perm"]) for t in tensors]
    if attrs.get("output_perm"):  # an Einsum's output axes, to positions then outputs (its
        out = attrs.get("output_shape")  # unit axes back first: matvec's, squeezed before a bias)
        grads = [tf.transpose(reshape_like(g, out) if out and g.shape.rank != len(out) else g,
                              attrs["output_perm"]) for g in grads]
    if "run_time_rows" in attrs:
        tensors, grads = split_operands(tensors, grads, 0, batch)
    if attrs.get("batch_axis"):  # the examples on a later axis (time-major): moved first
        first = lambda t: tf.transpose(t, _first(attrs["batch_axis"], t.shape.rank))  # noqa: E731
        tensors, grads = [first(t) for t in tensors], [first(g) for g in grads]
    if rows:  # [x, h]: the inputs side by side, as the stacked kernel's rows
        lead = tuple(shape[:-1]) if shape else None
        a = tf.concat([reshape_like(t, lead and (*lead, d)) for t, d in zip(tensors, rows)],
                      axis=-1)
        return a, [reshape_like(g, lead and (*lead, g.shape[-1])) for g in grads]
    if attrs.get("kernel_in_axes"):
        d_in, d_out = matrix_shape(kernel_shape, attrs["kernel_in_axes"])
        if shape is None or None in shape[1:]:
            flat = lambda t, d: tf.reshape(t, [uses_lib.batch_size(t), -1, d])
        else:
            positions = int(np.prod(shape[1:])) // d_in
            flat = lambda t, d: reshape_like(t, (None, positions, d))
        return flat(tensors[0], d_in), [flat(g, d_out) for g in grads]
    a = reshape_like(tensors[0], shape)
    if shape:
        grads = [reshape_like(g, (*shape[:-1], g.shape[-1])) for g in grads]
    if a.shape.rank and a.shape[-1] is None:  # a width the trace lost (a bincount's)
        matrix = attrs.get("kernel_matrix") or kernel_shape
        d_in = matrix[-1] if attrs.get("transpose_kernel") else matrix[0]
        a = tf.ensure_shape(a, [*a.shape[:-1], d_in])
    return a, list(grads)


def _first(axis, rank):
    """The permutation that moves ``axis`` first, the others in order."""
    return [axis, *[i for i in range(rank) if i != axis]]


KIND = LayerKind(
    name="dense",
    rule=DenseRule(),
    spec=spec,
    operands=operands,
    blocks={"kron": "FullyConnectedKroneckerBlock", "kron_expand": "FullyConnectedKroneckerBlock",
            "kron_reduce": "FullyConnectedKroneckerReduceBlock",
            "diagonal": "FullyConnectedDiagonalBlock",
            "full": "NaiveFullBlock", "series": "FullyConnectedSeriesBlock"},
    default_block="kron",
    colour="lightblue",
)
