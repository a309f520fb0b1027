"""``own_pullback()``: while it is open, the ``kg.KFAC`` steps traced take
the loss's gradients with a plain ``tf.gradients`` and leave the quadratic
model's exact Fisher forms a backward pass of their own (a pullback of
zeros), as before the two shared one (``exact_fisher.loss_gradients``).
The benchmarks time both side by side with it (a row or variant named
``own_pullback``); the two steps compute the same values."""
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
