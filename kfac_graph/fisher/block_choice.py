"""Which Fisher block each registered layer gets, and the data it is fed.

``make_layer_block(layer, approximations, **options)`` picks the block
through ``fisher.make_block``'s override mechanism. ``approximations`` maps
a layer kind or a ``Layer.name`` (the name wins) to a block factory or to
one of the aliases its kind's record allows (``LayerKind.blocks``); today:

    kind              "kron"                   "diagonal"              "full"
    dense             FullyConnectedKronecker  FullyConnectedDiagonal  NaiveFull
    conv2d, conv3d    ConvKronecker            ConvDiagonal            NaiveFull
    conv2d_transpose  ConvTransposeKronecker   ConvTransposeDiagonal   NaiveFull
    conv3d_transpose  (the same)
    depthwise_conv2d  DepthwiseConvKronecker   DepthwiseConvDiagonal   NaiveFull
    grouped_dense     GroupedDenseKronecker    GroupedDenseDiagonal    NaiveFull
    scale_and_shift   -                        ScaleAndShiftDiagonal   ScaleAndShiftFull
    embedding         EmbeddingKronecker       NaiveDiagonal           NaiveFull
    tied_embedding    TiedEmbeddingKronecker   NaiveDiagonal           NaiveFull
    generic           -                        NaiveDiagonal           NaiveFull

(``TiedEmbeddingKronecker``: ``R_L diag(p) (x) G_L + R_P Q (x) H``, the
lookups' and the projections' Kronecker terms summed, their cross terms
dropped, the damped sum inverted exactly; ``blocks_tied.py``) plus
``"series"`` (dense: ``FullyConnectedSeriesBlock``, option 2),
``"auto"`` (scale_and_shift: full up to 1024 parameters, else diagonal),
and, for dense, conv2d, conv3d and depthwise_conv2d layers applied at
several positions per example, ``"kron_reduce"`` (K-FAC-reduce:
``FullyConnectedKroneckerReduceBlock``, ``ConvKroneckerReduceBlock``,
``DepthwiseConvKroneckerReduceBlock``; ``positions.py``) beside
``"kron_expand"``, the same as ``"kron"`` (the default).

``max_factor_size`` (the estimator's option, default
``DEFAULT_MAX_FACTOR_SIZE``) goes to every factory that takes it (each
block class does): a Kronecker factor wider than it keeps only its
diagonal; ``factor_block_size`` k (the estimator's option, default None)
goes to them too: a full, ungrouped factor of the Kronecker blocks above
(not the tied embedding's or the series blocks') wider than k keeps its
diagonal blocks of at most k (``factor_blocks.py``); the estimator's
``summary()`` (``report.py``) says which did what.

Per-use information reaches a factory through ``attrs`` (``block_attrs``):
the layer's own attributes, and for a tied embedding ``"tied_roles"``, every
use's role (``"lookup"`` or ``"projection"``) in use order, the order of the
``(a, g)`` pairs the block is fed.

Layouts the blocks do not assume, adapted here so that every block's
vectors and ``full_matrix`` follow the variables' own row-major layout:

- a dense kernel stored ``[d_out, d_in]`` (``transpose_kernel`` in every
  use: ``matmul(a, W, transpose_b=True)``): the block is built for
  ``[d_in, d_out]`` and wrapped in ``TransposedKernelBlock``
  (``blocks_compose.py``);
- a dense kernel applied as stored in some uses and transposed in others
  (tied encoder/decoder weights): no Kronecker or (a, g) block describes
  it, so it gets a block fed per-example gradients (``NaiveDiagonalBlock``
  unless a per-example-gradient block is asked for), with a warning;
- a dense kernel the op transposes by ``perm`` before applying it
  (``kernel_perm``: Keras's ``"btd,ndh->btnh"``): the block is built for
  the permuted kernel and wrapped in ``PermutedKernelBlock``;
- a dense kernel made of several variables (``stacked_rows``: ``x @ W + h
  @ R``, ``passes/patterns_stacked.py``): the block is built for the one
  kernel ``[W; R]`` and wrapped in ``StackedKernelBlock``, so that every
  dense block (the Kronecker block over ``[x, h, 1]``, series, diagonal)
  applies; blocks fed per-example gradients take the variables as they are;
- a scale-and-shift layer without a scale (a bias alone) is fed ``xhat = 1``
  (its gradient is then the scale rule's); ``xhat`` and ``g`` arrive with
  the axes the scale varies along moved last and read as the scale's shape
  (channels-first ``[1, C, 1, 1]``, group norm's ``[G, C/G]``: the kind's
  ``operands`` lays them out), where the blocks broadcast the scale.
"""
from __future__ import annotations

import inspect
import types

from absl import logging

from kfac_graph import layers
from kfac_graph.fisher import blocks_base, blocks_full, defaults
from kfac_graph.fisher.blocks_compose import (PermutedKernelBlock, StackedKernelBlock,
                                              TransposedKernelBlock)

ALIASES = types.MappingProxyType({kind: types.MappingProxyType(defaults.kind_blocks(kind))
                                   for kind in layers.KINDS})
PER_EXAMPLE = "per_example_gradients"
DEFAULT_MAX_FACTOR_SIZE = 4096


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


def _takes(factory, option) -> bool:
    """Whether ``factory`` accepts the keyword ``option`` (or any keyword)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == option or p.kind == p.VAR_KEYWORD for p in params)


def block_attrs(layer) -> dict:
    """The ``attrs`` a block factory gets for ``layer`` (module docstring)."""
    attrs = dict(layer.attrs)
    if layer.kind == "tied_embedding":
        attrs["tied_roles"] = tuple(a.get("tied_role") for a in layer.use_attrs)
    return attrs


def make_layer_block(layer, approximations=None, max_factor_size=None,
                     factor_block_size=None, **options) -> blocks_base.FisherBlock:
    """The block for ``layer``; ``options`` go to the factory (damping,
    ema_decay, dtype, name), and ``max_factor_size`` and ``factor_block_size``
    too if given and it takes them."""
    factory = resolve_factory(layer, approximations)
    for option, value in (("max_factor_size", max_factor_size),
                          ("factor_block_size", factor_block_size)):
        if value is not None and _takes(factory or defaults.block_factory(layer.kind), option):
            options[option] = value
    overrides = {layer.kind: factory} if factory is not None else None
    shapes = [tuple(int(d) for d in v.shape) for v in layer.variables]
    attrs = block_attrs(layer)
    make = lambda kind, s, o: defaults.make_block(kind, s, attrs, num_uses=layer.uses,
                                                overrides=o, **options)
    orientation = kernel_orientation(layer)
    perms = {tuple(a.get("kernel_perm") or ()) for a in layer.use_attrs}
    if any(perms):  # a kernel transposed before the op in some use
        return _permuted_block(layer, factory, shapes, make, overrides, perms, options)
    rows = attrs.get("stacked_rows")
    if layer.kind == "dense" and rows:
        if getattr(factory, "stats", None) == PER_EXAMPLE:
            return make(layer.kind, shapes, overrides)
        inner = make(layer.kind, [(sum(rows), shapes[0][1])] + shapes[len(rows):], overrides)
        if block_stats(inner) == PER_EXAMPLE:
            return make(layer.kind, shapes, overrides)
        return StackedKernelBlock(inner, shapes, rows, attrs, num_uses=layer.uses, **options)
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


def _permuted_block(layer, factory, shapes, make, overrides, perms, options):
    """A kernel (dense or convolution) the op transposes by ``perm`` before applying it: the
    block of the permuted kernel, wrapped in ``PermutedKernelBlock``; uses
    with different permutations get a block fed per-example gradients."""
    if getattr(factory, "stats", None) == PER_EXAMPLE:
        return make(layer.kind, shapes, overrides)
    if len(perms) > 1:
        logging.warning("kfac_graph: %s layer %s applies its kernel in different layouts; it "
                        "gets a diagonal Fisher block from per-example gradients", layer.kind,
                        layer.name)
        return blocks_full.NaiveDiagonalBlock(shapes, dict(layer.attrs), num_uses=layer.uses,
                                              **options)
    perm = perms.pop()
    inner = make(layer.kind, [tuple(shapes[0][p] for p in perm)] + shapes[1:], overrides)
    if block_stats(inner) == PER_EXAMPLE:
        return make(layer.kind, shapes, overrides)
    return PermutedKernelBlock(inner, shapes, perm, dict(layer.attrs), num_uses=layer.uses,
                               **options)
