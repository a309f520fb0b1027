"""Per-example gradients: the registry of rules by layer kind, and the
computation of every layer's per-example gradients or norms from one
re-run of the registered graph (``gradients.py``). The rules and specs
themselves live with their kinds in ``kfac_graph.layers``; they are
re-exported here for callers that apply a rule to tensors of their own:

    from kfac_graph import per_example as pe
    reg = pe.default_registry()
    grads = reg.per_example_grads("dense", (a, g), pe.DenseSpec(has_bias=True))
    sq = reg.squared_norms("conv2d", [(a1, g1), (a2, g2)], conv_spec)
"""

from kfac_graph.layers.conv import ConvRule, ConvSpec
from kfac_graph.layers.conv_transpose import ConvTransposeRule, ConvTransposeSpec
from kfac_graph.layers.dense import DenseRule, DenseSpec
from kfac_graph.layers.depthwise import DepthwiseRule, DepthwiseSpec
from kfac_graph.layers.embedding import EmbeddingRule, EmbeddingSpec
from kfac_graph.layers.norms import gram_is_cheaper, gram_squared_norms
from kfac_graph.layers.scale_shift import ScaleShiftRule, ScaleShiftSpec
from kfac_graph.layers.xla import in_xla_context
from kfac_graph.per_example.rules import PerExampleRule, RuleRegistry, default_registry

__all__ = [
    "ConvRule",
    "ConvSpec",
    "ConvTransposeRule",
    "ConvTransposeSpec",
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
