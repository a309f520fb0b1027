"""The errors the pass raises: one documented family, one line each."""


LOSS_HOW_TO = 'name it explicitly: kg.auto_register(loss="categorical"|"bernoulli"|"normal")'


class KfacGraphError(ValueError):
    """Base class: bad input to kfac_graph. The message is one line that names
    the op, layer, function or variable at fault."""


class TraceError(KfacGraphError):
    """The function could not be traced into a graph with a scalar loss and
    trainable variables."""


class LoadError(KfacGraphError):
    """A SavedModel, saved function or GraphDef could not be read."""


class LossNotFoundError(KfacGraphError):
    """The pass could not read the loss's predictive distribution from the
    graph. Name it explicitly with ``kg.auto_register(loss="categorical")``
    (or "bernoulli", "normal")."""
