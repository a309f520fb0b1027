"""The Gauss-Newton curvature of joined outputs, block by block.

A loss over several outputs joined into one ``z`` ``[B, N]``
(``passes.joined_outputs``) whose Hessian is block-diagonal
(``passes.loss_output.hessian_blocks``: a VAE's Bernoulli reconstruction
over 784 pixels beside its KL term over the codes) has blocks ``(n_b, K_b)``
in order along ``z``'s columns: block ``b`` holds ``n_b`` values per
example, ``P_b = n_b / K_b`` positions of ``K_b`` classes, and its Hessian
is ``K_b x K_b`` per position,

    H_b[i, p] = d^2 l_i / dz_{i,b,p}^2           ([B, P_b, K_b, K_b]).

Column ``c`` of every position's ``H_b`` is one backward pass: the gradient
of ``dl/dz . u_{b,c}``, ``u_{b,c}`` one at class ``c`` of every position of
block ``b`` and zero elsewhere, read on block ``b``'s columns (exact as the
pass checked that no term mixes the positions of a block, or two blocks).
So the ``sum_b K_b`` passes (vectorised into one) give every block, where
the joined ``N x N`` Hessian would take ``N`` passes and an ``N x N``
eigendecomposition per example. Each block is made positive semidefinite
on its own (``ggn.GGN``).

A block that is one output of categorical heads (``LossSpec.likelihood_blocks``:
a masked-LM head over a word-piece vocabulary, where ``K_b`` passes are
beyond any budget) takes no pass: its Hessian per position is the
likelihood's Fisher in closed form,

    H_b[i, p] = w_ip (diag(q) - q q^T),   q = softmax(z_{i,b,p}),

``w_ip`` the weight of the position's terms in ``l_i`` (``k dL/dterms``,
``token_weights.head_weights``: a masked mean's ``B m_ip / sum(m)``; the
heads' weights summed), the loss being linear in its terms; equal to the
loss's Hessian for a sparse cross-entropy (or labels that sum to one), as
for one categorical output.

``BlockGGN`` offers ``GGN``'s interface over ``z``: ``multiply_fisher``,
``fisher_diagonal``, ``sample_cotangent`` (``S_b eps`` per block and
position) and the square root's columns, ``K_b`` per block, each shared by
the block's positions as for any output with positions
(``cotangents.exact_columns``), or with ``separate=True`` one per position
and class."""
import itertools

import tensorflow as tf

from kfac_graph.fisher.distributions import Categorical
from kfac_graph.fisher.ggn import GGN, at_least_float32_dtype, hessian_rows, symmetric_part
from passes.errors import KfacGraphError


def block_sizes(blocks, z):
    """``blocks`` with each ``n_b`` at run time: a block whose positions are not
    known statically (``None``; one at most) holds the joined width less the
    others' values."""
    if all(n is not None for n, _ in blocks):
        return tuple(blocks)
    rest = tf.shape(z)[1] - sum(n for n, _ in blocks if n is not None)
    return tuple((rest if n is None else n, k) for n, k in blocks)


def _units(blocks, z, formed):
    """``[sum K, N]``: row ``(b, c)`` one at class ``c`` of every position of
    block ``b`` (``blocks`` as ``block_sizes`` gives them; those ``formed``):
    each block's classes tiled over its positions."""
    width, start, rows = tf.shape(z)[1], 0, []
    for (n, k), form in zip(blocks, formed):
        if form:
            rows.append(tf.pad(tf.tile(tf.eye(k, dtype=z.dtype), [1, n // k]),
                               [[0, 0], [start, width - start - n]]))
        start = start + n
    return tf.concat(rows, 0)


def block_hessians(per_example_loss, z, blocks, formed=None):
    """``[H_b]``, each ``[B, P_b, K_b, K_b]`` (module docstring), in float32 at
    least, non-finite entries (a step about to be skipped) zero; ``blocks``
    as ``block_sizes`` gives them; ``formed``: per block, whether to form it
    (None in its place where not; default all)."""
    batch = tf.shape(z)[0]
    formed = [True] * len(blocks) if formed is None else list(formed)
    if not any(formed):
        return [None] * len(blocks)
    first = itertools.accumulate([k if form else 0 for (_, k), form in zip(blocks, formed)],
                                 initial=0)
    offsets = itertools.accumulate([n for n, _ in blocks], initial=0)
    rows = hessian_rows(per_example_loss, z, _units(blocks, z, formed))  # [sum K, B, N]
    if rows is None:
        return [tf.zeros([batch, n // k, k, k], at_least_float32_dtype(z.dtype)) if form
                else None for (n, k), form in zip(blocks, formed)]
    return [symmetric_part(tf.transpose(tf.reshape(  # [B, P, l, c]
        rows[row:row + k, :, start:start + n], [k, batch, n // k, k]), [1, 2, 3, 0]), z.dtype)
        if form else None for (n, k), start, row, form in zip(blocks, offsets, first, formed)]


def block_curvature(per_example_loss, z, blocks, weights=()):
    """``BlockGGN`` at ``z`` ``[B, N]``: per block (``blocks`` as
    ``block_sizes`` gives them), its categorical heads' Fisher where
    ``weights`` has their terms' weights (``LayerTaps.block_weights``, each
    shaped like its terms: ``P_b`` or ``P_b K_b`` per example), else the
    Hessian."""
    weights = tuple(weights) or (None,) * len(blocks)
    hessians = block_hessians(per_example_loss, z, blocks, [w is None for w in weights])
    batch, start, parts = tf.shape(z)[0], 0, []
    for (n, k), w, h in zip(blocks, weights, hessians):
        if w is None:
            parts.append(GGN(h))
        else:
            logits = tf.reshape(tf.stop_gradient(tf.cast(
                z[:, start:start + n], at_least_float32_dtype(z.dtype))), [batch, n // k, k])
            parts.append(WeightedCategorical(logits, tf.add_n(
                [tf.reshape(t, [batch, n // k, -1])[..., 0] for t in w])))
        start = start + n
    return BlockGGN(parts, blocks)


class WeightedCategorical:
    """``w (diag(q) - q q^T)`` per position (module docstring) at logits
    ``[B, P, K]`` with weights ``w`` ``[B, P]`` (a negative weight taken as
    zero: the positive semidefinite part), with ``GGN``'s interface."""

    def __init__(self, logits, weights):
        self._dist = Categorical(logits)
        self._w = tf.maximum(tf.cast(weights, logits.dtype), 0.0)[..., None]
        self._root = tf.sqrt(self._w)

    def flat(self):
        return tf.reduce_all(self.fisher_diagonal() <= 0.0)

    def sqrt_fisher_columns(self):
        return [self._root * c for c in self._dist.sqrt_fisher_columns()]

    def sqrt_fisher(self):
        return self._root[..., None] * self._dist.sqrt_fisher()

    def fisher_diagonal(self):
        return self._w * self._dist.fisher_diagonal()

    def multiply_fisher(self, v):
        return self._w * self._dist.multiply_fisher(tf.cast(v, self._w.dtype))

    def sample_cotangent(self, seed):
        """``sqrt(w) (q - y)``, ``y`` one-hot drawn from ``q``: its outer
        products average to the block."""
        y = self._dist.sample(seed, one_hot=True)
        return self._root * (self._dist.probs - y)


class BlockGGN:
    """The joined output's Hessian, block by block, made positive semidefinite
    (``parts``: per block a ``GGN`` or a ``WeightedCategorical``)."""

    kind = "ggn"

    def __init__(self, parts, blocks):
        self._parts = list(parts)
        self._blocks = tuple(blocks)

    def _join(self, per_block):
        """``[B, P_b, K_b]`` per block -> ``[B, N]``."""
        return tf.concat([tf.reshape(t, [tf.shape(t)[0], n])
                          for t, (n, _) in zip(per_block, self._blocks)], axis=-1)

    def _split(self, v):
        """``[B, N]`` -> ``[B, P_b, K_b]`` per block."""
        parts = tf.split(v, [n for n, _ in self._blocks], axis=-1,
                         num=len(self._blocks))
        return [tf.reshape(t, [tf.shape(t)[0], -1, k])
                for t, (n, k) in zip(parts, self._blocks)]

    def flat(self):
        return tf.reduce_all(tf.stack([part.flat() for part in self._parts]))

    def sqrt_fisher_columns(self, separate=False):
        """Block ``b``'s ``K_b`` columns (``separate``: ``P_b K_b``), each zero
        outside its block (and, separate, outside its position)."""
        zeros = [tf.zeros_like(part.fisher_diagonal()) for part in self._parts]
        columns = []
        for b, ((n, k), part) in enumerate(zip(self._blocks, self._parts)):
            for c in part.sqrt_fisher_columns():  # [B, P, K]
                pieces = [c if j == b else zeros[j] for j in range(len(zeros))]
                if not separate:
                    columns.append(self._join(pieces))
                    continue
                if not isinstance(n, int):
                    raise KfacGraphError(
                        "exact Fisher with position_columns='separate': the joined outputs' "
                        "positions are not known when tracing")
                for p in range(n // k):
                    at = tf.reshape(tf.one_hot(p, n // k, dtype=c.dtype), [1, n // k, 1])
                    pieces[b] = c * at
                    columns.append(self._join(pieces))
        return columns

    def sqrt_fisher(self):
        """``S`` ``[B, N, C]`` with ``S S^T`` the block-diagonal ``H`` (one
        column per position and class)."""
        return tf.stack(self.sqrt_fisher_columns(separate=True), axis=-1)

    def fisher(self):
        s = self.sqrt_fisher()
        return tf.linalg.matmul(s, s, transpose_b=True)

    def fisher_diagonal(self):
        return self._join([part.fisher_diagonal() for part in self._parts])

    def multiply_fisher(self, v):  # (each part casts its share)
        return self._join([part.multiply_fisher(t)
                           for part, t in zip(self._parts, self._split(v))])

    def sample_cotangent(self, seed):
        seeds = tf.random.experimental.stateless_split(seed, len(self._parts))
        return self._join([part.sample_cotangent(seeds[b])
                           for b, part in enumerate(self._parts)])
