"""The bridge from a Registration to tensors: re-run the registered graph
and read every layer use's inputs and output gradients.

Both runtimes read layers through here: the per-example rules and the
Fisher statistics take, per layer and per use, the operands `(a, [g, ...])`
that `layer_operands` builds with the kind's record
(`kfac_graph.layers`), one `g` per source (cotangent) of the backward pass.

``LayerTaps.build(registration, args)`` imports the registration's inlined
graph into the current ``tf.function`` (it must run in graph mode: call it
from inside a ``tf.function``, jit-compiled or not), wiring the function's
arguments and the captured variables in, and returns the tensors the
per-example and curvature rules need: the loss, the model output ``z``, the
targets, the per-example losses, and for each layer and each use its input
tensors and its pre-activation output.

``output_gradients(cotangent)`` then takes one backward pass for all layers
(``tf.gradients`` inside the graph, which sees the imported ops): with no
cotangent, the gradients of the per-example loss terms, ``g_i = d(c l_i)/ds_i``
(``B`` times the gradient of a mean loss); with a cotangent ``v`` at the model
output, the vector-Jacobian products ``v_i^T dz_i/ds_i``.

``batch_size`` is the registration's batch B (the arguments' leading axis),
which every per-example result is checked against (``kfac_graph.invariants``);
``per_example_loss`` is ``[B]`` (a per-token loss flattened to ``[B*T]`` is
summed per example; weighted by the tokens' weights) or None, with
``per_example_problem`` saying why; terms added beside the likelihood's
(``Registration.per_example_extras``) are in it; ``penalties``: the loss's
weight-penalty terms (``LossSpec.penalties``); ``token_weights``: for a loss with
data weights (``LossSpec.weighted``), each token's weight ``w_it`` laid out
like the model output's tokens (``kfac_graph.token_weights``), else None;
for a loss that divides by sizes known at run time alone
(``LossSpec.size_scaled``: ``w_it = s m_it``, ``s`` the ``1/T`` of a mean)
they are the data's ``m_it`` (None without data weights) and ``size_scale``
is ``s``, a factor of the curvature's scale (the Fisher's tokens weighted
as at known sizes: ``optimizer/step_pass.py``). A
``tf.py_function`` in the graph re-runs its Python function for each
backward pass (``_callback_gradient``; see ``passes/callbacks.py``), and a
grouped ``Conv2D`` gets a gradient the CPU can run (``grouped_conv_grad``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import script_ops

from kfac_graph import grouped_conv_grad, invariants, layers, token_weights
from kfac_graph.registration import Registration
from kfac_graph.layers.scalars import as_dtype
from passes import custom_gradients, inline
from passes.errors import KfacGraphError


@dataclasses.dataclass(frozen=True)
class LayerTaps:
    registration: Registration
    loss: tf.Tensor
    model_output: tf.Tensor | None
    targets: tf.Tensor | None
    per_example_loss: tf.Tensor | None
    inputs: tuple[tuple[tuple[tf.Tensor, ...], ...], ...]
    outputs: tuple[tuple[tf.Tensor, ...], ...]
    variable_reads: dict
    batch: Any = None
    per_example_problem: str = ""
    token_weights: tf.Tensor | None = None
    size_scale: tf.Tensor | None = None
    penalties: tuple[tf.Tensor, ...] = ()
    block_weights: tuple = ()  # per block of a joined loss: its categorical heads' weights, or None
    # what is computed once per forward pass for every caller (the loss's Hessian at z)
    derived: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, registration: Registration, args: Sequence[Any],
              read_variables: Sequence[Any] = ()) -> "LayerTaps":
        """Imports the graph with ``args``. ``read_variables``: variables
        whose reads are replaced by tensors of ours (``variable_reads[v.ref()]``)
        so gradients with respect to them can be taken per example."""
        if tf.executing_eagerly():
            raise RuntimeError("LayerTaps.build must run inside a tf.function")
        reg = registration
        if not reg.variable_placeholders:
            raise ValueError("this registration has no variable objects (a GraphDef "
                             "registration cannot be run); register a function or a SavedModel")
        flat_args = graph_inputs(args)
        if len(flat_args) != len(reg.arguments):
            raise ValueError(f"expected {len(reg.arguments)} argument tensors, got {len(flat_args)}")
        # tf.identity places each argument in the current graph (a tf.cond
        # branch reads the enclosing function's tensors through it).
        read = {t.lstrip("^").split(":")[0] for n in reg.graph_def.node for t in n.input}
        flat_args = [tf.identity(a) for a in flat_args]
        input_map = {f"{name}:0": a for name, a in zip(reg.arguments, flat_args)
                     if name in read}  # an argument the loss does not read is not mapped
        graph = tf.compat.v1.get_default_graph()
        for node, variable in reg.variable_placeholders.items():
            input_map[f"{node}:0"] = graph.capture(_handle(variable))
        for node, handle in reg.captured_resources.items():  # a lookup table's
            input_map[f"{node}:0"] = graph.capture(handle)
        reads = {}
        wanted = {v.ref() for v in read_variables}
        for node, variable in reg.variable_placeholders.items():
            if variable.ref() in wanted:
                _check_replaceable(reg, node, variable)
                value = tf.identity(variable.read_value())
                reads[variable.ref()] = value
                for read in reg.variable_reads.get(node, ()):
                    input_map[f"{read}:0"] = value

        names = [reg.output]
        loss_spec = reg.loss
        extra = [loss_spec.output, loss_spec.targets, reg.per_example_loss]
        names += [t for t in extra if t] + list(loss_spec.penalties)
        names += [t for t, _ in reg.per_example_extras] + [s.tensor for s in loss_spec.sizes]
        names += [*reg.term_outputs.values(), *sum(loss_spec.likelihood_blocks, ())]
        for layer in reg.layers:
            for use_inputs, output in zip(layer.inputs, layer.outputs):
                names += list(use_inputs) + [output]
        unique = list(dict.fromkeys(names))
        # a Python callback's gradient re-runs its function (see _callback_gradient)
        existing = len(graph.get_operations())
        with graph.gradient_override_map({"EagerPyFunc": _CALLBACK_GRADIENT}):
            tensors = dict(zip(unique, tf.graph_util.import_graph_def(
                _without_mapped_placeholders(reg.graph_def, input_map), input_map=input_map,
                return_elements=unique, name="kfac_graph")))
        # a grouped Conv2D's gradient is one the CPU has (grouped_conv_grad)
        grouped_conv_grad.mark(graph.get_operations()[existing:])
        model_output = tensors.get(loss_spec.output) if loss_spec.output else None
        batch = _batch_of(flat_args, model_output)
        per_example, problem = None, "the loss pass found no per-example loss terms"
        weights = size_scale = None
        if reg.per_example_loss:
            terms, coefficient = tensors[reg.per_example_loss], reg.per_example_coefficient
            if loss_spec.weighted:
                weights, terms = token_weights.read(reg, tensors[reg.output], terms,
                                                    model_output, batch)
                coefficient = 1.0
                if loss_spec.size_scaled and weights is not None:  # w_it = s m_it
                    size_scale = token_weights.size_scale(loss_spec.sizes, tensors, batch,
                                                          weights.dtype)
                    weights = weights / size_scale if loss_spec.data_weighted else None
            laid_out = lambda name: tensors.get(reg.term_outputs.get(name), model_output)
            per_example, problem = _per_example_terms(terms, batch,
                                                      laid_out(reg.per_example_loss))
            if per_example is not None:
                per_example = per_example * as_dtype(coefficient, per_example.dtype)
            for name, _ in reg.per_example_extras:  # (their weights read as dL/dterms)
                own, why = _per_example_terms(token_weights.own_terms(
                    reg, tensors[reg.output], tensors[name], batch), batch, laid_out(name))
                if per_example is None or own is None:
                    per_example, problem = None, problem or why
                    break
                per_example = per_example + tf.cast(own, per_example.dtype)
        return cls(
            registration=reg, loss=tensors[reg.output],
            model_output=model_output,
            targets=tensors.get(loss_spec.targets) if loss_spec.targets else None,
            per_example_loss=per_example,
            inputs=tuple(tuple(tuple(tensors[t] for t in use) for use in layer.inputs)
                         for layer in reg.layers),
            outputs=tuple(tuple(tensors[t] for t in layer.outputs) for layer in reg.layers),
            variable_reads=reads, batch=batch, per_example_problem=problem,
            token_weights=weights, size_scale=size_scale, block_weights=tuple(tuple(
                token_weights.head_weights(reg, tensors[reg.output], tensors[t], batch)
                for t in terms) or None for terms in loss_spec.likelihood_blocks),
            penalties=tuple(tensors[t] for t in loss_spec.penalties))

    @property
    def batch_size(self):
        """B, the registration's batch: the leading axis of the arguments (the
        loss pass reads the mean over the batch against it, and example i is
        slice i of every argument); a Python int when static, else a scalar
        int32 tensor. A layer's operands have it too (a dilated convolution
        reads the input of SpaceToBatchND, not its ``block * B`` phases); the
        invariants check that they do."""
        return self.batch

    def output_gradients(self, cotangent: tf.Tensor | None = None):
        """Per layer, per use: the per-example gradient at the use's output.

        Without ``cotangent``: of each example's own loss term (the batch
        loss's gradient times B for a mean loss). With ``cotangent`` (shaped
        like the model output): ``cotangent_i^T dz_i / ds_i``."""
        flat = [t for layer in self.outputs for t in layer]
        if cotangent is None:
            # Seeding the backward pass with B scales every layer's gradient for
            # free (multiplying each gradient afterwards is a pass over each).
            seed = (tf.cast(self.batch_size, self.loss.dtype)
                    if self.registration.loss.reduction == "mean" else None)
            grads = tf.gradients(self.loss, flat, grad_ys=seed)
        else:  # (a float32 cotangent at a 16-bit output: mixed precision)
            grads = tf.gradients(self.model_output, flat,
                                 grad_ys=tf.cast(cotangent, self.model_output.dtype))
        grads = [tf.zeros_like(t) if g is None else g for t, g in zip(flat, grads)]
        out, k = [], 0
        for layer in self.outputs:
            out.append(tuple(grads[k:k + len(layer)]))
            k += len(layer)
        return tuple(out)


def _batch_of(flat_args, model_output):
    """B: the leading axis of the first argument that has one (the batch the
    loss pass reads the reduction against), else of the model output."""
    for t in [*flat_args, model_output]:
        if t is not None and t.shape.rank:
            return t.shape[0] if t.shape[0] is not None else tf.shape(t)[0]
    return 1


def _per_example_terms(terms, batch, model_output):
    """``([B] terms, "")``: each example's own loss terms summed, or ``(None,
    why not)``. Terms ``[B, ...]`` are summed over their other axes; a
    per-token loss flattened to ``[B*T]`` (its model output ``[B, T, ..., K]``)
    is reshaped to ``[B, T]`` first."""
    if terms.shape.rank == 0:
        return None, f"the per-example loss terms {terms.name} are a scalar"
    b = invariants.static_batch(batch)
    n = terms.shape[0] if terms.shape.rank is not None else None
    if terms.shape.rank is None or n is None or b is None:
        # a batch known at run time: example-major rows [B * k, ...] -> [B, -1]
        return tf.reduce_sum(tf.reshape(terms, [batch, -1]), axis=1), ""
    if n != b:
        inner = [1]
        for d in (model_output.shape[1:-1] if model_output is not None else []):
            if d is None:
                break
            inner.append(inner[-1] * d)
        if n % b or n // b not in inner:
            return None, (f"the per-example loss terms {terms.name} have leading axis {n}, "
                          f"neither the batch {b} nor the batch times the model output's positions")
        terms = tf.reshape(terms, [b, n // b, *terms.shape[1:]])
    if terms.shape.rank > 1:
        terms = tf.reduce_sum(terms, axis=list(range(1, terms.shape.rank)))
    return terms, ""


_CALLBACK_GRADIENT = "KfacGraphEagerPyFunc"


@tf.RegisterGradient(_CALLBACK_GRADIENT)
def _callback_gradient(op, *dys):
    """The gradient of a ``tf.py_function`` op in the re-imported graph:
    re-runs its Python function (found by the op's token) under a tape, once
    per backward pass. TensorFlow's own gradient instead pops a tape that the
    forward run stashed under the token, once: a second backward pass (the
    Fisher's samples or square-root columns, a Jacobian) finds none."""
    func = script_ops._py_funcs.get(op.get_attr("token").decode())  # noqa: SLF001
    fn = getattr(func, "_func", None)
    if fn is None:
        raise KfacGraphError(f"tf.py_function op {op.name!r} cannot be differentiated by "
                             "kfac_graph: its Python function is no longer registered")
    floats = [k for k, x in enumerate(op.inputs) if x.dtype.is_floating or x.dtype.is_complex]
    if not floats:
        return [None] * len(op.inputs)
    dys = [tf.zeros_like(y) if dy is None else dy for y, dy in zip(op.outputs, dys)]
    n = len(op.inputs)

    def vjp(*tensors):
        xs, cotangents = list(tensors[:n]), list(tensors[n:])
        with tf.GradientTape() as tape:
            tape.watch([xs[k] for k in floats])
            ys = tf.nest.flatten(fn(*xs))
        ys = [tf.convert_to_tensor(y) for y in ys]
        grads = tape.gradient(ys, [xs[k] for k in floats], output_gradients=cotangents)
        return [tf.zeros_like(xs[k]) if g is None else g for k, g in zip(floats, grads)]

    # the product is a callback too: differentiated again (the optimizer's
    # exact Fisher products), it re-runs as well
    with tf.compat.v1.get_default_graph().gradient_override_map(
            {"EagerPyFunc": _CALLBACK_GRADIENT}):
        grads = tf.py_function(vjp, list(op.inputs) + dys, [op.inputs[k].dtype for k in floats])
    out = [None] * n
    for k, g in zip(floats, grads):
        g.set_shape(op.inputs[k].shape)
        out[k] = g
    return out


def graph_inputs(args) -> list:
    """The leaves of ``args`` that tracing makes inputs of the graph, in
    order: tensors, variables and arrays. Any other leaf (a ``training``
    flag, a scale, None, a string, the Keras model or a function) is a
    constant of the trace, as ``tf.function`` makes it, with no placeholder."""
    return [a for a in tf.nest.flatten(args) if not is_trace_constant(a)]


def is_trace_constant(value) -> bool:
    """Whether ``tf.function`` traces ``value`` as a constant (``graph_inputs``)."""
    return not (tf.is_tensor(value) or isinstance(value, (np.ndarray, np.generic, tf.Variable)))


def _check_replaceable(reg: Registration, node: str, variable) -> None:
    """A one-line ``KfacGraphError`` when ``variable`` is read inside an op
    that takes its handle (a loop the pass did not unroll): gradients with
    respect to our replacement of its reads would miss those reads."""
    readers = reg.handle_readers.get(node, ())
    if not readers:
        return
    reasons = [layer.reason for layer in reg.layers if any(v is variable for v in layer.variables)
               and repr(readers[0]) in layer.reason]
    raise KfacGraphError(
        f"variable {invariants.variable_name(variable)}: its per-example gradients cannot be "
        "computed: " + (reasons[0] if reasons else
                        f"it is read inside op {readers[0]!r}, whose reads of it cannot be replaced"))




def _without_mapped_placeholders(graph_def, input_map):
    """The graph as it is imported: without the placeholders ``input_map``
    replaces (left in, they would be dead ``Placeholder`` ops, which XLA
    refuses to compile), and without custom-gradient markers.

    ``tf.custom_gradient`` (Keras's swish/silu among others) marks its output
    ``IdentityN`` with a gradient registered in Python whose closure holds
    tensors of the traced graph, which a re-imported graph cannot reach
    ("out of scope"). Unmarked, the ``IdentityN`` passes gradients through
    to the forward ops it follows, so the re-run differentiates the forward
    computation itself: the same gradient wherever the custom one is the
    forward's derivative (swish, silu, numerically stable forms), not a
    surrogate such as a straight-through estimator: the pass marks those it
    can tell to replay their own gradient function instead
    (``passes.custom_gradients``, ``passes.gradient_replay``), a marker this
    leaves in place. A colocation with a removed placeholder (Keras 2's
    embedding lookup sits with its table's handle) is dropped
    (``inline.drop_lost_colocations``): the import refuses an unknown node."""
    mapped = {name.split(":")[0] for name in input_map}
    out = tf.compat.v1.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    for node in graph_def.node:
        if node.op == "Placeholder" and node.name in mapped:
            continue
        out.node.add().CopyFrom(node)
    inline.drop_lost_colocations(out)
    return custom_gradients.strip_markers(out)


def layer_operands(registration: Registration, taps: LayerTaps, sources) -> list:
    """Per layer, per use: ``(a, [g per source])`` as the kind's rules and
    blocks read them (``LayerKind.operands``); ``None`` for generic layers.

    ``sources``: a list over sources of ``taps.output_gradients(...)``
    results (one backward pass each). Floating operands come in the layer's
    variable dtype (``in_variable_dtype``)."""
    out = []
    for index, layer in enumerate(registration.layers):
        record = layers.kind(layer.kind)
        if record.operands is None:
            out.append(None)
            continue
        uses = []
        for use in range(layer.uses):
            tensors = in_variable_dtype(layer, taps.inputs[index][use])
            grads = in_variable_dtype(layer, [grads[index][use] for grads in sources])
            # rows [k B, ..] whose k is known at run time only: the kind reads
            # them by the batch (``kind.split_rows``)
            run_time = "run_time_rows" in layer.use_attrs[use]
            uses.append(record.operands(layer, use, tensors, grads,
                                        **({"batch": taps.batch_size} if run_time else {})))
        out.append(uses)
    return out


def in_variable_dtype(layer, tensors) -> list:
    """``tensors`` with each floating one cast to the dtype of ``layer``'s
    variables (others, such as an embedding's ids, as they are).

    Mixed precision: the variables are float32, each read is cast to the
    compute dtype (float16, bfloat16) before the op, so the layer's input
    and output gradient are 16-bit. Their values are exact in float32, so
    the rules contract them in the variables' dtype, which is the dtype
    their per-example gradients and the Fisher statistics must have; the
    batch gradient's own contraction runs in 16 bits (see README)."""
    dtype = tf.as_dtype(layer.variables[0].dtype)
    if not dtype.is_floating:
        return list(tensors)
    return [tf.cast(t, dtype) if t.dtype.is_floating and t.dtype != dtype else t
            for t in tensors]


def _handle(variable):
    """``variable.handle``; for a variable a ``tf.distribute`` strategy
    mirrors, read in the strategy's cross-replica context (inside
    ``strategy.scope()``, not in ``strategy.run``), its first copy's: all
    copies hold the same value there, and an update assigns them all."""
    try:
        return variable.handle
    except ValueError:
        values = getattr(variable, "values", None)
        if not values:
            raise
        return values[0].handle
