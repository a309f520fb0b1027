"""K-FAC-reduce blocks (`positions.py`): the dense, conv and depthwise
Kronecker blocks of `blocks_kron.py` with one input row per example (the
mean over its positions and uses) and one output-gradient row (the sum),
and the replica count R = 1, so the damping is not divided by positions:

    F ~= A (x) G,   A = (1/B) sum_b abar_b abar_b^T,   G = (1/B) sum_b gsum_b gsum_b^T.

Everything else (damping split, cached inverses, wide factors, grouped
layouts) is the expand block's.
"""

from kfac_graph.fisher import positions as positions_lib
from kfac_graph.fisher.blocks_kron import (ConvKroneckerBlock, DepthwiseConvKroneckerBlock,
                                           FullyConnectedKroneckerBlock)


class FullyConnectedKroneckerReduceBlock(FullyConnectedKroneckerBlock):
    """K-FAC-reduce for a dense layer at several positions (`positions.py`):
    A from the per-example mean of [a, 1], G from the per-example sum of g,
    F ~= A (x) G."""

    positions = positions_lib.REDUCE


class ConvKroneckerReduceBlock(ConvKroneckerBlock):
    """K-FAC-reduce for a convolution: A from each example's mean patch (over
    its output locations, and uses), G from its summed output gradient,
    F ~= A (x) G (grouped: per group)."""

    positions = positions_lib.REDUCE


class DepthwiseConvKroneckerReduceBlock(DepthwiseConvKroneckerBlock):
    """K-FAC-reduce per channel of a depthwise convolution (see
    `ConvKroneckerReduceBlock`)."""

    positions = positions_lib.REDUCE
