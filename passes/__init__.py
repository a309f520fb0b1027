"""The compiler pass: front ends, IR, and the passes that find layers and the loss.

``passes`` knows graphs, not optimizers: it never imports ``kfac_graph``.
"""
from passes.errors import KfacGraphError, LoadError, LossNotFoundError, TraceError
from passes.frontends import Traced, load_graph_def, load_saved_model, to_ir, trace
from passes.match_layers import LayerMatch, Use
from passes.match_loss import LossMatch
from passes.pipeline import PassResult, run

__all__ = [
    "KfacGraphError", "LoadError", "LossNotFoundError", "TraceError", "Traced",
    "load_graph_def", "load_saved_model", "to_ir", "trace", "LayerMatch", "Use",
    "LossMatch", "PassResult", "run",
]
