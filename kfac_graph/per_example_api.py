"""``kg.per_example_gradients`` and ``kg.per_example_gradient_norms``.

One forward and one backward pass of the registered graph give, for every
layer use, its input ``a`` and the per-example gradient ``g`` at its output
(``LayerTaps``); the rule for the layer's kind (``kfac_graph.per_example``)
turns them into per-example gradients or squared norms. Generic layers fall
back to a vectorised per-example Jacobian of the per-example loss terms.

Entry ``i`` is the gradient of example ``i``'s own loss term, so for a mean
loss the batch gradient is the mean over examples, for a sum loss the sum.
Layers whose weights are coupled across examples (batch normalisation in
training mode) have no per-example gradient in this sense; their entries are
the per-example contributions through each example's own activations.
"""
from __future__ import annotations

import tensorflow as tf
from tensorflow.python.ops.parallel_for import gradients as pfor_gradients

from kfac_graph import per_example as pe
from kfac_graph.auto_register import RegisteredFunction, auto_register
from kfac_graph.layer_inputs import layer_input, layer_output_gradient
from kfac_graph.layer_taps import LayerTaps
from kfac_graph.registration import Layer, Registration


def per_example_gradients(fn, *args, rules: pe.RuleRegistry | None = None) -> list[tf.Tensor]:
    """A list aligned with ``fn.registration(*args).variables``, entry ``k``
    shaped ``[batch, *variable.shape]``."""
    fn = _registered(fn)
    reg = fn.registration(*args)
    return list(_compiled(fn, reg, "grads", rules)(*args))


def per_example_gradient_norms(fn, *args, rules: pe.RuleRegistry | None = None) -> tf.Tensor:
    """``[batch]``: the L2 norm of each example's whole gradient, computed
    per layer without materialising per-example gradients where the rule's
    cost model says that is cheaper."""
    fn = _registered(fn)
    reg = fn.registration(*args)
    return _compiled(fn, reg, "norms", rules)(*args)


def spec_for(layer: Layer, use: int = 0):
    """The rule spec of one use of ``layer``, from the pass's attributes."""
    attrs = layer.use_attrs[use]
    shapes = [tuple(v.shape) for v in layer.variables]
    has_second = len(shapes) == 2
    if layer.kind == "dense":
        return pe.DenseSpec(has_bias=has_second, transpose_kernel=bool(attrs.get("transpose_kernel")))
    if layer.kind == "conv2d":  # the op's kernel shape: Conv1D adds a unit axis
        return pe.ConvSpec.from_attrs(attrs.get("kernel_shape") or shapes[0], attrs,
                                      has_bias=has_second)
    if layer.kind == "depthwise_conv2d":
        return pe.DepthwiseSpec.from_attrs(attrs.get("kernel_shape") or shapes[0], attrs,
                                           has_bias=has_second)
    if layer.kind == "embedding":
        return pe.EmbeddingSpec(vocab_size=shapes[0][0])
    if layer.kind == "scale_and_shift":
        if not attrs.get("has_scale", True):  # a shift alone: a scale rule with the shift part kept
            return ("shift_only", pe.ScaleShiftSpec(scale_shape=shapes[0], has_shift=True))
        return pe.ScaleShiftSpec(scale_shape=shapes[0], has_shift=has_second)
    raise ValueError(f"layer {layer.name!r}: no per-example rule for kind {layer.kind!r}")


def _apply(rules, layer, uses, specs, want):
    kind = layer.kind
    shift_only = isinstance(specs[0], tuple)
    if shift_only:
        specs = [s[1] for s in specs]
    if all(s == specs[0] for s in specs) and not shift_only:
        if want == "grads":
            return rules.per_example_grads(kind, uses, specs[0])
        return rules.squared_norms(kind, uses, specs[0])
    # Uses that differ (a tied kernel applied transposed in one of them), or a
    # shift alone: sum per-use gradients, then take norms of the sum.
    per_use = [rules.per_example_grads(kind, [use], spec) for use, spec in zip(uses, specs)]
    grads = [tf.add_n(list(parts)) for parts in zip(*per_use)]
    if shift_only:
        grads = grads[1:]
    return grads if want == "grads" else _squared_norms(grads)


def _squared_norms(grads) -> tf.Tensor:
    return tf.add_n([tf.reduce_sum(tf.square(tf.reshape(g, [tf.shape(g)[0], -1])), axis=1)
                     for g in grads])


def _compiled(fn: RegisteredFunction, reg: Registration, want: str, rules):
    key = ("per_example", want, id(reg), id(rules))
    cached = fn.derived.get(key)
    if cached is not None:
        return cached
    registry = rules or pe.default_registry()

    @tf.function
    def run(*args):
        taps = LayerTaps.build(reg, args, read_variables=reg.generic_variables)
        per_layer = per_layer_results(reg, taps, registry, want)
        if want == "grads":
            return [g for grads in per_layer for g in grads]
        return tf.sqrt(tf.add_n(per_layer))

    fn.derived[key] = run
    return run


def per_layer_results(reg: Registration, taps: LayerTaps, registry: pe.RuleRegistry,
                      want: str) -> list:
    """Per layer: its per-example gradients (``want="grads"``, a list) or
    their ``[B]`` squared norms (``want="norms"``). Inside a tf.function;
    ``taps`` must read the generic variables (``read_variables``)."""
    generic_grads = {}
    generic = reg.generic_variables
    if generic:
        reads = [taps.variable_reads[v.ref()] for v in generic]
        jacobians = pfor_gradients.jacobian(taps.per_example_loss, reads)
        generic_grads = {v.ref(): j for v, j in zip(generic, jacobians)}
    gradients = taps.output_gradients()
    out = []
    for index, layer in enumerate(reg.layers):
        if layer.kind == "generic":
            grads = [generic_grads[v.ref()] for v in layer.variables]
            out.append(grads if want == "grads" else _squared_norms(grads))
            continue
        uses = [(layer_input(layer, u, taps.inputs[index][u]),
                 layer_output_gradient(layer, u, gradients[index][u])) for u in range(layer.uses)]
        specs = [spec_for(layer, u) for u in range(layer.uses)]
        result = _apply(registry, layer, uses, specs, want)
        if want == "grads":  # back to the variables' own shapes (Conv1D's kernel)
            result = [tf.reshape(g, [-1, *v.shape]) for g, v in zip(result, layer.variables)]
        out.append(result)
    return out


def _registered(fn) -> RegisteredFunction:
    return fn if isinstance(fn, RegisteredFunction) else auto_register(fn)

