"""What each ``kg.KFAC`` option takes (``kfac_graph/options.py`` checks them):
``KFAC.OPTIONS`` is this table; the estimator's options are
``FisherEstimator``'s own."""
import inspect
import types

from kfac_graph import graph_options, options
from kfac_graph.fisher.estimator import FisherEstimator
from kfac_graph.optimizer import distributed

MOMENTUM_TYPES = ("regular", "adam", "qmodel")

_EST = FisherEstimator.OPTIONS
OPTIONS = types.MappingProxyType({
    "learning_rate": options.Real(0.0, low_open=True, dynamic=True), "damping": options.Real(0.0),
    "momentum": options.Real(0.0, 1.0, high_open=True),
    "momentum_type": options.OneOf(MOMENTUM_TYPES), "l2_reg": options.Real(0.0),
    "norm_constraint": options.Real(0.0, low_open=True, none=True),
    "cov_update_period": options.Integer(1, none=True),
    "inverse_update_period": options.Integer(1, none=True),
    "stagger_inverses": options.Boolean(), "spread_covariances": options.OneOf((None, True, False)),
    "overhead_budget": options.Real(1.0, low_open=True, none=True),
    "cov_ema_decay": _EST["cov_ema_decay"], "num_burnin_steps": options.Integer(0),
    "max_factor_size": _EST["max_factor_size"], "factor_block_size": _EST["factor_block_size"],
    "estimation_mode": _EST["estimation_mode"], "num_samples": _EST["num_samples"],
    "adapt_damping": options.Boolean(), "damping_adaptation_interval": options.Integer(1),
    "damping_adaptation_decay": options.Real(0.0, 1.0, low_open=True),
    "min_damping": options.Real(0.0, none=True),
    "qmodel_curvature": options.OneOf(("exact", "kfac")),
    "qmodel_batch_fraction": options.Real(0.0, 1.0, low_open=True, none=True), "seed": _EST["seed"],
    "qmodel_fallback": options.Boolean(),
    "jit_compile": options.OneOf((True, False, "auto")),
    "summary_period": options.Integer(1),
    "sync_statistics": options.OneOf(distributed.SYNC_MODES),
    "graph_optimization": options.OneOf(graph_options.MODES), "relax_shapes": options.Boolean()})
del _EST


def learning_rate_schedule(learning_rate) -> tuple:
    """``(schedule, initial value)``: ``learning_rate`` and its value at step
    0 if it is a schedule (a callable of the step), else ``(None,
    learning_rate)``. With ``"qmodel"`` a schedule's value scales the step the
    quadratic model picks (an annealing of that step; ``update_rules.py``)."""
    if not callable(learning_rate):
        return None, learning_rate
    return learning_rate, float(learning_rate(0))


def check(cls, owner, prefix, values) -> dict:
    """``values`` (keywords of ``cls``, ``kg.KFAC``) checked by ``OPTIONS``, and
    ``min_damping <= damping`` (the default damping if not given): a one-line
    ``ValueError`` naming ``owner`` and ``prefix + option``; returns them converted."""
    given = options.check_all(owner, OPTIONS, values, prefix)
    damping = given.get("damping", inspect.signature(cls).parameters["damping"].default)
    options.check_at_most(owner, prefix + "min_damping", given.get("min_damping"),
                          prefix + "damping", damping)
    return given
