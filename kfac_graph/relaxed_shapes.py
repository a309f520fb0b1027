"""A step traced once for the batches of a new shape, not once per shape.

A ``tf.function`` traces again for every new shape of its tensor
arguments. For a K-FAC or DP-SGD step that is the whole cold start again
(the loss, its registration, every rule and block): paid by the last,
partial batch of an epoch and by every new sequence length. ``Relaxed``
traces the first batch at its exact shapes (static sizes: the fastest
step, loops unrolled), and every batch of another shape through one more
function whose signature leaves unknown (``None``) each size that
differed from the first batch's; a later batch that differs in another
size widens it, traced once more. Keras's ``fit`` does the same
(``reduce_retracing``).

The relaxed step must compute what a trace at the batch's own shapes
would. ``check(first, specs)`` (the first batch's signature, the widened
one) says whether it does (None) or why not (a line;
``registration_problem`` registers the loss at the unknown sizes and
compares). Where it does not, that batch is traced at its own shapes, as
before, and an absl warning says why, once per signature. Arguments other
than dense tensors, arrays and a strategy's per-replica values, and keyword
arguments, always go to the exact function; so does a batch whose relaxed
step stops while tracing (the warning names the error). Per-replica values
(``KFACModel.fit``'s batches under ``tf.distribute``) are signed by their
``TypeSpec``, whose components, one replica's share each, widen alike.
"""
from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf
from absl import logging

from passes.errors import KfacGraphError


def _signed(leaf) -> bool:
    """Whether a leaf of the arguments can take a relaxed signature: a dense
    tensor, an array, or a strategy's per-replica values of dense tensors."""
    if isinstance(leaf, tf.distribute.DistributedValues):
        return all(isinstance(t, tf.Tensor) for t in leaf.values)
    return isinstance(leaf, (tf.Tensor, np.ndarray))


def _spec(leaf):
    if isinstance(leaf, tf.distribute.DistributedValues):
        return tf.type_spec_from_value(leaf)  # a PerReplicaSpec: one TensorSpec per replica
    return tf.TensorSpec(leaf.shape, tf.as_dtype(leaf.dtype))


def signature(args):
    """``args`` with each leaf a ``tf.TensorSpec`` of its shape and dtype (per-replica
    values: their ``TypeSpec``), or None if a leaf is none of those (``_signed``)."""
    leaves = tf.nest.flatten(args)
    if not all(_signed(a) for a in leaves):
        return None
    return tf.nest.pack_sequence_as(args, [_spec(a) for a in leaves])


def _wider(a, b):
    """The most specific spec both fit, or None (another rank, dtype or type)."""
    if not isinstance(a, tf.TensorSpec) or not isinstance(b, tf.TensorSpec):
        return a.most_specific_common_supertype([b]) if type(a) is type(b) else None
    if a.dtype != b.dtype or a.shape.rank is None or a.shape.rank != b.shape.rank:
        return None
    return tf.TensorSpec(a.shape.most_specific_compatible_shape(b.shape), a.dtype)


def widen(old, new):
    """The most specific signature both fit (a size that differs is None), or
    None where their structures, ranks or dtypes differ."""
    try:
        tf.nest.assert_same_structure(old, new)
    except (ValueError, TypeError):
        return None
    out = [_wider(a, b) for a, b in zip(tf.nest.flatten(old), tf.nest.flatten(new))]
    return None if any(s is None for s in out) else tf.nest.pack_sequence_as(old, out)


def _fits(spec, sig) -> bool:
    return all(s.is_compatible_with(x) if isinstance(s, tf.TensorSpec) else x.is_subtype_of(s)
               for s, x in zip(tf.nest.flatten(spec), tf.nest.flatten(sig)))


def _tensor_specs(sig):
    """The dense ``TensorSpec``s of a signature (a per-replica spec's, one per replica)."""
    return tf.nest.flatten(sig, expand_composites=True)


def _key(sig):
    return tuple((tuple(s.shape.as_list()), s.dtype.name) for s in _tensor_specs(sig))


def _leaf_key(leaf):
    if isinstance(leaf, tf.distribute.DistributedValues):
        return tuple(_leaf_key(t) for t in leaf.values)
    return tuple(leaf.shape), tf.as_dtype(leaf.dtype).name


def _unknown(spec) -> str:
    sizes = [f"axis {i} of argument {k}" for k, s in enumerate(_tensor_specs(spec))
             for i, d in enumerate(s.shape.as_list()) if d is None]
    return ", ".join(sizes) or "no size"


class Relaxed:
    """``function`` as a ``tf.function`` (``options``) traced once at the first
    batch's shapes and once for the others (module docstring). ``owner``
    names the step in the warning."""

    def __init__(self, function, check, owner: str, **options):
        self._function, self._check, self._owner, self._options = function, check, owner, options
        self.exact = tf.function(function, **options)
        self.relaxed = None  # (signature, tf.function)
        self._first = None
        self._routes = {}  # shapes and dtypes -> the function that runs them
        self._traced = [self.exact]  # and every relaxed one (a widened one replaces the last)
        self._refused = {}  # key of a widened signature -> why
        self._warned = set()

    def __call__(self, *args, **kwargs):
        return self._route(args, kwargs)(*args, **kwargs)

    def get_concrete_function(self, *args, **kwargs):
        """The concrete function a call with these arguments runs."""
        return self._route(args, kwargs).get_concrete_function(*args, **kwargs)

    def _route(self, args, kwargs):
        """The ``tf.function`` for these arguments (made, and checked, here;
        remembered by their shapes and dtypes)."""
        leaves = tf.nest.flatten(args)
        if kwargs or not all(_signed(a) for a in leaves):
            return self.exact
        key = tuple(_leaf_key(a) for a in leaves)
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = self._new_route(signature(args), key)
        return route

    def _new_route(self, sig, key):
        if self._first is None:
            self._first = sig
            return self.exact
        if self.relaxed is not None and _fits(self.relaxed[0], sig):
            return self.relaxed[1]
        wider = widen(self.relaxed[0] if self.relaxed is not None else self._first, sig)
        why = "their structure, ranks or dtypes differ" if wider is None else self._why(wider)
        if why is None:
            try:  # (a step that cannot be traced there runs as before, at known sizes)
                # (positional arguments alone: a signature fits any defaults they follow)
                function = tf.function(lambda *a: self._function(*a),
                                       input_signature=list(wider), **self._options)
                function.get_concrete_function(*wider)
            except (KfacGraphError, ValueError, TypeError, NotImplementedError) as error:
                why = f"tracing there stops: {type(error).__name__}: " + (
                    str(error).strip().splitlines() or [""])[0]
            else:
                self.relaxed = (wider, function)
                self._traced.append(function)
                # routes to an earlier relaxed function: to this wider one
                self._routes = {k: function if r is not self.exact else r
                                for k, r in self._routes.items()}
                return function
        refused = _key(wider) if wider is not None else key
        self._refused[refused] = why
        if refused not in self._warned:
            self._warned.add(refused)
            logging.warning("%s: a batch of shapes %s traces the step again at its own shapes, "
                            "not once with %s unknown: %s", self._owner, list(key),
                            "the sizes" if wider is None else _unknown(wider), why)
        return self.exact

    def _why(self, wider):
        known = self._refused.get(_key(wider))
        return known if known is not None else self._check(self._first, wider)

    def takes_exact(self, *args) -> bool:
        """Whether a call with these arguments runs the exact function (traced
        at their own shapes)."""
        return self._route(args, {}) is self.exact

    def experimental_get_tracing_count(self) -> int:
        """Traces so far, of the exact function and the relaxed ones."""
        return sum(f.experimental_get_tracing_count() for f in self._traced)


def _share(spec):
    """A per-replica spec's shares widened to one ``TensorSpec``."""
    parts = _tensor_specs(spec)
    return functools.reduce(_wider, parts[1:], parts[0])


def one_share(specs):
    """``specs`` with each per-replica spec cut to one replica's share (its
    shares widened to one): what a loss traced inside ``strategy.run`` sees."""
    return tf.nest.map_structure(
        lambda s: s if isinstance(s, tf.TensorSpec) else _share(s), specs)


def replica_problem(fn, registration, specs, strategy) -> str | None:
    """``registration_problem`` for a step split over ``strategy``'s
    replicas: ``registration`` is one replica's (``kg.KFAC`` registers the
    loss on one replica's share, under the strategy's scope), so ``specs``,
    the whole batch's signature, are cut to one replica's share (a known
    batch ``b`` to ``b / n``; an unknown one stays unknown; per-replica
    values' specs hold the shares, which widen to one)."""
    n = strategy.num_replicas_in_sync
    shares = []
    for spec in tf.nest.flatten(specs):
        if not isinstance(spec, tf.TensorSpec):
            shares.append(_share(spec))
            continue
        batch = spec.shape[0] if spec.shape.rank else None
        if batch is not None and batch % n:
            return f"a batch of {batch} examples does not split evenly over {n} replicas"
        shape = spec.shape if batch is None else [batch // n] + spec.shape.as_list()[1:]
        shares.append(tf.TensorSpec(shape, spec.dtype))
    with strategy.scope():
        return registration_problem(fn, registration, tf.nest.pack_sequence_as(specs, shares))


def registration_problem(fn, registration, specs, curvature: bool = True) -> str | None:
    """None if ``fn`` registered at ``specs`` has ``registration``'s layers
    (kinds and variables) and variables, in its order (callers' lists align
    with it), and, with ``curvature``, the attributes its blocks read (up to
    sizes left unknown) and its loss's reading (kind, reduction, scale,
    weights, divisors and sizes): a step traced there then computes, and
    folds into statistics shared with the other traces, what one at known
    sizes does. Else why not, in one line: a loop over an axis left unknown
    is not unrolled (its cell's variables are generic). A mean over it
    divides by its size at run time but by a constant ``scale`` at known
    sizes: its ``1/T`` is read as a factor of the curvature's scale at run
    time (``LossSpec.size_scaled``), not of the tokens' weights, so the
    factors' moving averages read alike. Without ``curvature`` (DP-SGD:
    per-example gradients are exact at any size, and nothing is kept across
    steps) the layers' kinds and the variables' order alone are compared, so that no layer
    falls to the generic rule and the gradients come in the same order."""
    try:  # (quiet; the step traced there finds it, a registration at known sizes never does)
        other = fn.registration(*specs, quiet=True)
    except KfacGraphError as error:
        return str(error).splitlines()[0]
    kinds = {id(v): layer.kind for layer in registration.layers for v in layer.variables}
    for layer in other.layers:
        for v in layer.variables:
            if kinds.get(id(v)) != layer.kind:
                return (f"{v.name} registers as {layer.kind} there, not {kinds.get(id(v))}"
                        + (f" ({layer.reason})" if layer.reason else ""))
    if [id(v) for v in other.variables] != [id(v) for v in registration.variables]:
        return "its variables come in another order there"
    if not curvature:
        return None
    if len(other.layers) != len(registration.layers):
        return "its layers group the variables otherwise there"
    for old, new in zip(registration.layers, other.layers):
        if [id(v) for v in old.variables] != [id(v) for v in new.variables]:
            return f"layer {old.name!r} holds other variables there"
        for a, b in [(old.attrs, new.attrs), *zip(old.use_attrs, new.use_attrs)]:
            a, b = _block_attrs(a), _block_attrs(b)
            if not _agree(a, b):
                return f"layer {old.name!r} is read otherwise there ({_first_difference(a, b)})"
    old, new = registration.loss, other.loss
    if (old.kind, old.reduction) != (new.kind, new.reduction):
        return f"its loss reads as {new.kind} ({new.reduction}), not {old.kind} ({old.reduction})"
    if not _agree(old.blocks, new.blocks) or [bool(t) for t in old.likelihood_blocks] != [
            bool(t) for t in new.likelihood_blocks]:
        return (f"its loss's Hessian is formed in blocks {new.blocks or 'whole'} there, not "
                f"{old.blocks or 'whole'}")
    if (len(old.weights), len(old.divisors)) != (len(new.weights), len(new.divisors)):
        return (f"its loss is weighted by {', '.join(new.weights + new.divisors) or 'no data'} "
                f"there, not by {', '.join(old.weights + old.divisors) or 'no data'}")
    if new.size_scaled and not old.size_scaled:
        return None  # (1/T: a constant of scale, or read at run time: the same curvature)
    if old.kind == "ggn" and old.scale == new.scale:
        return None  # (its Hessian is the per-example loss's, 1/T and all)
    if (old.scale, len(old.sizes)) != (new.scale, len(new.sizes)):
        return (f"its loss reads with scale {new.scale:g} and divides by {len(new.sizes)} "
                f"sizes there, not {old.scale:g} and {len(old.sizes)}")
    return None


# How a use's op is read: the layer rules read these from the registration the
# step was traced with (a Keras EinsumDense is a BatchMatMulV2 at known sizes,
# an Einsum at unknown ones); the blocks, made once, read the others.
_OP_READING = frozenset({"op", "equation", "transpose_a", "transpose_b", "adj_x", "adj_y",
                         "input_shape", "output_shape", "operand_shapes", "input_perm",
                         "output_perm", "grad_perm", "batch_axis", "run_time_rows"})


def _block_attrs(attrs) -> dict:
    return {k: v for k, v in dict(attrs).items() if k not in _OP_READING}


def _agree(a, b) -> bool:
    """Equal, where ``b`` may have None for any size of ``a``."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_agree(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_agree(x, y) for x, y in zip(a, b))
    if b is None and (a is None or isinstance(a, (int, np.integer))):
        return True
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    return bool(a == b)


def _first_difference(a, b) -> str:
    for k in sorted(set(a) | set(b)):
        if not _agree(a.get(k), b.get(k)):
            return f"{k}: {a.get(k)!r} against {b.get(k)!r}"
    return "attributes differ"


def kinds_check(fn, loss_args=lambda specs: specs):
    """``Relaxed``'s check for a step whose results are exact at any size and
    keep nothing across calls (DP-SGD, per-example gradients):
    ``registration_problem`` without ``curvature``, against ``fn``'s
    registration at the first signature. ``loss_args``: the loss's
    arguments among the step's."""
    return lambda first, specs: registration_problem(
        fn, fn.registration(*loss_args(first)), loss_args(specs), curvature=False)
