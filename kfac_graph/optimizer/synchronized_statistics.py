"""Batch statistics synchronized across replicas: refused under several.

``BatchNormalization(synchronized=True)`` normalises each replica's share
of the batch by the mean and variance of the whole global batch, all-reduced
across the replicas inside ``strategy.run``. K-FAC's distributed step runs
the registered loss on each replica, and a registration is the loss as one
device computes it (``passes.frontends.one_device``): there the layer reads
its own replica's statistics. Trained so, the model is silently the
unsynchronized one (equal to ``synchronized=False`` to the last digit on 2
replicas), so ``kg.KFAC`` refuses such a layer in one line under more than
one replica. On one device the two are the same layer.

The layer is found as ``passes.keras_frozen`` finds Keras variables: among
the objects the garbage collector tracks, a batch normalisation (Keras 3's,
or Keras 2's where ``tf_keras`` is imported) whose weights include a
variable the registration captured.
"""
from __future__ import annotations

import gc
import sys

from passes.errors import KfacGraphError
from passes.keras_frozen import held_ids, subclasses


def synchronized_layers(variables) -> list[str]:
    """Names of the batch normalisations with ``synchronized=True`` that hold
    any of ``variables`` (a distributed variable's components count too)."""
    types = set()
    for module in ("keras", "tf_keras"):
        layers = getattr(sys.modules.get(module), "layers", None)
        types |= subclasses(getattr(layers, "BatchNormalization", None))
    if not types:
        return []
    ids = {i for v in variables for i in held_ids(v)}
    names = []
    for obj in gc.get_objects():
        if type(obj) in types and getattr(obj, "synchronized", False) and any(
                i in ids for w in obj.weights for i in held_ids(getattr(w, "_value", w))):
            names.append(obj.name)
    return names


def refuse(registration, replicas: int) -> None:
    """Raises where the registered loss, run on ``replicas`` > 1 replicas, holds
    a batch normalisation with synchronized statistics (module docstring)."""
    if replicas <= 1:
        return
    names = synchronized_layers(registration.variable_placeholders.values())
    if names:
        raise KfacGraphError(
            f"kg.KFAC under {replicas} replicas: BatchNormalization {names[0]!r} has "
            "synchronized=True, but each replica's step computes the registered loss with its "
            "own share's statistics; use synchronized=False (each replica's own statistics) or "
            "one device")
