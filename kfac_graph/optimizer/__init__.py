"""The K-FAC optimizer: ``kfac.py`` (``KFAC``: options, state, the compiled
step), ``step_core.py`` (the step's logic, shared by ``single_device.py`` and
``distributed.py``, which provide its seams), ``schedule.py`` (when to update
the covariances and inverses), ``update_rules.py`` (the momentum rules and
the norm constraint), ``damping.py`` (Levenberg-Marquardt adaptation),
``qmodel.py`` (the 2x2 quadratic model), ``cap_watch.py`` and
``qmodel_fallback.py`` (a model its cap shortens on most steps: the warning,
the hand-over to regular momentum), ``exact_fisher.py`` (exact Fisher
quadratic forms), ``vectors.py`` (arithmetic on parameter lists)."""
from kfac_graph.optimizer.kfac import KFAC
from kfac_graph.optimizer.kfac_options import MOMENTUM_TYPES

__all__ = ["KFAC", "MOMENTUM_TYPES"]
