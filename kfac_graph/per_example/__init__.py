"""Per-example gradient rules: turn a layer's (activation, output-gradient)
pairs into per-example gradients of its variables and per-example squared
gradient norms, independent of how the layer was found.

    from kfac_graph import per_example as pe
    reg = pe.default_registry()
    grads = reg.per_example_grads("dense", (a, g), pe.DenseSpec(has_bias=True))
    sq = reg.squared_norms("conv2d", [(a1, g1), (a2, g2)], conv_spec)
"""

from kfac_graph.per_example.conv import ConvRule
from kfac_graph.per_example.dense import DenseRule
from kfac_graph.per_example.depthwise import DepthwiseRule
from kfac_graph.per_example.embedding import EmbeddingRule
from kfac_graph.per_example.norms import gram_is_cheaper
from kfac_graph.per_example.norms import gram_squared_norms
from kfac_graph.per_example.registry import default_registry
from kfac_graph.per_example.registry import PerExampleRule
from kfac_graph.per_example.registry import RuleRegistry
from kfac_graph.per_example.scale_shift import ScaleShiftRule
from kfac_graph.per_example.specs import ConvSpec
from kfac_graph.per_example.specs import DenseSpec
from kfac_graph.per_example.specs import DepthwiseSpec
from kfac_graph.per_example.specs import EmbeddingSpec
from kfac_graph.per_example.specs import ScaleShiftSpec
from kfac_graph.per_example.xla import in_xla_context

__all__ = [
    "ConvRule",
    "ConvSpec",
    "DenseRule",
    "DenseSpec",
    "DepthwiseRule",
    "DepthwiseSpec",
    "EmbeddingRule",
    "EmbeddingSpec",
    "PerExampleRule",
    "RuleRegistry",
    "ScaleShiftRule",
    "ScaleShiftSpec",
    "default_registry",
    "gram_is_cheaper",
    "gram_squared_norms",
    "in_xla_context",
]
