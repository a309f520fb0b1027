"""The K-FAC optimizer: ``kfac.py`` (the compiled step), ``damping.py``
(Levenberg-Marquardt adaptation), ``qmodel.py`` (the 2x2 quadratic model),
``vectors.py`` (arithmetic on parameter lists)."""
from kfac_graph.optimizer.kfac import KFAC, MOMENTUM_TYPES

__all__ = ["KFAC", "MOMENTUM_TYPES"]
