"""Public façade: ``kg.per_example_gradients`` and ``kg.per_example_gradient_norms``.

One forward and one backward pass of the registered graph give, for every
layer use, its input ``a`` and the per-example gradient ``g`` at its output
(``LayerTaps``); the rule for the layer's kind (``kfac_graph.per_example``)
turns them into per-example gradients or squared norms. Generic layers fall
back to a vectorised per-example Jacobian of the per-example loss terms.

Entry ``i`` is the gradient of the loss on example ``i`` alone (its own
loss term, plus a weight penalty's gradient where the loss adds one), so for
a mean loss the batch gradient is the mean over examples, for a sum loss
without a penalty the sum.
Layers whose weights are coupled across examples (batch normalisation in
training mode) have no per-example gradient in this sense; their entries are
the per-example contributions through each example's own activations.
"""
from kfac_graph.per_example.gradients import per_example_gradient_norms, per_example_gradients

__all__ = ["per_example_gradients", "per_example_gradient_norms"]
