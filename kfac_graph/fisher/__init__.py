"""Fisher curvature for kfac_graph: distributions, factors and blocks.

The blocks take plain tensors (layer inputs and output gradients, or
per-example gradients); they know nothing of how layers were found, and
read each layer kind's math (patches, rows, per-example rules) from
`kfac_graph.layers`.  See `blocks_base` for the block contract and data
layout. The estimator (`estimator.py`, one block per registered layer,
chosen by `block_choice.py`) is imported from its module, not from here.
"""

from kfac_graph.fisher.blocks_base import FisherBlock, FullBlock, DiagonalBlock
from kfac_graph.fisher.blocks_full import (
    NaiveFullBlock,
    NaiveDiagonalBlock,
    FullyConnectedDiagonalBlock,
    ConvDiagonalBlock,
    DepthwiseConvDiagonalBlock,
    ScaleAndShiftFullBlock,
    ScaleAndShiftDiagonalBlock,
)
from kfac_graph.fisher.blocks_kron import (
    KroneckerBlock,
    GroupedKroneckerBlock,
    FullyConnectedKroneckerBlock,
    FullyConnectedMultiIndepBlock,
    ConvKroneckerBlock,
    ConvMultiIndepBlock,
    DepthwiseConvKroneckerBlock,
    EmbeddingKroneckerBlock,
)
from kfac_graph.fisher.blocks_reduce import (
    FullyConnectedKroneckerReduceBlock,
    ConvKroneckerReduceBlock,
    DepthwiseConvKroneckerReduceBlock,
)
from kfac_graph.fisher.blocks_series import FullyConnectedSeriesBlock
from kfac_graph.fisher.blocks_compose import PartsBlock, TransposedKernelBlock
from kfac_graph.fisher.blocks_tied import TiedEmbeddingKroneckerBlock
from kfac_graph.fisher.blocks_grouped_dense import (
    GroupedDenseKroneckerBlock,
    GroupedDenseDiagonalBlock,
)
from kfac_graph.fisher.blocks_conv_transpose import (
    ConvTransposeKroneckerBlock,
    ConvTransposeKroneckerReduceBlock,
    ConvTransposeDiagonalBlock,
)
from kfac_graph.fisher.defaults import (
    BLOCK_FACTORIES,
    DEFAULT_BLOCKS,
    SCALE_AND_SHIFT_FULL_MAX_PARAMS,
    block_factory,
    make_block,
)
from kfac_graph.fisher.distributions import (Bernoulli, Categorical, Normal, at_least_float32,
                                             make_distribution)
from kfac_graph.fisher.ema import DebiasedEMA
from kfac_graph.fisher.factors_base import CovarianceFactor
from kfac_graph.fisher.factors_grad import (
    ExampleGradientFactor,
    NaiveFactor,
    LayerGradientFactor,
    DenseGradientFactor,
)
from kfac_graph.fisher.factors_kron import (
    DenseInputFactor,
    OutputFactor,
    PatchInputFactor,
    ConvInputFactor,
    DepthwiseInputFactor,
    EmbeddingInputFactor,
    conv_output_factor,
    conv_transpose_factors,
    depthwise_output_factor,
)

import types as _types

__all__ = sorted(
    n
    for n, v in globals().items()
    if not n.startswith("_") and not isinstance(v, _types.ModuleType)
)
