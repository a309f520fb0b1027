"""Which Fisher block each registered layer gets, and the data it is fed.

``make_layer_block(layer, approximations, **options)`` picks the block
through ``fisher.make_block``'s override mechanism. ``approximations`` maps
a layer kind or a ``Layer.name`` (the name wins) to a block factory or to
one of the aliases its kind's record allows (``LayerKind.blocks``); today:

    kind              "kron"                   "diagonal"              "full"
    dense             FullyConnectedKronecker  FullyConnectedDiagonal  NaiveFull
    conv2d            ConvKronecker            ConvDiagonal            NaiveFull
    depthwise_conv2d  DepthwiseConvKronecker   DepthwiseConvDiagonal   NaiveFull
    scale_and_shift   -                        ScaleAndShiftDiagonal   ScaleAndShiftFull
    embedding         EmbeddingKronecker       NaiveDiagonal           NaiveFull
    generic           -                        NaiveDiagonal           NaiveFull

plus ``"series"`` (dense: ``FullyConnectedSeriesBlock``, option 2) and
``"auto"`` (scale_and_shift: full up to 1024 parameters, else diagonal).

Layouts the blocks do not assume, adapted here so that every block's
vectors and ``full_matrix`` follow the variables' own row-major layout:

- a dense kernel stored ``[d_out, d_in]`` (``transpose_kernel`` in every
  use: ``matmul(a, W, transpose_b=True)``): the block is built for
  ``[d_in, d_out]`` and wrapped in ``TransposedKernelBlock``;
- a dense kernel applied as stored in some uses and transposed in others
  (tied encoder/decoder weights): no Kronecker or (a, g) block describes
  it, so it gets a block fed per-example gradients (``NaiveDiagonalBlock``
  unless a per-example-gradient block is asked for), with a warning;
- a scale-and-shift layer without a scale (a bias alone) is fed ``xhat = 1``
  (its gradient is then the scale rule's); ``xhat`` and ``g`` arrive with
  the axes the scale varies along moved last and read as the scale's shape
  (channels-first ``[1, C, 1, 1]``, group norm's ``[G, C/G]``: the kind's
  ``operands`` lays them out), where the blocks broadcast the scale.
"""
from __future__ import annotations

import types

import numpy as np
import tensorflow as tf
from absl import logging

from kfac_graph import layers
from kfac_graph.fisher import blocks_base, blocks_full, defaults

ALIASES = types.MappingProxyType({kind: types.MappingProxyType(defaults.kind_blocks(kind))
                                   for kind in layers.KINDS})
PER_EXAMPLE = "per_example_gradients"


def kernel_orientation(layer) -> str:
    """``"io"`` (kernel ``[d_in, d_out]``), ``"oi"`` (stored transposed in
    every use) or ``"mixed"``; ``"io"`` for layers other than dense."""
    if layer.kind != "dense":
        return "io"
    flags = {bool(attrs.get("transpose_kernel", False)) for attrs in layer.use_attrs}
    return "mixed" if len(flags) > 1 else ("oi" if flags == {True} else "io")


def resolve_factory(layer, approximations):
    """The factory ``approximations`` asks for ``layer`` (None: the default)."""
    if not approximations:
        return None
    choice = approximations.get(layer.name, approximations.get(layer.kind))
    if choice is None or callable(choice):
        return choice
    try:
        return ALIASES[layer.kind][choice]
    except KeyError:
        raise ValueError(f"approximation {choice!r} is not available for layer {layer.name!r} "
                         f"of kind {layer.kind!r}; choose one of "
                         f"{sorted(ALIASES[layer.kind])} or pass a block factory") from None


def block_stats(block) -> str:
    return getattr(block, "stats", "activations")


def make_layer_block(layer, approximations=None, **options) -> blocks_base.FisherBlock:
    """The block for ``layer``; ``options`` go to the factory (damping,
    ema_decay, dtype, name)."""
    factory = resolve_factory(layer, approximations)
    overrides = {layer.kind: factory} if factory is not None else None
    shapes = [tuple(int(d) for d in v.shape) for v in layer.variables]
    attrs = dict(layer.attrs)
    make = lambda kind, s, o: defaults.make_block(kind, s, attrs, num_uses=layer.uses,
                                                overrides=o, **options)
    orientation = kernel_orientation(layer)
    if orientation == "mixed":
        if getattr(factory, "stats", None) == PER_EXAMPLE:
            return make(layer.kind, shapes, overrides)
        logging.warning("kfac_graph: dense layer %s applies its kernel both as stored and "
                        "transposed; it gets a diagonal Fisher block from per-example "
                        "gradients", layer.name)
        return blocks_full.NaiveDiagonalBlock(shapes, attrs, num_uses=layer.uses, **options)
    if orientation == "oi":
        if getattr(factory, "stats", None) == PER_EXAMPLE:
            return make(layer.kind, shapes, overrides)
        inner_shapes = [shapes[0][::-1]] + shapes[1:]
        inner = make(layer.kind, inner_shapes, overrides)
        if block_stats(inner) == PER_EXAMPLE:
            return make(layer.kind, shapes, overrides)
        return TransposedKernelBlock(inner, shapes, attrs, num_uses=layer.uses, **options)
    return make(layer.kind, shapes, overrides)


class TransposedKernelBlock(blocks_base.FisherBlock):
    """A dense block built for ``[d_in, d_out]`` presented for a kernel
    stored ``[d_out, d_in]``: vectors are transposed on the way in and out,
    ``full_matrix`` is permuted to the stored row-major order. Statistics
    (``(a, g)`` uses) pass through unchanged; ``block`` is the inner one."""

    def __init__(self, block, var_shapes, attrs=None, **kwargs):
        super().__init__(var_shapes, attrs, **kwargs)
        self.block = block
        self.stats = block.stats
        d_out, d_in = self.var_shapes[0]
        kernel = np.arange(d_in * d_out).reshape(d_in, d_out).T.reshape(-1)
        rest = np.arange(d_in * d_out, self.num_params)
        self._perm = np.concatenate([kernel, rest]).astype(np.int64)

    def _inward(self, vs):
        return [tf.transpose(vs[0])] + list(vs[1:])

    def _outward(self, vs):
        return [tf.transpose(vs[0])] + list(vs[1:])

    def damping(self, value=None):
        return self.block.damping(value)

    def update(self, data, decay=None):
        return self.block.update(data, decay)

    def inverse_updates(self, damping=None):
        return self.block.inverse_updates(damping)

    def inverses_stale(self, damping=None):
        return self.block.inverses_stale(damping)

    def multiply(self, vs, damping=None):
        return self._outward(self.block.multiply(self._inward(vs), damping))

    def multiply_inverse(self, vs, refreshed=False, damping=None):
        return self._outward(self.block.multiply_inverse(self._inward(vs), refreshed, damping))

    def multiply_matpower(self, vs, exp, damping=None):
        return self._outward(self.block.multiply_matpower(self._inward(vs), exp, damping))

    def multiply_cholesky(self, vs, transpose=False, damping=None):
        """``P L P^T`` for the inner ``L`` (``P`` the layout permutation):
        not triangular, but its product with its transpose is the block."""
        return self._outward(self.block.multiply_cholesky(self._inward(vs), transpose, damping))

    def multiply_cholesky_inverse(self, vs, transpose=False, damping=None):
        return self._outward(self.block.multiply_cholesky_inverse(self._inward(vs), transpose,
                                                                  damping))

    def full_matrix(self):
        inner = self.block.full_matrix()
        return tf.gather(tf.gather(inner, self._perm, axis=0), self._perm, axis=1)
