"""``kg.auto_register``: wrap a loss function so the pass can register it.

The wrapped function still returns the loss when called. ``registration(*args)``
traces it (one trace per input signature, as ``tf.function`` does), runs the
pass, and caches the ``Registration`` for that signature.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import networkx as nx
import tensorflow as tf
from absl import logging
from tensorflow.python.autograph.core import ag_ctx

import passes
import passes.keras_reach
import passes.loss_bounds
import passes.match_loss
import passes.unroll
from kfac_graph import options
from kfac_graph.gather_reads import split_gathers
from kfac_graph.registration import GraphVariable, Layer, LossSpec, Registration


class RegisteredFunction:
    """A loss function known to kfac_graph. Options: ``loss`` (a loss kind,
    ``"categorical"``, ``"bernoulli"`` or ``"normal"``, used instead of what
    the pass reads from the graph); ``max_loop_iterations`` (the pass unrolls
    a loop with a static trip count up to this many iterations, so the
    layers inside it are found; a longer loop keeps its variables generic)."""

    def __init__(self, fn: Callable, loss: str | None = None,
                 max_loop_iterations: int = passes.unroll.DEFAULT_MAX_ITERATIONS):
        functools.update_wrapper(self, fn)
        if "__name__" not in vars(self):  # a functools.partial or a callable object
            inner = getattr(fn, "func", fn)
            self.__name__ = getattr(inner, "__name__", type(inner).__name__)
        self.python_function = fn
        self.loss_kind = loss
        self.max_loop_iterations = options.check(
            "kg.auto_register", "max_loop_iterations", max_loop_iterations, options.Integer(0))
        self._tf_function = fn if hasattr(fn, "get_concrete_function") else tf.function(fn)
        self._cache: dict[Any, tuple[Any, Registration]] = {}
        self._own: dict = {}  # traces of its own, by the arguments (_concrete_here)
        # as tf.function converts: partials, callable objects and methods too,
        # and a function AutoGraph cannot convert runs as it is; converted even
        # where the caller's trace has AutoGraph off (the K-FAC step's)
        self._inline = tf.__internal__.autograph.tf_convert(
            getattr(fn, "python_function", fn), ag_ctx.ControlStatusCtx(ag_ctx.Status.ENABLED))
        # Functions derived from a registration (per-example gradients,
        # estimator steps), built once per registration by their modules.
        self.derived: dict[Any, Any] = {}

    def __call__(self, *args, **kwargs):
        return self.python_function(*args, **kwargs)

    @property
    def tf_function(self):
        """The ``tf.function`` the registration traces."""
        return self._tf_function

    def _concrete_here(self, args):
        """``(concrete function, replica reads)`` of a trace made at these
        arguments' own sizes inside ``one_device``'s probe. ``tf.function``
        serves a call from any trace general enough for it: a trace at
        unknown sizes (where the pass reads a mean over such a size as a
        run-time divisor, not the constant it is here), or the user's own
        earlier trace, made outside the probe, whose reads across replicas
        are unknown. Then the function is traced again, by a ``tf.function``
        of its own kept for these arguments."""
        concrete, reads = _concrete(self._tf_function, args, self.__name__)
        signature = getattr(self._tf_function, "input_signature", None)
        python = getattr(self._tf_function, "python_function", None)
        if python is None or reads is not None and (
                signature is not None or _traced_at(concrete, args)):
            return concrete, reads or ()
        key = _arguments_key(args)
        if key not in self._own:
            own = tf.function(python, input_signature=signature)
            self._own[key] = _concrete(own, args, self.__name__)
        return self._own[key]

    def inline(self, *args):
        """The loss traced into the caller's graph, converted by AutoGraph as
        ``tf.function`` converts it, but not as a nested function call. A
        gradient taken through a nested call returns an embedding's
        ``IndexedSlices`` from that call, and XLA then compiles the caller for
        the call's argument values: it recompiled a ``jit_compile=True`` K-FAC
        step on every batch."""
        return self._inline(*args)

    def concrete_function(self, *args):
        return self._concrete_here(args)[0]

    @tf.autograph.experimental.do_not_convert  # the pass is plain Python, also when traced
    def registration(self, *args, quiet: bool = False) -> Registration:
        """The registration for these arguments' input signature (cached);
        ``quiet``: a new one logs nothing (``registration_from_pass``)."""
        concrete, reads = self._concrete_here(args)
        key = id(concrete)
        cached = self._cache.get(key)
        if cached is None or cached[0] is not concrete:
            traced = passes.frontends.from_concrete_function(
                concrete, name=self.__name__,
                reached=passes.keras_reach.reached(self.python_function), replica_reads=reads)
            cached = (concrete, registration_from_pass(
                passes.run(traced, self.loss_kind, self.max_loop_iterations),
                warn=not quiet))
            self._cache[key] = cached
        return cached[1]


def auto_register(fn: Callable | None = None, *, loss: str | None = None,
                  max_loop_iterations: int = passes.unroll.DEFAULT_MAX_ITERATIONS):
    """``@kg.auto_register`` or ``@kg.auto_register(loss="categorical")``
    (options: ``RegisteredFunction``)."""
    if fn is None:
        return lambda f: RegisteredFunction(f, loss=loss, max_loop_iterations=max_loop_iterations)
    return RegisteredFunction(fn, loss=loss, max_loop_iterations=max_loop_iterations)


def register_saved_model(path: str, function: str, *args, loss: str | None = None,
                         max_loop_iterations: int = passes.unroll.DEFAULT_MAX_ITERATIONS
                         ) -> Registration:
    """The registration of the saved function ``function`` of a SavedModel."""
    traced = passes.load_saved_model(path, function, args or None)
    return registration_from_pass(passes.run(traced, loss, max_loop_iterations))


def register_graph_def(graph_def, output: str, arguments=(), loss: str | None = None,
                       max_loop_iterations: int = passes.unroll.DEFAULT_MAX_ITERATIONS
                       ) -> Registration:
    """The registration of a GraphDef (file or proto) whose loss is ``output``."""
    traced = passes.load_graph_def(graph_def, output, arguments)
    return registration_from_pass(passes.run(traced, loss, max_loop_iterations))


def registration_from_pass(result: passes.PassResult, warn: bool = True) -> Registration:
    """The pass's result as a ``Registration``; ``warn``: log ``_warn_about``'s notes."""
    traced = result.traced

    def variable(key):
        obj = traced.objects.get(key)
        if obj is not None:
            return user_variable(obj)
        info = traced.variables[key]
        return GraphVariable(info.name, info.shape, info.dtype)

    layers = tuple(
        Layer(name=m.name, kind=m.kind, variables=tuple(variable(k) for k in m.variables),
              uses=m.num_uses, inputs=tuple(u.inputs for u in m.uses),
              outputs=tuple(u.output for u in m.uses),
              use_attrs=tuple(dict(u.attrs) for u in m.uses),
              ops=tuple(u.ops for u in m.uses), reason=m.reason)
        for m in result.layers)
    if warn:
        _warn_about(layers, result)
    lm = result.loss
    read = [] if lm.kind in passes.match_loss.KINDS else [(lm.terms, lm.terms_coefficient)]
    nonnegative = passes.loss_bounds.nonnegative(result.graph, [*read, *lm.extras,
                                                                *lm.penalties])
    loss = LossSpec(lm.kind, lm.reduction, lm.output, lm.targets, lm.scale, lm.weights,
                    lm.divisors, lm.sizes, lm.reason, lm.penalties, lm.summed_penalties, lm.blocks,
                    nonnegative, lm.likelihood_blocks)
    placeholders = {node: user_variable(traced.objects[key])
                    for node, key in traced.placeholder_variables.items() if key in traced.objects}
    # every table's reads replaceable: a generic layer's (its rule) and a
    # registered one's (DP-SGD's reweighting replaces every variable's reads)
    graph_def = split_gathers(traced.graph_def, set(traced.placeholder_variables))
    reads, handles = {}, {}
    on_path = nx.ancestors(result.graph, passes.ir.split_tensor(result.graph.graph["output"])[0])
    for node in graph_def.node:
        if node.op == "ReadVariableOp" and node.input and node.input[0] in placeholders:
            reads.setdefault(node.input[0], []).append(node.name)
        elif node.op not in _HANDLE_ONLY and node.name in on_path:
            for t in node.input:
                if t in placeholders:
                    handles.setdefault(t, []).append(node.name)
    return Registration(layers, loss, graph_def, traced.arguments, traced.output,
                        result.graph, dict(result.timings), placeholders,
                        {k: tuple(v) for k, v in reads.items()}, lm.terms, lm.terms_coefficient,
                        {k: tuple(v) for k, v in handles.items()}, result.coupling,
                        lm.extras, tuple((variable(k), traced.constraints[k])
                                         for m in result.layers for k in m.variables
                                         if k in traced.constraints),
                        dict(traced.resources), result.batch_statistics,
                        result.padded_to_longest, traced.replica_reads,
                        {terms: out for terms, out, _ in lm.heads if terms and out})


def _warn_about(layers, result):
    """Logs what a user of this registration should know: generic variables,
    examples coupled by the loss, a loss read without per-example terms."""
    generic = [layer.name for layer in layers if layer.kind == "generic"]
    if generic:
        logging.warning("kfac_graph: %d variable(s) are registered as generic (why: "
                        "reg.summary()): %s", len(generic), ", ".join(generic))
    lm = result.loss
    if result.coupling:
        logging.warning("kfac_graph: the loss couples the examples at op %s (batch statistics, "
                        "two tensors of examples combined, the batch reordered or mixed, or "
                        "a custom gradient whose function reads across the examples): "
                        "a per-example gradient is that "
                        "example's share of the batch gradient, not a batch-of-one gradient",
                        ", ".join(repr(op) for op in result.coupling[:3]))
    if lm.terms is None and lm.reason:
        logging.warning("kfac_graph: the loss is named %r, but the pass read no per-example "
                        "terms (%s): a per-example gradient is that example's share of the "
                        "batch gradient (B times it for a mean), its own gradient only where "
                        "the loss is a mean or sum of terms of one example each",
                        lm.kind, lm.reason)
    if lm.kind == "opaque":
        logging.warning("kfac_graph: the loss is read as opaque per-example terms %s (%s): "
                        "per-example gradients work; a Fisher needs a loss the pass reads",
                        lm.terms, lm.reason)


# ops that take a variable's handle without reading its value
_HANDLE_ONLY = frozenset({"VariableShape", "NoOp"})


def user_variable(variable):
    """The variable as its user made it: under ``tf.distribute`` a trace
    captures one replica's copy of a mirrored variable; the mirrored variable
    (which reads as the current replica's copy) is what the user holds."""
    container = getattr(variable, "_distributed_container", None)
    if container is None:  # resource variables keep it on their handle
        container = getattr(getattr(variable, "handle", None), "_distributed_container", None)
    return variable if container is None else container()


def _traced_at(concrete, args) -> bool:
    """Whether ``concrete`` was traced at the sizes of ``args`` (``tf.function``
    serves a call from any trace general enough for it)."""
    specs = tf.nest.flatten(concrete.structured_input_signature[0])
    given = tf.nest.flatten(args)
    if len(specs) != len(given):
        return True
    return all(s.shape.as_list() == tf.TensorShape(a.shape).as_list()
               for s, a in zip(specs, given)
               if isinstance(s, tf.TensorSpec) and s.shape.rank is not None
               and hasattr(a, "shape"))


def _arguments_key(args) -> tuple:
    """Tensors and arrays by shape and dtype, Python values by value, other
    objects (a model, a function) by identity."""
    def key(a):
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            return ("tensor", tuple(tf.TensorShape(a.shape).as_list()), tf.as_dtype(a.dtype).name)
        if a is None or isinstance(a, (bool, int, float, str)):
            return (type(a).__name__, a)
        return ("object", id(a))
    return tuple(key(a) for a in tf.nest.flatten(args))


def _concrete(tf_function, args, name):
    """``(concrete function, where it read across replicas)``, traced as one
    device (Keras's losses are not divided by the replicas: ``passes.one_device``)."""
    passes.frontends.check_dense_arguments(args, name)
    count = getattr(tf_function, "experimental_get_tracing_count", None)
    before = count() if count is not None else None
    try:
        with passes.frontends.one_device() as probe:
            concrete = tf_function.get_concrete_function(*args)
    except (TypeError, ValueError) as e:
        raise passes.TraceError(f"could not trace {name}: {passes.frontends.error_line(e)}") from e
    traced = None if count is None else count() != before
    return concrete, passes.frontends.replica_reads(concrete, probe, traced)

