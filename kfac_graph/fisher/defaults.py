"""Which block a layer gets: the block factories by name, and each kind's
default, read from its record (`kfac_graph.layers.KINDS`).

Plain data and functions, no module-level mutable state.  A "block factory"
is any callable `factory(var_shapes, attrs, *, num_uses, **options)`
returning a `FisherBlock`; every block class is one.  A kind's record
names the factories it allows (alias -> a name in `BLOCK_FACTORIES`) and its
default alias; today's defaults:

  dense, conv2d, conv3d,          -> Kronecker (K-FAC / KFC; with several
  depthwise_conv2d                   uses, the independent-uses version)
  grouped_dense                    -> GroupedDenseKroneckerBlock (K-FAC per
                                     group, blocks_grouped_dense.py)
  conv2d_transpose,                -> ConvTransposeKroneckerBlock (KFC on the
  conv3d_transpose                   kernel, the bias's exact block beside it)
  scale_and_shift                  -> full when the parameter count is at most
                                     SCALE_AND_SHIFT_FULL_MAX_PARAMS (1024),
                                     diagonal above
  embedding                        -> EmbeddingKroneckerBlock
  tied_embedding                   -> NaiveDiagonalBlock (per-example grads;
                                     the exact diagonal of the tied table
                                     where the sources are exact: see
                                     blocks_full.py);
                                     "kron": TiedEmbeddingKroneckerBlock
                                     (lookup and projection Kronecker terms
                                     summed, inverted exactly; blocks_tied.py)
  generic                          -> NaiveDiagonalBlock (per-example grads)

Layers at several positions "expand" by default (`positions.py`); dense,
conv, depthwise and transposed-conv kinds also allow "kron_reduce" (K-FAC-reduce). Expand
stays the default until a benchmark says otherwise.
"""

import types

import numpy as np

from kfac_graph import layers
from kfac_graph.fisher import blocks_conv_transpose
from kfac_graph.fisher import blocks_full
from kfac_graph.fisher import blocks_grouped_dense
from kfac_graph.fisher import blocks_kron
from kfac_graph.fisher import blocks_reduce
from kfac_graph.fisher import blocks_series
from kfac_graph.fisher import blocks_tied

SCALE_AND_SHIFT_FULL_MAX_PARAMS = 1024


def _num_params(var_shapes):
    return int(sum(np.prod(tuple(v.shape) if hasattr(v, "shape") else v) for v in var_shapes))


def scale_and_shift_block(var_shapes, attrs=None, **options):
    """Full block for small scale/shift parameter sets, diagonal otherwise."""
    full = _num_params(var_shapes) <= SCALE_AND_SHIFT_FULL_MAX_PARAMS
    cls = blocks_full.ScaleAndShiftFullBlock if full else blocks_full.ScaleAndShiftDiagonalBlock
    return cls(var_shapes, attrs, **options)


BLOCK_FACTORIES = types.MappingProxyType({
    f.__name__: f for f in (
        blocks_kron.FullyConnectedKroneckerBlock, blocks_kron.ConvKroneckerBlock,
        blocks_kron.DepthwiseConvKroneckerBlock, blocks_kron.EmbeddingKroneckerBlock,
        blocks_reduce.FullyConnectedKroneckerReduceBlock, blocks_reduce.ConvKroneckerReduceBlock,
        blocks_reduce.DepthwiseConvKroneckerReduceBlock,
        blocks_series.FullyConnectedSeriesBlock, blocks_full.FullyConnectedDiagonalBlock,
        blocks_full.ConvDiagonalBlock, blocks_full.DepthwiseConvDiagonalBlock,
        blocks_full.ScaleAndShiftFullBlock, blocks_full.ScaleAndShiftDiagonalBlock,
        blocks_full.NaiveFullBlock, blocks_full.NaiveDiagonalBlock, scale_and_shift_block,
        blocks_conv_transpose.ConvTransposeKroneckerBlock,
        blocks_conv_transpose.ConvTransposeKroneckerReduceBlock,
        blocks_conv_transpose.ConvTransposeDiagonalBlock,
        blocks_tied.TiedEmbeddingKroneckerBlock,
        blocks_grouped_dense.GroupedDenseKroneckerBlock,
        blocks_grouped_dense.GroupedDenseDiagonalBlock)
})


def kind_blocks(kind):
    """``{alias: factory}``: the blocks the record of ``kind`` allows."""
    return {alias: BLOCK_FACTORIES[name] for alias, name in layers.kind(kind).blocks.items()}


DEFAULT_BLOCKS = types.MappingProxyType({
    name: BLOCK_FACTORIES[record.blocks[record.default_block]]
    for name, record in layers.KINDS.items()
})
LAYER_KINDS = tuple(layers.KINDS)


def block_factory(kind, overrides=None):
    """The factory for `kind`: `overrides[kind]` if given, else the default."""
    if overrides and kind in overrides:
        return overrides[kind]
    try:
        return DEFAULT_BLOCKS[kind]
    except KeyError:
        raise ValueError(
            f"block_factory: unknown layer kind {kind!r}; expected one of {LAYER_KINDS}"
        ) from None


def make_block(kind, var_shapes, attrs=None, *, num_uses=1, overrides=None, **options):
    """Builds the block for one layer.

    kind: a `Layer.kind`; var_shapes: the layer's variables or their shapes
    (kernel/scale first, then bias/shift); attrs: the op attributes (conv
    geometry); num_uses: `Layer.uses`; overrides: `{kind: factory}`;
    options: passed to the factory (damping, ema_decay, dtype, name, ...).
    """
    factory = block_factory(kind, overrides)
    return factory(var_shapes, attrs, num_uses=num_uses, **options)
