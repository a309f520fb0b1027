"""Kronecker factors of the dense, conv, depthwise and embedding blocks.

Input factors average over examples, positions/locations and uses:
    A = (1 / (B T U)) sum_{i,t,u} abar abar^T,   abar = [a, 1] with a bias,
with `a` the layer input (dense), the input patch at an output location
(conv, depthwise: per input channel), or the one-hot id (embedding, kept as
its diagonal: the id counts / (B T U); no one-hot tensor is formed).
Output factors average the same way over the output-gradient rows g
(conv: at every output location; depthwise: per input channel, the M
outputs it feeds), summed over sources:
    G = sum_s (1 / (B T U)) sum_{i,t,u} g_s g_s^T.

`update` arguments (a list over uses; see `blocks_base` for the layout):
    input factors:  `inputs`  = [a_use0, a_use1, ...]
    output factors: `grads`   = [g_use0, ...], each g a tensor or a list
                    over sources (samples / square-root columns).
"""

import tensorflow as tf

from kfac_graph.fisher import factors_base
from kfac_graph.fisher import patches as patches_lib


def sources_by_use(grads):
    """[use][source] (a tensor per use means one source) -> [source][use]."""
    per_use = [list(g) if isinstance(g, (list, tuple)) else [g] for g in grads]
    counts = {len(g) for g in per_use}
    if len(counts) != 1:
        raise ValueError("every use must have the same number of sources")
    return [list(s) for s in zip(*per_use)]


def _rows(x, d):
    return tf.reshape(x, [-1, d])


class DenseInputFactor(factors_base.CovarianceFactor):
    """A from dense inputs `[B, ..., d_in]` (plus the homogeneous 1)."""

    def __init__(self, d_in, has_bias, **kwargs):
        super().__init__(d_in + int(has_bias), **kwargs)
        self.d_in, self.has_bias = int(d_in), bool(has_bias)

    def update(self, inputs, decay):
        rows = [_rows(tf.cast(a, self.dtype), self.d_in) for a in inputs]
        self.update_rows([rows], decay, ones=self.has_bias)


class OutputFactor(factors_base.CovarianceFactor):
    """G from output gradients `[B, ..., d_out]` (NCHW conv grads allowed)."""

    def __init__(self, d_out, data_format=None, **kwargs):
        super().__init__(d_out, **kwargs)
        self.data_format = data_format

    def update(self, grads, decay):
        fmt = self.data_format

        def rows(g):
            g = tf.cast(g, self.dtype)
            if fmt is not None:
                g = patches_lib.channels_last(g, fmt)
            return _rows(g, self.dim)

        sources = sources_by_use(grads)
        self.update_rows([[rows(g) for g in uses] for uses in sources], decay)


class ConvInputFactor(factors_base.CovarianceFactor):
    """A from conv input patches at every output location (KFC)."""

    def __init__(self, kernel_shape, geometry, has_bias, **kwargs):
        kh, kw, cin = kernel_shape[:3]
        super().__init__(kh * kw * cin + int(has_bias), **kwargs)
        self.kernel_hw, self.geometry = (kh, kw), geometry
        self.has_bias = bool(has_bias)

    def update(self, inputs, decay):
        rows = []
        for a in inputs:
            p = patches_lib.extract_patches(tf.cast(a, self.dtype), self.kernel_hw, self.geometry)
            rows.append(tf.reshape(p, [-1, p.shape[-1]]))
        self.update_rows([rows], decay, ones=self.has_bias)


class DepthwiseInputFactor(factors_base.CovarianceFactor):
    """Per input channel c: A_c `[C, k(+1), k(+1)]` from its `kh*kw` patch."""

    def __init__(self, kernel_shape, geometry, has_bias, **kwargs):
        kh, kw, channels = kernel_shape[:3]
        super().__init__(kh * kw + int(has_bias), groups=channels, **kwargs)
        self.kernel_hw, self.geometry = (kh, kw), geometry
        self.channels, self.has_bias = int(channels), bool(has_bias)

    def update(self, inputs, decay):
        rows = []
        for a in inputs:
            p = patches_lib.extract_patches(tf.cast(a, self.dtype), self.kernel_hw, self.geometry)
            r = tf.reshape(p, [-1, self.kernel_hw[0] * self.kernel_hw[1], self.channels])
            rows.append(tf.transpose(r, [0, 2, 1]))
        self.update_rows([rows], decay, ones=self.has_bias)


class DepthwiseOutputFactor(factors_base.CovarianceFactor):
    """Per input channel c: G_c `[C, M, M]` over outputs c*M ... c*M+M-1."""

    def __init__(self, channels, multiplier, data_format="NHWC", **kwargs):
        super().__init__(multiplier, groups=channels, **kwargs)
        self.channels, self.data_format = int(channels), data_format

    def update(self, grads, decay):
        def rows(g):
            g = patches_lib.channels_last(tf.cast(g, self.dtype), self.data_format)
            return tf.reshape(g, [-1, self.channels, self.dim])

        sources = sources_by_use(grads)
        self.update_rows([[rows(g) for g in uses] for uses in sources], decay)


class EmbeddingInputFactor(factors_base.CovarianceFactor):
    """Diagonal A `[V]`: the frequency of each id among all B*T*U lookups."""

    def __init__(self, vocab_size, **kwargs):
        kwargs["diagonal"] = True
        super().__init__(vocab_size, **kwargs)

    def update(self, inputs, decay):
        counts, total = [], []
        for ids in inputs:
            flat = tf.reshape(ids, [-1])
            ones = tf.ones(tf.shape(flat), self.dtype)
            counts.append(tf.math.unsorted_segment_sum(ones, flat, self.dim))
            total.append(tf.reduce_sum(ones))
        self.cov.update(tf.add_n(counts) / tf.add_n(total), decay)
