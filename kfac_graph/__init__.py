"""kfac_graph: K-FAC and per-example gradients for TensorFlow 2, registered
automatically by a compiler pass over the traced graph.

    @kg.auto_register
    def loss_fn(x, y): ...
    reg = loss_fn.registration(x, y)
    print(reg.summary())
"""
from kfac_graph.auto_register import (RegisteredFunction, auto_register, register_graph_def,
                                      register_saved_model)
from kfac_graph.estimator import FisherEstimator
from kfac_graph.optimizer import KFAC
from kfac_graph.keras_fit import KFACKerasOptimizer, KFACModel
from kfac_graph.dp import DPSGD, dp_gradients
from kfac_graph import privacy
from kfac_graph.privacy.keras_model import DPModel
from kfac_graph.per_example_api import per_example_gradient_norms, per_example_gradients
from kfac_graph.registration import GraphVariable, Layer, LossSpec, Registration
from kfac_graph.verify import verify
from kfac_graph.verify_report import VerifyReport
from passes.errors import KfacGraphError, LoadError, LossNotFoundError, TraceError

__all__ = [
    "auto_register", "RegisteredFunction", "register_saved_model", "register_graph_def",
    "Registration", "Layer", "LossSpec", "GraphVariable",
    "per_example_gradients", "per_example_gradient_norms", "dp_gradients", "DPSGD",
    "FisherEstimator", "KFAC",
    "verify", "VerifyReport",
    "KFACModel", "KFACKerasOptimizer", "DPModel", "privacy",
    "KfacGraphError", "TraceError", "LoadError", "LossNotFoundError",
]
__version__ = "0.1.0"
