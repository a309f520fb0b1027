"""One traced function per structure for the blocks' repeated algebra.

A model's layers repeat (a transformer's blocks, a ResNet stage's
bottlenecks), and so do their Fisher blocks' computations: the refresh of
a Kronecker block's inverses is the same graph for every block whose
factors have the same widths and layouts. Traced in place, a step's graph
holds one copy per block, every operation made in Python, and making them
is most of a K-FAC step's first call (README, "Cold start and scale").
``SharedKernels`` traces such a computation once per structure, as a
``tf.function`` of tensors alone, and every block of that structure calls
it: the traced step holds one call per block and one body per structure.
The values are those of the computation traced in place (TensorFlow
inlines the bodies when it runs the step).

A kernel's contract: a function of its tensor arguments alone, whose graph
depends on nothing but ``key`` (a hashable description of every static
property it reads) and the arguments' shapes and dtypes. Its first trace is
checked to capture nothing from outside: a variable or tensor read inside
would make every later caller use the first one's, so that is an error
naming the kernel, raised while tracing. Executing eagerly, and for blocks
outside an estimator (``IN_PLACE``), kernels run in place.
"""
from __future__ import annotations

import tensorflow as tf


def _signature(tensors) -> tuple:
    return tuple((None if t.shape.rank is None else tuple(t.shape.as_list()), t.dtype)
                 for t in tensors)


class SharedKernels:
    """Kernels traced once per ``(key, argument signature)`` (module docstring);
    ``share=False``: every call runs in place."""

    def __init__(self, share: bool = True):
        self.share = bool(share)
        self._functions = {}

    def __call__(self, key, kernel, *tensors):
        """``kernel(*tensors)``, traced once for every call with this ``key``
        and these shapes and dtypes."""
        if not self.share or tf.executing_eagerly():
            return kernel(*tensors)
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        full_key = (key, _signature(tensors))
        function = self._functions.get(full_key)
        if function is None:
            function = tf.function(kernel, autograph=False)
            if function.get_concrete_function(*tensors).captured_inputs:
                raise RuntimeError(f"kfac_graph: shared kernel {key[0]!r} reads a tensor or "
                                   f"variable outside its arguments")
            self._functions[full_key] = function
        return function(*tensors)

    def traced(self) -> list:
        """The name (``key[0]``) of every kernel traced, once per structure."""
        return [key[0] for key, _ in self._functions]


IN_PLACE = SharedKernels(share=False)


def share(blocks, kernels: SharedKernels) -> None:
    """Lets ``blocks`` and the blocks and factors inside them (wrapped,
    composed) call ``kernels``."""
    for block in blocks:
        for member in [block, *block.submodules]:
            if hasattr(member, "kernels"):  # a FisherBlock or a CovarianceFactor
                member.kernels = kernels
