"""The model's state around ``kg.verify``'s checks.

Every check runs ``fn`` from the same variable values: the values they had
when ``verify`` was called. A loss that assigns a variable it then reads
changes the model each time it runs: Keras's ``SpectralNormalization`` in
training mode divides its kernel by the kernel's spectral norm and advances
its power-iteration vector on every call. Without a restore before each run,
the per-example gradients and their references would be taken on different
kernels, and a correct runtime would fail the checks. Moving averages, which
no output reads in training mode, are restored too, so ``verify`` leaves the
model as it found it.
"""
from __future__ import annotations

import tensorflow as tf


class SavedState:
    """``[(variable, value)]`` of every variable ``fn`` reads, taken at
    construction; ``run(f, *a)`` restores them, then returns ``f(*a)``."""

    def __init__(self, fn, args):
        try:
            variables = fn.concrete_function(*args).variables
        except (AttributeError, TypeError, ValueError):
            variables = ()
        self.saved = [(v, tf.identity(v.read_value())) for v in variables]

    def restore(self):
        for variable, value in self.saved:
            variable.assign(value)

    def run(self, f, *args):
        self.restore()
        return f(*args)
