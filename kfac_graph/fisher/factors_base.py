"""The moving-average second-moment factor every other factor builds on.

Data arrive as `sources`: a list over sources (one entry for activations;
one per sample or per Fisher-square-root column for output gradients) of
lists over uses of rows `[N, d]` (or `[N, groups, d]` for per-group
factors).  The batch estimate is

    C = sum_s  (1 / N_s) sum_u sum_n x_{s,u,n} x_{s,u,n}^T

with `N_s = sum_u N_u` the number of rows (examples x positions x uses).
Sources add up: the Fisher square root's columns do (exact mode), and a
caller averaging S samples scales each by 1/sqrt(S).  A diagonal factor keeps
only `diag(C)`; so does one wider than its size budget (`max_dim`,
the estimator's `max_factor_size`).  An ungrouped factor wider than
`block_dim` (and within `max_dim`; the estimator's `factor_block_size`)
keeps its diagonal blocks of at most `block_dim` (`factor_blocks.py`).
With `lag_one=True` the factor also tracks the lag-one cross moment
between consecutive uses (time steps) u and u+1:

    C1 = sum_s (1 / N_s) sum_{u < U-1} sum_n x_{s,u+1,n} x_{s,u,n}^T

normalised by all `N_s` rows (zero padding at the sequence end keeps
[[C, C1^T], [C1, C]] positive semi-definite), as the series (RNN) blocks
need.  Both are debiased moving averages (see `ema.py`).

`ones=True` appends the homogeneous coordinate 1 to every row (the bias's
input). Many rows (N >= 4 d, e.g. a convolution's patches) are not copied:
with `x` the rows of one use,

    [x 1]^T [y 1] = [[x^T y, x^T 1], [1^T y, N]],

so only the column sums and the row count are added to the border; fewer
rows (a dense layer's batch) are copied with the 1 appended, which costs
less than the border's passes over the `(d + 1)^2` result.
"""

import dataclasses

import tensorflow as tf

from kfac_graph import invariants
from kfac_graph.fisher import ema
from kfac_graph.fisher import linalg
from kfac_graph.fisher import shared_kernels
from kfac_graph.fisher.factor_blocks import BlockLayout

def _rows(x):
    """The row count of `x` as its dtype (a constant when static)."""
    if x.shape[0] is not None:
        return tf.constant(x.shape[0], x.dtype)
    return tf.cast(tf.shape(x)[0], x.dtype)


def _outer(x, y, diagonal, ones=False):
    """`sum_n x_n y_n^T` (or its diagonal); with `ones`, of `[x_n 1]`, `[y_n 1]`."""
    if ones and not diagonal and len(x.shape) == 2 and _few_rows(x):
        x1 = linalg.append_ones(x)
        return tf.matmul(x1, x1 if y is x else linalg.append_ones(y), transpose_a=True)
    if diagonal:
        out = tf.reduce_sum(x * y, axis=0)
    elif len(x.shape) == 3:
        out = tf.einsum("ngi,ngj->gij", x, y)
    else:
        out = tf.matmul(x, y, transpose_a=True)
    if not ones:
        return out
    matrix_axes = 1 if diagonal else 2
    groups = out.shape[:-matrix_axes]  # [] or [G]
    shape = (groups.as_list() + [1] if groups.is_fully_defined()
             else tf.concat([tf.shape(out)[:-matrix_axes], [1]], 0))
    n = tf.fill(shape, _rows(x))  # [(G,) 1]
    if diagonal:
        return tf.concat([out, n], -1)
    sum_x = tf.reduce_sum(x, 0)  # [(G,) d]
    sum_y = sum_x if y is x else tf.reduce_sum(y, 0)
    last_row = tf.concat([sum_y, n], -1)  # [(G,) d + 1]
    # Three zero-padded terms: TensorFlow's concat along an inner axis copies
    # row by row, which the padded sums avoid.
    d = out.shape[-1]
    return (tf.pad(out, _pad_last(out, 2, [0, 1], [0, 1]))
            + tf.pad(tf.expand_dims(sum_x, -1), _pad_last(out, 2, [0, 1], [d, 0]))
            + tf.pad(tf.expand_dims(last_row, -2), _pad_last(out, 2, [d, 0], [0, 0])))


def _few_rows(x):
    """Whether the (static) row count of `x` `[N, d]` is below `4 d`."""
    rows = x.shape[0]
    return rows is not None and rows < 4 * x.shape[-1]


def _pad_last(x, count, *pads):
    """`tf.pad` paddings: none on the leading axes, `pads` on the last `count`."""
    return [[0, 0]] * (len(x.shape) - count) + [list(p) for p in pads]


def second_moment(sources, diagonal=False, ones=False, blocks=None):
    """The batch estimate C of the module docstring; with ``blocks`` (a
    ``BlockLayout``) its diagonal blocks ``[count, size, size]``."""
    per_source = []
    for uses in sources:
        n = tf.add_n([_rows(x) for x in uses])
        if blocks is not None:
            rows = [blocks.rows(linalg.append_ones(x) if ones else x) for x in uses]
            per_source.append(tf.add_n([_outer(x, x, False) for x in rows]) / n)
        else:
            per_source.append(tf.add_n([_outer(x, x, diagonal, ones) for x in uses]) / n)
    return tf.add_n(per_source)


def lag_one_moment(sources, ones=False):
    """The batch estimate C1 of the module docstring (needs >= 2 uses)."""
    per_source = []
    for uses in sources:
        if len(uses) < 2:
            raise ValueError("lag_one_moment needs at least two uses")
        n = tf.add_n([_rows(x) for x in uses])
        lagged = [_outer(uses[u + 1], uses[u], False, ones) for u in range(len(uses) - 1)]
        per_source.append(tf.add_n(lagged) / n)
    return tf.add_n(per_source)


@dataclasses.dataclass(frozen=True)
class FactorLayout:
    """How a factor of width ``dim`` is stored: its diagonal alone, in
    ``blocks`` (a ``BlockLayout``) or whole; what its trace and the
    algebra on its value read besides the value (``shared_kernels.py``)."""

    dim: int
    diagonal: bool
    blocks: BlockLayout | None

    def trace(self, value):
        """The trace of the factor stored as ``value`` (batched over groups)."""
        if self.blocks is not None:
            return self.blocks.trace(value)
        return linalg.trace(value, self.diagonal)


class CovarianceFactor(tf.Module):
    """Moving average of a second moment `[(G,) d, d]` (or diagonal `[(G,) d]`,
    or block-diagonal `[count, size, size]`)."""

    # the estimator's, shared by its blocks (``shared_kernels.py``); in place by default
    kernels = shared_kernels.IN_PLACE

    def __init__(
        self, dim, *, groups=None, diagonal=False, lag_one=False, max_dim=None,
        block_dim=None, dtype=tf.float32, name=None
    ):
        """``max_dim``: a budget on the width; a factor wider (``dim > max_dim``)
        keeps only its diagonal and says so in ``wide`` (None: no budget).
        ``block_dim``: a full, ungrouped factor wider keeps its diagonal blocks
        of at most ``block_dim`` (``blocks``, a ``BlockLayout``; else None)."""
        super().__init__(name=name)
        self.dim = int(dim)
        self.groups = groups
        self.wide = not diagonal and max_dim is not None and self.dim > int(max_dim)
        self.diagonal = bool(diagonal) or self.wide
        self.lag_one = bool(lag_one)
        self.blocks = self.blocks_for(block_dim)
        self.batch_shape = [] if groups is None else [int(groups)]
        if self.blocks is not None:
            shape = self.blocks.shape
        else:
            shape = self.batch_shape + ([self.dim] if self.diagonal else [self.dim] * 2)
        self.cov = ema.DebiasedEMA(shape, dtype, name="cov")
        self.cov_lag_one = None
        if lag_one:
            if self.diagonal or groups is not None:
                raise ValueError(f"{self.name}: lag_one needs a dense, ungrouped factor (width "
                                 f"{self.dim}{', over the size budget' if self.wide else ''})")
            self.cov_lag_one = ema.DebiasedEMA(shape, dtype, name="cov_lag_one")

    @property
    def dtype(self):
        return self.cov.dtype

    def update(self, data, decay):
        """Folds the batch estimates of ``data`` (``batch_estimates``) into the
        averages with ``decay``. Factors whose ``estimate_key`` is not None
        compute them in a kernel traced once per key and data signature
        (``shared_kernels.py``; ``kernels``, their block's)."""
        flat = tf.nest.flatten(data)
        key = self.estimate_key()
        if key is None or not all(isinstance(t, tf.Tensor) for t in flat):
            estimates = self.batch_estimates(data)
        else:
            structure = repr(tf.nest.map_structure(lambda _: 0, data))
            estimates = self.kernels(
                ("factor_estimates", key, structure),
                lambda *flat: self.batch_estimates(tf.nest.pack_sequence_as(data, flat)), *flat)
        self.fold(estimates, decay)

    def batch_estimates(self, data) -> list:
        """One batch's estimates of the averages (``averages()``) from ``data``
        (the layer kind's operands, as ``update`` takes them)."""
        raise NotImplementedError(f"{type(self).__name__}.batch_estimates")

    def estimate_key(self):
        """Everything ``batch_estimates`` reads besides ``data``, hashable; None
        (the default, for factors not audited for it): computed in place."""
        return None

    def _structure(self, *own) -> tuple:
        """``estimate_key`` of a factor whose estimates read its class, layout,
        groups, lag-one moment and dtype, and ``own``."""
        return (type(self), self.layout, self.groups, self.lag_one, self.dtype, *own)

    def averages(self) -> list:
        """The moving averages: the second moment, then the lag-one moment if tracked."""
        return [self.cov] + ([] if self.cov_lag_one is None else [self.cov_lag_one])

    def fold(self, estimates, decay):
        """Folds ``estimates`` (aligned with ``averages()``) in with ``decay``."""
        for average, estimate in zip(self.averages(), estimates, strict=True):
            average.update(estimate, decay)

    def row_estimates(self, sources, ones=False) -> list:
        """The batch estimates from `sources` (see module docstring); `ones`:
        the rows get the homogeneous coordinate 1 appended. Rows of another
        width (or group count) than the factor's raise
        `invariants.FactorShapeError` while tracing."""
        sources = [[tf.cast(x, self.dtype) for x in uses] for uses in sources]
        for uses in sources:
            for x in uses:
                invariants.check_rows(x, self.dim - int(bool(ones)), self.groups, self.name)
        out = [second_moment(sources, self.diagonal, ones, self.blocks)]
        if self.cov_lag_one is not None:
            out.append(lag_one_moment(sources, ones))
        return out

    def update_rows(self, sources, decay, ones=False):
        """Folds in the batch estimates from `sources` (``row_estimates``)."""
        self.fold(self.row_estimates(sources, ones), decay)

    def value(self):
        """The moving average (in blocks: with 1 on the padded diagonal)."""
        if self.blocks is not None:
            return self.blocks.with_padding(self.cov.value())
        return self.cov.value()

    def blocks_for(self, block_dim):
        """The ``BlockLayout`` this factor takes for ``block_dim`` (None: none):
        a full, ungrouped factor without a lag-one moment, wider than it."""
        if (block_dim is None or self.diagonal or self.groups is not None or self.lag_one
                or self.dim <= int(block_dim)):
            return None
        return BlockLayout.for_budget(self.dim, int(block_dim))

    def trace(self, value=None):
        """The trace of the factor (``value``: its current value by default),
        batched over the groups."""
        return self.layout.trace(self.value() if value is None else value)

    @property
    def layout(self) -> FactorLayout:
        return FactorLayout(self.dim, self.diagonal, self.blocks)

    def dense(self, value=None):
        """The factor as a matrix ``[(G,) d, d]`` (a diagonal or blocks expanded)."""
        value = self.value() if value is None else value
        if self.blocks is not None:
            return self.blocks.dense(value)
        return tf.linalg.diag(value) if self.diagonal else value

    def lag_one_value(self):
        if self.cov_lag_one is None:
            raise ValueError(f"{self.name}: lag-one moment not tracked")
        return self.cov_lag_one.value()
