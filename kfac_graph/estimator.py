"""Public façade: ``kg.FisherEstimator`` (built in ``kfac_graph.fisher.estimator``)."""
from kfac_graph.fisher.estimator import MODES, FisherEstimator

__all__ = ["FisherEstimator", "MODES"]
