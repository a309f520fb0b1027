"""Which block a layer gets: defaults per layer kind, overridable per kind.

Plain data and functions, no module-level mutable state.  A "block factory"
is any callable `factory(var_shapes, attrs, *, num_uses, **options)`
returning a `FisherBlock`; every block class is one.

Defaults:
  dense, conv2d, depthwise_conv2d -> Kronecker (K-FAC / KFC; with several
                                     uses, the independent-uses version)
  scale_and_shift                  -> full when the parameter count is at most
                                     SCALE_AND_SHIFT_FULL_MAX_PARAMS (1024),
                                     diagonal above
  embedding                        -> EmbeddingKroneckerBlock
  generic                          -> NaiveDiagonalBlock (per-example grads)
"""

import types

import numpy as np

from kfac_graph.fisher import blocks_full
from kfac_graph.fisher import blocks_kron

SCALE_AND_SHIFT_FULL_MAX_PARAMS = 1024

LAYER_KINDS = ("dense", "conv2d", "depthwise_conv2d", "scale_and_shift", "embedding", "generic")


def _num_params(var_shapes):
    return int(sum(np.prod(tuple(v.shape) if hasattr(v, "shape") else v) for v in var_shapes))


def scale_and_shift_block(var_shapes, attrs=None, **options):
    """Full block for small scale/shift parameter sets, diagonal otherwise."""
    full = _num_params(var_shapes) <= SCALE_AND_SHIFT_FULL_MAX_PARAMS
    cls = blocks_full.ScaleAndShiftFullBlock if full else blocks_full.ScaleAndShiftDiagonalBlock
    return cls(var_shapes, attrs, **options)


DEFAULT_BLOCKS = types.MappingProxyType(
    {
        "dense": blocks_kron.FullyConnectedKroneckerBlock,
        "conv2d": blocks_kron.ConvKroneckerBlock,
        "depthwise_conv2d": blocks_kron.DepthwiseConvKroneckerBlock,
        "scale_and_shift": scale_and_shift_block,
        "embedding": blocks_kron.EmbeddingKroneckerBlock,
        "generic": blocks_full.NaiveDiagonalBlock,
    }
)


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
