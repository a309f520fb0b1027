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
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import tensorflow as tf

from kfac_graph import layers
from kfac_graph.registration import Registration


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
        flat_args = tf.nest.flatten(args)
        if len(flat_args) != len(reg.arguments):
            raise ValueError(f"expected {len(reg.arguments)} argument tensors, got {len(flat_args)}")
        # tf.identity places each argument in the current graph (a tf.cond
        # branch reads the enclosing function's tensors through it).
        input_map = {f"{name}:0": tf.identity(a) for name, a in zip(reg.arguments, flat_args)}
        graph = tf.compat.v1.get_default_graph()
        for node, variable in reg.variable_placeholders.items():
            input_map[f"{node}:0"] = graph.capture(variable.handle)
        reads = {}
        wanted = {v.ref() for v in read_variables}
        for node, variable in reg.variable_placeholders.items():
            if variable.ref() in wanted:
                value = tf.identity(variable.read_value())
                reads[variable.ref()] = value
                for read in reg.variable_reads.get(node, ()):
                    input_map[f"{read}:0"] = value

        names = [reg.output]
        loss_spec = reg.loss
        extra = [loss_spec.output, loss_spec.targets, reg.per_example_loss]
        names += [t for t in extra if t]
        for layer in reg.layers:
            for use_inputs, output in zip(layer.inputs, layer.outputs):
                names += list(use_inputs) + [output]
        unique = list(dict.fromkeys(names))
        tensors = dict(zip(unique, tf.graph_util.import_graph_def(
            _without_mapped_placeholders(reg.graph_def, input_map), input_map=input_map,
            return_elements=unique, name="kfac_graph")))
        per_example = tensors.get(reg.per_example_loss) if reg.per_example_loss else None
        if per_example is not None:
            if per_example.shape.rank and per_example.shape.rank > 1:
                per_example = tf.reduce_sum(per_example, axis=list(range(1, per_example.shape.rank)))
            per_example = per_example * tf.cast(reg.per_example_coefficient, per_example.dtype)
        return cls(
            registration=reg, loss=tensors[reg.output],
            model_output=tensors.get(loss_spec.output) if loss_spec.output else None,
            targets=tensors.get(loss_spec.targets) if loss_spec.targets else None,
            per_example_loss=per_example,
            inputs=tuple(tuple(tuple(tensors[t] for t in use) for use in layer.inputs)
                         for layer in reg.layers),
            outputs=tuple(tuple(tensors[t] for t in layer.outputs) for layer in reg.layers),
            variable_reads=reads)

    @property
    def batch_size(self) -> tf.Tensor:
        for layer in self.inputs:
            for use in layer:
                if use and use[0].shape.rank:
                    return tf.shape(use[0])[0]
        return tf.shape(self.model_output)[0]

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
        else:
            grads = tf.gradients(self.model_output, flat, grad_ys=cotangent)
        grads = [tf.zeros_like(t) if g is None else g for t, g in zip(flat, grads)]
        out, k = [], 0
        for layer in self.outputs:
            out.append(tuple(grads[k:k + len(layer)]))
            k += len(layer)
        return tuple(out)


def _without_mapped_placeholders(graph_def, input_map):
    """The graph without the placeholders ``input_map`` replaces (left in,
    they would be dead ``Placeholder`` ops, which XLA refuses to compile)."""
    mapped = {name.split(":")[0] for name in input_map}
    out = tf.compat.v1.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    out.node.extend(n for n in graph_def.node if not (n.op == "Placeholder" and n.name in mapped))
    return out


def layer_operands(registration: Registration, taps: LayerTaps, sources) -> list:
    """Per layer, per use: ``(a, [g per source])`` as the kind's rules and
    blocks read them (``LayerKind.operands``); ``None`` for generic layers.

    ``sources``: a list over sources of ``taps.output_gradients(...)``
    results (one backward pass each)."""
    out = []
    for index, layer in enumerate(registration.layers):
        record = layers.kind(layer.kind)
        if record.operands is None:
            out.append(None)
            continue
        out.append([record.operands(layer, use, taps.inputs[index][use],
                                    [grads[index][use] for grads in sources])
                    for use in range(layer.uses)])
    return out
