"""Kronecker factors of the dense, conv, depthwise and embedding blocks.

Input factors average over examples, positions/locations and uses:
    A = (1 / (B T U)) sum_{i,t,u} abar abar^T,   abar = [a, 1] with a bias,
with `a` the layer input (dense; a transposed convolution's at each of its
positions, with no 1), the input patch at an output location (conv; a
grouped conv: per group, its kh*kw*cg patch features; depthwise: per input
channel), or the one-hot id (embedding, kept as its diagonal: the id counts
/ (B T U)). Output factors average the same way over the output-gradient
rows g (conv: at every output location; grouped: per group, its og outputs;
depthwise: per input channel, the M outputs it feeds; transposed conv: the
output gradient's patch at each input position), summed over sources:
    G = sum_s (1 / (B T U)) sum_{i,t,u} g_s g_s^T.
With `positions="reduce"` (`positions.py`) the dense, conv, depthwise and
transposed-conv factors instead take one row per example: the input rows averaged, the
output-gradient rows summed over the example's positions of every use.
The rows come from the layer kind's own module (`kfac_graph.layers`:
`input_rows`, `output_rows`, `id_frequencies`), the same patches and
layouts its per-example rules use.

`update` arguments (a list over uses; see `blocks_base` for the layout):
    input factors:  `inputs`  = [a_use0, a_use1, ...]
    output factors: `grads`   = [g_use0, ...], each g a tensor or a list
                    over sources (samples / square-root columns).
"""

import functools
import math

import tensorflow as tf

from kfac_graph.fisher import factors_base
from kfac_graph.fisher import positions as positions_lib
from kfac_graph.layers import conv, conv_transpose, dense, depthwise, embedding


def sources_by_use(grads):
    """[use][source] (a tensor per use means one source) -> [source][use]."""
    per_use = [list(g) if isinstance(g, (list, tuple)) else [g] for g in grads]
    counts = {len(g) for g in per_use}
    if len(counts) != 1:
        raise ValueError("every use must have the same number of sources")
    return [list(s) for s in zip(*per_use)]


def function_key(function):
    """A hashable key equal for equal functions: a ``functools.partial``'s
    function and arguments (a new partial per factor is not the same object)."""
    if isinstance(function, functools.partial):
        return (function.func, function.args, tuple(sorted(function.keywords.items())))
    return function


def _input_rows(inputs, rows, positions):
    """The rows of every use, ``[rows(a_u), ...]``, or with "reduce" one
    row per example: their mean over all positions of all uses."""
    out = [rows(a) for a in inputs]
    if positions == positions_lib.REDUCE:
        batches = [positions_lib.batch_size(a) for a in inputs]
        return [positions_lib.reduce_uses(out, batches, mean=True)]
    return out


class DenseInputFactor(factors_base.CovarianceFactor):
    """A from dense inputs `[B, ..., d_in]` (plus the homogeneous 1);
    `positions`: "expand" (a row per position) or "reduce" (per example)."""

    def __init__(self, d_in, has_bias, positions="expand", **kwargs):
        super().__init__(d_in + int(has_bias), **kwargs)
        self.d_in, self.has_bias = int(d_in), bool(has_bias)
        self.positions = positions_lib.check_mode(positions, type(self).__name__)

    def batch_estimates(self, inputs):
        rows = _input_rows([tf.cast(a, self.dtype) for a in inputs], dense.input_rows,
                           self.positions)
        return self.row_estimates([rows], ones=self.has_bias)

    def estimate_key(self):
        return self._structure(self.d_in, self.has_bias, self.positions)


class OutputFactor(factors_base.CovarianceFactor):
    """G from output gradients, one row per position: `rows(g)` (default the
    dense layer's `[B, ..., d_out] -> [N, d_out]`; a kind passes its own).
    Given a tensor per use (one source) it is also an input factor without
    the homogeneous coordinate (`conv_transpose_factors`); `average`: with
    "reduce", the example's rows are then averaged, not summed."""

    def __init__(self, d_out, rows=dense.output_rows, positions="expand", average=False,
                 **kwargs):
        super().__init__(d_out, **kwargs)
        self.rows = rows
        self.positions = positions_lib.check_mode(positions, type(self).__name__)
        self.average = bool(average)

    def batch_estimates(self, grads):
        sources = [[self.rows(tf.cast(g, self.dtype)) for g in uses]
                   for uses in sources_by_use(grads)]
        if self.positions == positions_lib.REDUCE:
            batches = [positions_lib.batch_size(g) for g in sources_by_use(grads)[0]]
            sources = [[positions_lib.reduce_uses(uses, batches, mean=self.average)]
                       for uses in sources]
        return self.row_estimates(sources)

    def estimate_key(self):
        return self._structure(function_key(self.rows), self.positions, self.average)


class PatchInputFactor(factors_base.CovarianceFactor):
    """A from a convolution's input patches at every output location (KFC):
    `rows(a, spec)` gives `[N, width]` rows, or `[N, groups, width]` for one
    factor per group; the homogeneous 1 is appended when `spec.has_bias`."""

    def __init__(self, spec, rows, width, groups=None, positions="expand", **kwargs):
        super().__init__(width + int(spec.has_bias), groups=groups, **kwargs)
        self.spec, self.rows = spec, rows
        self.positions = positions_lib.check_mode(positions, type(self).__name__)

    def batch_estimates(self, inputs):
        rows = _input_rows([tf.cast(a, self.dtype) for a in inputs],
                           lambda a: self.rows(a, self.spec), self.positions)
        return self.row_estimates([rows], ones=self.spec.has_bias)

    def estimate_key(self):
        return self._structure(self.spec, function_key(self.rows), self.positions)


def _groups(spec):
    """The factors' group count: None (one factor) for an ungrouped conv."""
    return spec.groups if spec.groups > 1 else None


class ConvInputFactor(PatchInputFactor):
    """A `[kh*kw*Cin(+1)]^2` of a conv (`spec`: a `kfac_graph.layers.conv.ConvSpec`);
    grouped (G > 1), per group j: A_j `[G, kh*kw*cg(+1), kh*kw*cg(+1)]` from
    the group's patch features; 3-D: `[kd*kh*kw*Cin(+1)]^2`."""

    def __init__(self, spec, **kwargs):
        *taps, per_group, _ = spec.kernel_shape
        super().__init__(spec, conv.input_rows, math.prod(taps) * per_group, _groups(spec),
                         **kwargs)


def conv_output_factor(spec, **kwargs):
    """G of a convolution: the output gradient at every location; grouped,
    per group j: G_j `[G, og, og]` over outputs j*og ... (j+1)*og - 1."""
    return OutputFactor(spec.kernel_shape[-1] // spec.groups,
                        functools.partial(conv.output_rows, spec=spec), groups=_groups(spec),
                        **kwargs)


def conv_transpose_factors(spec, **kwargs):
    """`(A, G)` of a transposed convolution (`spec`: a
    `kfac_graph.layers.conv_transpose.ConvTransposeSpec`): A from the layer
    input at each of its positions (`Cin_t`, no homogeneous coordinate: the
    bias is no input row), G from the output gradient's patch there
    (`kh*kw*Cout_t`); with `positions="reduce"`, A from each example's mean
    input and G from its summed patches."""
    cin, width = spec.matrix_shape
    rows = lambda f: functools.partial(f, spec=spec)  # noqa: E731
    return (OutputFactor(cin, rows(conv_transpose.input_rows), name="input_factor",
                         average=True, **kwargs),
            OutputFactor(width, rows(conv_transpose.output_rows), name="output_factor", **kwargs))


class DepthwiseInputFactor(PatchInputFactor):
    """Per input channel c: A_c `[C, k(+1), k(+1)]` from its `kh*kw` patch;
    `spec`: a `kfac_graph.layers.depthwise.DepthwiseSpec`."""

    def __init__(self, spec, **kwargs):
        kh, kw, channels, _ = spec.kernel_shape
        super().__init__(spec, depthwise.input_rows, kh * kw, channels, **kwargs)


def depthwise_output_factor(spec, **kwargs):
    """Per input channel c: G_c `[C, M, M]` over outputs c*M ... c*M+M-1."""
    _, _, channels, multiplier = spec.kernel_shape
    return OutputFactor(multiplier, functools.partial(depthwise.output_rows, spec=spec),
                        groups=channels, **kwargs)


class EmbeddingInputFactor(factors_base.CovarianceFactor):
    """Diagonal A `[V]`: the frequency of each id among all B*T*U lookups."""

    def __init__(self, vocab_size, **kwargs):
        kwargs["diagonal"] = True
        super().__init__(vocab_size, **kwargs)

    def batch_estimates(self, inputs):
        return [embedding.id_frequencies(inputs, self.dim, self.dtype)]

    def estimate_key(self):
        return self._structure()
