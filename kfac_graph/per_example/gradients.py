"""``kg.per_example_gradients`` and ``kg.per_example_gradient_norms``: every
layer's per-example gradients, or their squared norms, from one forward and
one backward pass of the registered graph.

For each layer use the bridge (``kfac_graph.taps``) gives its operands
``(a, g)``, ``g`` the gradient of each example's own loss term at the use's
output; the rule of the layer's kind (``RuleRegistry``) turns them into
per-example gradients ``[B, *variable.shape]`` or ``[B]`` squared norms.
Generic layers get a vectorised per-example Jacobian of the per-example
loss terms with respect to their variables' reads.

Entry ``i`` is the gradient of the loss evaluated on example ``i`` alone:
example ``i``'s own loss term, plus the loss's weight penalty where it has
one (``penalty_gradients``). For a mean loss the batch gradient is the mean
over examples; for a sum loss without a penalty, the sum.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.ops.parallel_for import gradients as pfor_gradients

from kfac_graph import graph_options, invariants, layers, relaxed_shapes
from kfac_graph.auto_register import RegisteredFunction, auto_register
from kfac_graph.layers import uses as uses_lib
from kfac_graph.per_example.rules import RuleRegistry, default_registry
from kfac_graph.registration import Layer, Registration
from kfac_graph.taps import LayerTaps, layer_operands
from passes.errors import KfacGraphError

WANTS = ("grads", "norms", "both")


def layer_gradients(rules: RuleRegistry, layer: Layer, uses, batch=None) -> list:
    """``layer``'s per-example gradients ``[B, *variable.shape]`` from its
    uses ``[(a, g)]``. Uses whose specs differ (a tied kernel applied
    transposed in one of them) are summed use by use. ``batch``: B (default
    the first use's leading axis); a rule's result with another leading axis,
    or another shape than the variable's up to unit axes, raises
    ``KfacGraphError`` (``kfac_graph.invariants``)."""
    record = layers.kind(layer.kind)
    specs = [record.spec(layer, u) for u in range(layer.uses)]
    perms = [_op_kernel_perm(layer, u, s) for u, s in enumerate(specs)]
    if batch is None:
        batch = uses_lib.batch_size(tf.nest.flatten(uses_lib.as_pairs(uses)[0][0])[0])
    if all(s == specs[0] for s in specs) and len(set(perms)) == 1:
        grads = _stored_layout(rules.per_example_grads(layer.kind, uses, specs[0]), perms[0],
                               layer)
    else:
        per_use = [[invariants.batch_leading(g, batch, invariants.where(layer, u),
                                             "per-example gradient")
                    for g in _stored_layout(rules.per_example_grads(layer.kind, [use], spec),
                                            perm, layer)]
                   for u, (use, spec, perm) in enumerate(zip(uses, specs, perms))]
        grads = [tf.add_n(list(parts)) for parts in zip(*per_use)]
    if len(grads) != len(layer.variables):
        raise KfacGraphError(f"{invariants.where(layer)}: the {layer.kind} rule gave "
                             f"{len(grads)} gradients for {len(layer.variables)} variables")
    # the variables' own shapes (Conv1D's kernel has a unit axis less than the op's)
    return [invariants.to_variable_shape(g, v, batch, invariants.where(layer))
            for g, v in zip(grads, layer.variables)]


def _op_kernel_perm(layer, use, spec) -> tuple:
    """The permutation a use applies its kernel in (``use_attrs[use]
    ["kernel_perm"]``: ``transpose(W, perm)``, then any unit axes, is the op's
    kernel) where its rule works in the op's layout; () where the rule's spec
    carries the permutation itself (a dense layer's) or there is none."""
    perm = layer.use_attrs[use].get("kernel_perm") if layer.use_attrs else None
    return () if not perm or hasattr(spec, "kernel_perm") else tuple(int(p) for p in perm)


def _stored_layout(grads, perm, layer) -> list:
    """The rule's per-example gradients with the kernel's ``[B, *op kernel]``
    taken back to the stored layout: reshaped to ``[B, *transpose(W, perm)]``,
    then transposed by ``perm``'s inverse."""
    if not perm:
        return grads
    stored = [int(d) for d in layer.variables[0].shape]
    kernel = tf.reshape(grads[0], [-1, *(stored[p] for p in perm)])
    back = [0, *(1 + int(i) for i in np.argsort(perm))]
    return [tf.transpose(kernel, back), *grads[1:]]


def layer_squared_norms(rules: RuleRegistry, layer: Layer, uses, batch=None,
                        check_shapes: bool = True) -> tf.Tensor:
    """``[B]``: the squared norm of each example's gradient over ``layer``'s
    variables, by the rule's norm form when all uses share one spec (checked
    to be ``[B]``, and, unless ``check_shapes`` is False because the caller
    traces the same rule's gradients, the rule to give gradients of the
    variables' shapes)."""
    record = layers.kind(layer.kind)
    specs = [record.spec(layer, u) for u in range(layer.uses)]
    if batch is None:
        batch = uses_lib.batch_size(tf.nest.flatten(uses_lib.as_pairs(uses)[0][0])[0])
    perms = {_op_kernel_perm(layer, u, s) for u, s in enumerate(specs)}
    if not all(s == specs[0] for s in specs) or len(perms) > 1:
        return squared_norms(layer_gradients(rules, layer, uses, batch))
    if check_shapes:
        _check_rule_shapes(rules, layer, uses, specs[0], perms.pop())
    return invariants.batch_vector(rules.squared_norms(layer.kind, uses, specs[0]), batch,
                                   invariants.where(layer), "per-example squared norm")


def _check_rule_shapes(rules, layer, uses, spec, perm) -> None:
    """Traces the rule's gradients (no op of them runs: the norm does not read
    them) to check their shapes against the variables', as ``layer_gradients``
    does: a norm form can hide a wrong layout (a grouped convolution)."""
    graph = tf.Graph()
    with graph.as_default():
        placeholders = [(tf.compat.v1.placeholder(tf.convert_to_tensor(a).dtype,
                                                  tf.convert_to_tensor(a).shape),
                         tf.compat.v1.placeholder(tf.convert_to_tensor(g).dtype,
                                                  tf.convert_to_tensor(g).shape))
                        for a, g in uses_lib.as_uses(uses)]
        grads = _stored_layout(rules.per_example_grads(layer.kind, placeholders, spec), perm,
                               layer)
        for g, v in zip(grads, layer.variables):
            invariants.to_variable_shape(g, v, placeholders[0][0].shape[0] or tf.shape(g)[0],
                                         invariants.where(layer))


def squared_norms(grads) -> tf.Tensor:
    """``[B]``: the squared norm of each example's slice over several tensors."""
    return tf.add_n([tf.reduce_sum(tf.square(tf.reshape(g, [tf.shape(g)[0], -1])), axis=1)
                     for g in grads])


def generic_jacobians(reg: Registration, taps: LayerTaps, terms) -> dict:
    """``{variable.ref(): d terms / d variable}`` for the generic layers'
    variables (``taps`` must read them: ``read_variables``); ``terms``:
    ``[B]`` or ``[S, B]`` per-example scalars. A variable the terms do not
    depend on gets zeros; terms that are not per example raise
    ``KfacGraphError`` naming the variable."""
    generic = reg.generic_variables
    if not generic:
        return {}
    name = invariants.variable_name(generic[0])
    why = f"generic variable {name}: its per-example gradients cannot be computed"
    if terms is None:
        raise KfacGraphError(f"{why}: {taps.per_example_problem or 'no per-example loss terms'}")
    b, n = invariants.static_batch(taps.batch_size), terms.shape[-1] if terms.shape.rank else None
    if terms.shape.rank not in (1, 2) or (b is not None and n is not None and n != b):
        raise KfacGraphError(f"{why}: the per-example loss terms have shape {terms.shape}, "
                             f"not [B] (B={b})")
    reads = [taps.variable_reads[v.ref()] for v in generic]
    out = {}
    for v, read, j in zip(generic, reads, pfor_gradients.jacobian(terms, reads)):
        if j is None:  # v does not reach the loss terms (a penalty): zero per example
            j = tf.zeros(tf.concat([tf.shape(terms), tf.shape(read)], 0), read.dtype)
        out[v.ref()] = j
    return out


def generic_context(variable, layer) -> str:
    """``generic variable NAME (layer ...)`` for messages."""
    return f"generic variable {invariants.variable_name(variable)} ({invariants.where(layer)})"


def penalty_gradients(reg: Registration, taps: LayerTaps, once: bool = False) -> list:
    """Aligned with ``reg.variables``: ``dR/dv`` of the loss's weight
    penalties (``LossSpec.penalties``, through the loss's own scaling of
    them), None where a variable has none. One backward pass from the
    penalty terms, which read no data: no example is in it. ``once``: only
    the penalties added once beside the examples' terms (not those in every
    example's term of a summed loss, ``LossSpec.summed_penalties``)."""
    variables = list(reg.variables)
    if not taps.penalties:
        return [None] * len(variables)
    upstream = tf.gradients(taps.loss, list(taps.penalties))
    # a penalty in every example's term of a summed loss: B copies, one per example
    summed = set(reg.loss.summed_penalties)
    upstream = [None if once and name in summed else
                u / tf.cast(taps.batch_size, u.dtype) if name in summed and u is not None else u
                for name, u in zip(reg.loss.penalties, upstream)]
    pairs = [(p, u) for p, u in zip(taps.penalties, upstream) if u is not None]
    if not pairs:
        return [None] * len(variables)
    grads = tf.gradients([p for p, _ in pairs], variables, grad_ys=[u for _, u in pairs])
    return [None if g is None else tf.convert_to_tensor(g) for g in grads]


def per_layer_results(reg: Registration, taps: LayerTaps, rules: RuleRegistry,
                      want: str, penalties: bool = True) -> list:
    """Per layer: its per-example gradients (``want="grads"``, a list),
    their ``[B]`` squared norms (``want="norms"``, by the rule's norm form),
    or both (``want="both"``, a pair; one trace checks the rule's shapes
    once). Inside a tf.function; ``taps`` must read the generic variables
    (``read_variables``). With ``penalties`` (the default) each example's
    gradient holds the loss's weight penalties' gradient too (the gradient of
    the loss on that example alone; ``penalty_gradients``): a layer with one
    takes its norms from its gradients."""
    if want not in WANTS:
        raise ValueError(f"want must be one of {WANTS}, got {want!r}")
    batch = taps.batch_size
    jacobians = generic_jacobians(reg, taps, taps.per_example_loss)
    operands = layer_operands(reg, taps, [taps.output_gradients()])
    penalty = iter(penalty_gradients(reg, taps) if penalties else [None] * len(reg.variables))
    out = []
    for layer, uses in zip(reg.layers, operands):
        own = [next(penalty) for _ in layer.variables]
        penalised = any(p is not None for p in own)
        if uses is None:
            grads = _with_penalty([invariants.to_variable_shape(
                jacobians[v.ref()], v, batch, generic_context(v, layer))
                for v in layer.variables], own)
            results = {"grads": grads, "norms": squared_norms(grads)}
        else:
            uses = [(a, gs[0]) for a, gs in uses]
            results = {}
            if want != "norms" or penalised:
                results["grads"] = _with_penalty(layer_gradients(rules, layer, uses, batch), own)
            if want != "grads":
                results["norms"] = (squared_norms(results["grads"]) if penalised else
                                    layer_squared_norms(rules, layer, uses, batch,
                                                        check_shapes=want == "norms"))
        out.append((results["grads"], results["norms"]) if want == "both" else results[want])
    return out


def _with_penalty(grads, penalty) -> list:
    """Each example's gradient plus the penalty's (the same for every example)."""
    return [g if p is None else g + tf.cast(p, g.dtype)[None] for g, p in zip(grads, penalty)]


def model_norms(per_layer_squared_norms) -> tf.Tensor:
    """``[B]``: each example's whole-gradient norm from the layers' squared
    norms, summed in the widest of their dtypes (at least float32: layers
    of one model may compute in different floats)."""
    squared = list(per_layer_squared_norms)
    dtype = max((t.dtype for t in squared), key=lambda d: d.size)
    dtype = dtype if dtype.size >= 4 else tf.float32
    return tf.sqrt(tf.add_n([tf.cast(t, dtype) for t in squared]))


def per_example_gradients(fn, *args, rules: RuleRegistry | None = None,
                          graph_optimization: str = "off") -> list[tf.Tensor]:
    """A list aligned with ``fn.registration(*args).variables``, entry ``k``
    shaped ``[batch, *variable.shape]``. ``graph_optimization``: called
    eagerly, ``"off"`` skips Grappler's rewrites of the function's graph
    (its first call's largest one-time cost; later calls run as fast),
    ``"default"`` keeps TensorFlow's (``kfac_graph/graph_options.py``);
    inside a ``tf.function`` the caller's graph decides."""
    fn = _registered(fn)
    return list(graph_options.eager_call(_compiled(fn, "grads", rules), args,
                                        graph_optimization))


def per_example_gradient_norms(fn, *args, rules: RuleRegistry | None = None,
                               graph_optimization: str = "off") -> tf.Tensor:
    """``[batch]``: the L2 norm of each example's whole gradient, computed
    per layer without materialising per-example gradients where the rule's
    cost model says that is cheaper. ``graph_optimization`` as for
    ``per_example_gradients``."""
    fn = _registered(fn)
    return graph_options.eager_call(_compiled(fn, "norms", rules), args, graph_optimization)


def _compiled(fn: RegisteredFunction, want: str, rules):
    """One function per wanted result and rule set, cached on the registered
    function: traced at the first arguments' shapes, and once more with the
    sizes that changed unknown for arguments of other shapes, where the loss
    registers the same kinds of layers there (``relaxed_shapes``; the rules
    are exact at any size, and nothing is kept between calls)."""
    key = ("per_example", want, id(rules))
    cached = fn.derived.get(key)
    if cached is not None:
        return cached
    registry = rules or default_registry()

    def per_example(*args):
        reg = fn.registration(*args)
        taps = LayerTaps.build(reg, args, read_variables=reg.generic_variables)
        per_layer = per_layer_results(reg, taps, registry, want)
        if want == "grads":
            return [g for grads in per_layer for g in grads]
        return model_norms(per_layer)

    # autograph=False: nothing here branches on tensors, and a KfacGraphError
    # raised while tracing reaches the caller as it is (one line)
    run = relaxed_shapes.Relaxed(
        per_example, relaxed_shapes.kinds_check(fn),
        f"kg.per_example_{'gradients' if want == 'grads' else 'gradient_norms'}",
        autograph=False)
    fn.derived[key] = run
    return run


def _registered(fn) -> RegisteredFunction:
    return fn if isinstance(fn, RegisteredFunction) else auto_register(fn)
