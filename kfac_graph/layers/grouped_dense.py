"""Per-example gradients of a grouped dense layer: `G` dense layers side by
side, each on its own input, `y[j, n] = x[j, n] W[j]` for a kernel
`W [G, d_in, d_out]` (`einsum("gnc,gco->gno", x, W)`). keras-hub's mixtures
of experts apply their experts' output projections so (Mixtral, Qwen-MoE,
Qwen3-MoE, GPT-OSS: `"eti,eih->eth"`, every token through every expert,
weighed by the routing after).

The rows `n` hold the examples' tokens in groups, `k` per example
(`passes.example_rows`: the pass records the input as `[G, B, k, d_in]`),
so `operands` lays `x` out as `[B, G, k, d_in]` and the output gradient as
`[B, G, k, d_out]`. Per example `i`, summed over uses,

    dW_i[j] = sum_t x_i[j, t]^T g_i[j, t]        [G, d_in, d_out]
    db_i[j] = sum_t g_i[j, t]                     [G, d_out]  (GPT-OSS's bias)

Norms: the Gram form per group, `sum_j sum_{t,t'} (x_t . x_t')(g_t . g_t')`
(`norms.grouped_gram_squared_norms`), when `k (d_in + d_out) < d_in d_out`
over all uses' rows; else the materialised gradient squared (a bias's
norm from its gradient, always).

The Kronecker factors (`fisher/blocks_grouped_dense.py`) are per group:
`A_j` from group j's input rows (and the bias's 1), `G_j` from its
output-gradient rows, every token of every example a row (`input_rows`,
`group_rows`: `[N, G, d]`).
"""

import dataclasses

import tensorflow as tf

from kfac_graph.layers import norms
from kfac_graph.layers import uses as uses_lib
from kfac_graph.layers.kind import LayerKind, split_rows, variable_shapes


@dataclasses.dataclass(frozen=True)
class GroupedDenseSpec:
    """A kernel `[groups, d_in, d_out]` applied group by group (+ a bias
    `[groups, d_out]`)."""

    kernel_shape: tuple
    has_bias: bool = False

    def __post_init__(self):
        object.__setattr__(self, "kernel_shape", tuple(int(d) for d in self.kernel_shape))
        if len(self.kernel_shape) != 3:
            raise ValueError(f"a grouped dense kernel is [groups, d_in, d_out], "
                             f"got {self.kernel_shape}")


@dataclasses.dataclass(frozen=True)
class GroupedDenseRule:
    """Rule for kind `"grouped_dense"` (spec: `GroupedDenseSpec`); uses are
    `(x [B, G, k, d_in], g [B, G, k, d_out])` (module docstring)."""

    def per_example_grads(self, uses, spec):
        """`[B, G, d_in, d_out]` and, with a bias, `[B, G, d_out]`."""
        uses = uses_lib.as_uses(uses)
        out = [uses_lib.add_all([tf.einsum("bjti,bjto->bjio", x, g) for x, g in uses])]
        return out + ([_bias_grads(uses)] if spec.has_bias else [])

    def squared_norms(self, uses, spec):
        """`[B]`: each example's squared gradient norm (module docstring)."""
        uses = uses_lib.as_uses(uses)
        rows = sum(x.shape[2] for x, _ in uses) if all(x.shape[2] for x, _ in uses) else None
        _, d_in, d_out = spec.kernel_shape
        if not norms.gram_is_cheaper(rows, d_in, d_out):
            return norms.total_squared_norms(self.per_example_grads(uses, spec))
        # [B, k, G, d]: positions before groups, as the grouped Gram form reads them
        to_rows = lambda t: tf.transpose(t, [0, 2, 1, 3])  # noqa: E731
        kernel = norms.grouped_gram_squared_norms(tf.concat([to_rows(x) for x, _ in uses], 1),
                                                  tf.concat([to_rows(g) for _, g in uses], 1))
        return kernel + norms.sum_of_squares(_bias_grads(uses)) if spec.has_bias else kernel


def _bias_grads(uses):
    """`[B, G, d_out]`: each example's bias gradient, its output gradient
    summed over its rows and uses."""
    return uses_lib.add_all([tf.reduce_sum(g, axis=2) for _, g in uses])


def spec(layer, use):
    return GroupedDenseSpec(variable_shapes(layer)[0], has_bias=len(layer.variables) == 2)


def operands(layer, use, tensors, grads, batch=None):
    """`x [G, B k, d_in]` read as the pass recorded it (`input_shape`,
    `[G, B, k, d_in]`) and moved batch first, `[B, G, k, d_in]`; each output
    gradient likewise (`output_shape`). Where `k` is known at run time only
    (`run_time_rows`), the rows are split by `batch`."""
    attrs = layer.use_attrs[use]
    first = lambda t, shape: (  # noqa: E731
        _batch_first(split_rows(t, 1, batch) if "run_time_rows" in attrs else t, shape))
    return (first(tensors[0], attrs["input_shape"]),
            [first(g, attrs["output_shape"]) for g in grads])


def _batch_first(t, shape):
    groups, _, per_example, width = shape
    if t.shape.rank != 4:  # (else already [G, B, k, d])
        t = tf.reshape(t, [groups, -1, per_example, width])
    return tf.transpose(t, [1, 0, 2, 3])


# -- factor statistics (the Kronecker factors' rows) -------------------------------


def group_rows(t):
    """`[N, G, d]`: every token of every example, per group, from `t [B, G, k, d]`."""
    return tf.reshape(tf.transpose(t, [0, 2, 1, 3]), [-1, t.shape[1], t.shape[3]])


def input_rows(a, spec):
    """The A factors' rows (`group_rows`); the blocks append the bias's 1."""
    del spec
    return group_rows(a)


KIND = LayerKind(
    name="grouped_dense",
    rule=GroupedDenseRule(),
    spec=spec,
    operands=operands,
    blocks={"kron": "GroupedDenseKroneckerBlock", "kron_expand": "GroupedDenseKroneckerBlock",
            "diagonal": "GroupedDenseDiagonalBlock", "full": "NaiveFullBlock"},
    default_block="kron",
    colour="lightcyan",
)
