"""A loss that reads across replicas: refused by K-FAC under several.

K-FAC's distributed step runs the registered loss on each replica, and a
registration is the loss as one device computes it (``passes.one_device``).
Where the function reads across replicas (``all_reduce``, ``all_gather`` or
``merge_call`` of the replica context), one device's trace reads its own
values alone: ``BatchNormalization(synchronized=True)`` normalises each
replica's share by that share's statistics, not the global batch's; a
contrastive loss gathering the other replicas' embeddings sees only its own.
Trained so, the model was silently another one (with ``synchronized=True``
on 2 replicas, exactly the unsynchronized one), so ``kg.KFAC`` refuses such
a loss in one line under more than one replica, naming where it read
(``Registration.replica_reads``). On one device the two are the same loss.
"""
from __future__ import annotations

from passes.errors import KfacGraphError


def refuse(registration, replicas: int) -> None:
    """Raises where ``registration`` read across replicas and the step runs on
    ``replicas`` > 1 of them (module docstring)."""
    reads = registration.replica_reads
    if replicas > 1 and reads:
        raise KfacGraphError(
            f"kg.KFAC under {replicas} replicas: the loss reads across replicas at "
            f"{reads[0]!r} (all_reduce, all_gather: BatchNormalization(synchronized=True), a "
            "cross-replica contrastive loss), which each replica's step computes from its own "
            "share alone; use one replica's values there (synchronized=False) or one device")
