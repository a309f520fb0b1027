"""``own_pullback()``: while it is open, the ``kg.KFAC`` steps traced take
the loss's gradients with a plain ``tf.gradients`` and leave the quadratic
model's exact Fisher forms a backward pass of their own (a pullback of
zeros), as before the two shared one (``exact_fisher.loss_gradients``).
The benchmarks time both side by side with it (a ``cold_start.py``
variant ending ``:own_pullback``, or a K-FAC spec holding ``pullback=own``:
``split_spec`` and ``step_with``); the two steps compute the same values,
up to the order of float sums."""
import contextlib

import tensorflow as tf

from kfac_graph.optimizer import step_pass


@contextlib.contextmanager
def own_pullback(active: bool = True):
    """The context of the module docstring (a no-op unless ``active``)."""
    saved = step_pass._gradients
    if active:
        step_pass._gradients = lambda taps, variables, for_forms: tf.gradients(taps.loss,
                                                                              variables)
    try:
        yield
    finally:
        step_pass._gradients = saved


OWN = "pullback=own"


def split_spec(spec: str) -> tuple[str, bool]:
    """``(spec without OWN, whether it held OWN)`` for ``kfac_spec.parse``."""
    items = spec.split()
    return " ".join(i for i in items if i != OWN), OWN in items


def step_with(step, own: bool):
    """``step`` called inside ``own_pullback(own)`` (it matters at the first
    call, which traces it)."""
    def call(*batch):
        with own_pullback(own):
            return step(*batch)
    return call
