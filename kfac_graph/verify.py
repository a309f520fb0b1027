"""``kg.verify(fn, *args)``: check the runtime against references computed
another way, layer by layer, on the user's own model and data.

Per registered layer (``verify_report.VerifyReport`` holds the rows):

1. ``mean`` (or ``sum``): the per-example gradients (``kg.per_example_gradients``)
   averaged over the batch (summed, for a sum loss) equal the batch gradient
   of ``fn`` by ``tf.GradientTape`` (a sum's plus ``(B - 1) dR`` of a weight
   penalty added once: each example's gradient holds ``dR``);
2. ``one-example``: for ``examples`` sampled indices ``i``, entry ``i`` equals
   the gradient of ``fn`` on the batch of one ``args[i:i+1]`` (every argument
   whose axis 0 is the batch is sliced); for a loss with data weights, times
   the ratio of the example's token weights in the batch to those on its own
   (``verify_weights``). Skipped when a layer couples the examples (batch
   normalisation in training mode) or the loss reads statistics of the
   batch's data without data weights (``verify_notes``): then no layer's entry
   is a batch-of-one gradient, each is the example's contribution; and when
   the loss draws random numbers (dropout), as a batch of one draws its own
   (``verify_draws``: there check 1 compares one draw, or is skipped);
3. ``norms``: the rule's per-example norms equal the norms of the layer's
   per-example gradients; and, for the whole model,
   ``kg.per_example_gradient_norms`` equals the norm of all of them;
4. ``fisher`` (``estimation_mode="exact"`` or ``"empirical"``, opt-in): the
   layer's full Fisher block (``approximations={name: "full"}``) against the
   quadratic form of the batch's exact (or empirical) Fisher, ``v.F v`` with
   ``F = (1/B) sum_i J_i^T F_i J_i``, on ``directions`` random ``v``
   supported on the layer, from double-backward Jacobian-vector products.
   Only where the full block is exact: no coupling, a model output
   ``[B, K]``, at most ``fisher_max_params`` parameters.

Errors are ``|got - reference| / |reference|`` over the layer's variables;
a check passes when ``|got - reference| <= atol + rtol * |reference|``
(defaults by dtype: float64 1e-8, float32 1e-3, 16-bit 5e-2; the loosest of
the variables', the loss's, the layers' outputs' (the compute dtype under
mixed precision) and any narrower float the loss computes in on the way,
which a note names). Every run of ``fn`` starts from the variables' values
at the call, and they are restored after the checks (``verify_state``).
"""
from __future__ import annotations

import time

import numpy as np
import tensorflow as tf

from kfac_graph import layers
from kfac_graph import verify_draws, verify_fisher, verify_notes, verify_weights
from kfac_graph.verify_state import SavedState
from kfac_graph.auto_register import RegisteredFunction, auto_register
from kfac_graph.normaliser_coupling import coupling_layers
from kfac_graph.per_example.gradients import (model_norms, penalty_gradients,
                                              per_layer_results)
from kfac_graph.per_example.rules import default_registry
from kfac_graph.registration import GraphVariable
from kfac_graph.taps import LayerTaps
from kfac_graph.verify_report import Check, LayerCheck, VerifyReport
from passes import ir

# (rtol, atol) by the loosest dtype among the variables and the loss
TOLERANCES = {"float64": (1e-8, 1e-12), "float32": (1e-3, 1e-7),
              "float16": (5e-2, 1e-3), "bfloat16": (5e-2, 1e-3)}
def verify(fn, *args, examples: int = 4, directions: int = 2, rules=None,
           estimation_mode: str | None = None, seed: int = 0, rtol: float | None = None,
           atol: float | None = None, fisher_max_params: int = 4096) -> VerifyReport:
    """Checks ``fn``'s per-example gradients, norms and (opt-in) Fisher
    blocks on ``args``; returns a ``VerifyReport`` (``.passed``,
    ``.failures``, ``.table()``). See the module docstring.

    ``rules``: the ``RuleRegistry`` to check (default: ``default_registry()``);
    ``estimation_mode``: None (no Fisher check), ``"exact"`` or ``"empirical"``;
    ``seed``: picks the examples and the directions."""
    if estimation_mode not in (None, *verify_fisher.MODES):
        raise ValueError(f"estimation_mode must be None or one of {verify_fisher.MODES}, "
                         f"got {estimation_mode!r}")
    start = time.perf_counter()
    fn = fn if isinstance(fn, RegisteredFunction) else auto_register(fn)
    reg = fn.registration(*args)
    if not reg.variables:
        raise ValueError("the loss depends on no trainable variable: nothing to verify")
    if any(isinstance(v, GraphVariable) for v in reg.variables):
        raise ValueError("a GraphDef registration has no variables to run; verify a function "
                         "or a SavedModel")
    dtype, (default_rtol, default_atol) = _tolerances(fn, reg, args)
    tol = (default_rtol if rtol is None else rtol, default_atol if atol is None else atol)
    registry = rules or default_registry()
    rng = np.random.default_rng(seed)
    state = SavedState(fn, args)
    try:
        results = _cached(fn, ("verify_results", id(reg), id(rules)),
                          lambda: _per_example_results(reg, registry))
        pxg, squared, whole, once = state.run(results, *args)
        pxg = [g.numpy() for g in pxg]
        layer_norms = [np.sqrt(s.numpy()) for s in squared]
        model_norm = whole.numpy()
        batch = int(pxg[0].shape[0])
        more_notes = []
        picked = tuple(sorted(int(i) for i in rng.choice(batch, min(examples, batch),
                                                          replace=False)))
        gradient = _cached(fn, ("verify_gradient", id(reg)), lambda: _gradient_function(fn, reg))
        _trace_relaxed(gradient, args, batch)
        drawn, kernel_state = verify_draws.drawing_ops(reg)
        batch_gradient = _cached(fn, ("verify_traced_gradient", id(reg)), lambda: (
            _gradient_function(fn.concrete_function(*args), reg))) if drawn else gradient
        reference = [g.numpy() for g in state.run(batch_gradient, *args)]
        if reg.loss.reduction == "sum" and any(np.any(p.numpy()) for p in once):
            # example i alone holds a penalty added once to the sum: B copies in the sum
            reference = [r + (batch - 1) * p.numpy() for r, p in zip(reference, once)]
            more_notes.append(_ONCE)
        coupling = coupling_layers(reg) or reg.coupling
        ones, one_note, one_error = {}, "", ""
        if coupling:
            one_note = "couples examples"
        elif verify_notes.batch_statistics(reg):
            one_note = "batch statistics"
        elif drawn:
            one_note = "draws random numbers"
        elif picked:
            try:
                ones = {i: [g.numpy() for g in state.run(gradient, *_slice(args, batch, i))]
                        for i in picked}
                if reg.loss.weighted:
                    ones, one_error = verify_weights.rescaled(
                        fn, reg, args, ones, {i: _slice(args, batch, i) for i in ones}, tol)
                    one_note = "token weights" if one_error else ""
                elif reg.loss.reduction == "mean":  # (a sum reads alike on one example)
                    ratio = _scale_ratio(fn, reg, _slice(args, batch, picked[0]))
                    ones = {i: [ratio * g for g in grads] for i, grads in ones.items()}
                    more_notes += [] if ratio == 1 else [_RESCALED.format(
                        batch, reg.loss.scale, reg.loss.scale / ratio, ratio)]
            except (tf.errors.OpError, ValueError, TypeError) as e:
                one_note = "fn fails on a batch of one"
                one_error = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        fisher = {}
        if estimation_mode is not None:
            fisher = verify_fisher.fisher_checks(fn, reg, args, estimation_mode, directions, rng,
                                                 fisher_max_params, bool(coupling), tol, state,
                                                 more_notes)
    finally:
        state.restore()

    rows, offset = [], 0
    for index, layer in enumerate(reg.layers):
        n = len(layer.variables)
        grads, refs = pxg[offset:offset + n], reference[offset:offset + n]
        offset += n
        checks = [Check(reg.loss.reduction, "skipped", note="draws anew") if kernel_state
                  else _identity_check(reg.loss.reduction, grads, refs, tol)]
        if one_note:
            checks.append(Check("one-example", "skipped", note=one_note))
        elif picked:
            checks.append(_one_example_check(grads, [ones[i][offset - n:offset] for i in picked],
                                             picked, tol))
        checks.append(_norms_check("norms", layer_norms[index], _example_norms(grads), tol))
        if estimation_mode is not None:
            checks.append(fisher[index])
        rows.append(LayerCheck(layer.name, layer.kind, rule_label(registry, layer),
                               tuple(checks)))
    model = LayerCheck("(whole model)", "", "per_example_gradient_norms",
                       (_norms_check("norms", model_norm, _example_norms(pxg), tol),))
    notes = (verify_notes.notes(reg, coupling, one_error)
             + tuple(verify_draws.note(drawn, kernel_state)) + tuple(more_notes))
    return VerifyReport(tuple(rows), model, batch, reg.loss.reduction, picked, dtype,
                        tol[0], tol[1], estimation_mode, time.perf_counter() - start, notes)


# -- the references ----------------------------------------------------------------


def _cached(fn, key, make):
    """``fn.derived[key]``, made by ``make()`` the first time (one trace per
    registration, as ``per_example_gradients`` keeps its own)."""
    if key not in fn.derived:
        fn.derived[key] = make()
    return fn.derived[key]


def _gradient_function(fn, reg):
    """A ``tf.function``: the gradient of ``fn(*args)`` with respect to the
    registration's variables (zeros where unconnected), by GradientTape;
    ``fn`` the registered function, or one concrete function of it (the
    trace the registration read, where the loss draws when traced)."""
    variables = list(reg.variables)

    @tf.function(autograph=False)
    def gradient(*args):
        with tf.GradientTape() as tape:
            tape.watch(variables)
            loss = fn(*args)
        grads = tape.gradient(loss, variables,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [tf.convert_to_tensor(g) for g in grads]  # an embedding's IndexedSlices

    return gradient


def _trace_relaxed(function, args, batch):
    """Traces ``function`` once for any batch size (the batch and the
    batches of one then share the trace); a function that needs a static
    batch is traced per shape when called instead."""
    def relax(a):
        if isinstance(a, (tf.Tensor, np.ndarray)) and len(a.shape) >= 1 and a.shape[0] == batch:
            return tf.TensorSpec([None, *a.shape[1:]], tf.as_dtype(a.dtype))
        return a
    try:
        function.get_concrete_function(*tf.nest.map_structure(relax, args))
    except Exception:  # noqa: BLE001 - only an optimisation
        pass


def _per_example_results(reg, registry):
    """A ``tf.function`` tracing the registered graph once for what
    ``kg.per_example_gradients`` and ``kg.per_example_gradient_norms``
    compute: the flat per-example gradients, each layer's ``[B]`` squared
    norms by its rule's norm form, and the whole model's ``[B]`` norms."""

    @tf.function(autograph=False)
    def run(*args):
        taps = LayerTaps.build(reg, args, read_variables=reg.generic_variables)
        per_layer = per_layer_results(reg, taps, registry, "both")
        squared = [norms for _, norms in per_layer]
        once = [tf.zeros(v.shape, v.dtype) if g is None else g
                for v, g in zip(reg.variables, penalty_gradients(reg, taps, once=True))]
        return ([g for grads, _ in per_layer for g in grads], squared, model_norms(squared),
                once)

    return run


_ONCE = ("the loss adds a weight penalty R once beside a sum over the examples: every "
         "example's gradient holds dR (the gradient of example i alone), so the sum is "
         "checked against the batch gradient plus (B - 1) dR")
_RESCALED = ("the loss reads as {1:g} times a mean over the batch of {0} and as {2:g} times "
             "one example's term on a batch of one (it divides by a constant the batch's size "
             "divides, read as that size): each one-example reference is scaled by {3:g}")


def _scale_ratio(fn, reg, one_args) -> float:
    """The ratio of the loss's scale read on the batch to that read on a
    batch of one (``sum(l) / 3.0`` on a batch of 3 is a mean, scale 1, and on
    one example ``l / 3``): 1 where they agree, or where a batch of one
    does not register."""
    try:
        one = fn.registration(*one_args).loss
    except Exception:  # (its one-example gradient is checked as it is)
        return 1.0
    if one.reduction != "mean" or not one.scale or not reg.loss.scale:
        return 1.0
    ratio = reg.loss.scale / one.scale
    return 1.0 if np.isclose(ratio, 1.0, rtol=1e-12) else float(ratio)


def _slice(args, batch, i):
    """``args`` with every tensor whose axis 0 has length ``batch`` cut to ``[i:i+1]``."""
    def cut(a):
        shape = getattr(a, "shape", None)
        if shape is not None and len(shape) >= 1 and shape[0] == batch:
            return a[i:i + 1]
        return a
    return tf.nest.map_structure(cut, args)


# -- the comparisons ---------------------------------------------------------------


def _status(diff, scale, tol):
    error = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
    ok = bool(np.isfinite(diff)) and diff <= tol[1] + tol[0] * scale
    return ("pass" if ok else "fail"), float(error)


def _norm(parts) -> float:
    return float(np.sqrt(sum(np.sum(np.square(p, dtype=np.float64)) for p in parts)))


def _example_norms(grads) -> np.ndarray:
    """``[B]``: each example's norm over ``grads`` (each ``[B, ...]``)."""
    return np.sqrt(sum(np.sum(np.square(np.reshape(g, (g.shape[0], -1)), dtype=np.float64),
                              axis=1) for g in grads))


def _identity_check(reduction, grads, refs, tol) -> Check:
    """Check 1. The scale guards cancellation (a bias before batch norm has
    a zero batch gradient): the terms' own size, mean (or sum) of their norms."""
    reduce = np.mean if reduction == "mean" else np.sum
    got = [reduce(g.astype(np.float64), axis=0) for g in grads]
    diff = _norm([a - b for a, b in zip(got, refs)])
    scale = max(_norm(refs), float(reduce(_example_norms(grads))))
    status, error = _status(diff, scale, tol)
    return Check(reduction, status, error)


def _one_example_check(grads, references, picked, tol) -> Check:
    """Check 2: the worst over the sampled examples."""
    worst, ok = 0.0, True
    for i, refs in zip(picked, references):
        diff = _norm([g[i] - r for g, r in zip(grads, refs)])
        status, error = _status(diff, _norm(refs), tol)
        ok = ok and status == "pass"
        worst = max(worst, error) if not np.isnan(error) else float("nan")
    return Check("one-example", "pass" if ok else "fail", worst)


def _norms_check(name, got, want, tol) -> Check:
    diff = float(np.linalg.norm(np.asarray(got, np.float64) - want))
    status, error = _status(diff, float(np.linalg.norm(want)), tol)
    return Check(name, status, error)


# -- labels, tolerances, state -------------------------------------------------------


def rule_label(registry, layer) -> str:
    """The rule that computes ``layer``'s per-example gradients: its class
    name and the kernel it picks here (``"jacobian"`` for generic layers)."""
    if layer.kind == layers.GENERIC or layer.kind not in registry:
        return "jacobian"
    rule = registry[layer.kind]
    method = getattr(rule, "method", None)
    try:
        spec = layers.kind(layer.kind).spec(layer, 0)
        if hasattr(rule, "choose_method"):
            method = rule.choose_method(spec)
        elif method == "auto" and layer.kind == "dense":
            shape = layer.use_attrs[0].get("input_shape") or ()
            single = layer.uses == 1 and len(shape) >= 2 and int(np.prod(shape[1:-1])) == 1
            method = "outer" if single else "matmul"
    except Exception:  # noqa: BLE001 - a label only
        pass
    name = type(rule).__name__
    return f"{name}({method})" if isinstance(method, str) else name


def _tolerances(fn, reg, args):
    """``(dtype name, (rtol, atol))`` for the loosest dtype of the variables,
    the loss, the layers' outputs (under mixed precision the layers compute
    in float16 or bfloat16 on float32 variables, and so does the reference
    batch gradient), and the narrower floats the loss computes in on the way
    (``passes.precision``: a float64 model through a float32 op is only as
    precise as float32)."""
    names = {tf.as_dtype(v.dtype).name for v in reg.variables}
    names |= _output_dtypes(reg)
    names.update(narrow for _, _, narrow in verify_notes.narrowing(reg))
    try:
        names.add(tf.as_dtype(fn.concrete_function(*args).structured_outputs.dtype).name)
    except (AttributeError, TypeError, ValueError):
        pass
    known = [n for n in names if n in TOLERANCES] or ["float32"]
    loosest = max(known, key=lambda n: TOLERANCES[n][0])
    return loosest, TOLERANCES[loosest]


def _output_dtypes(reg) -> set:
    """The dtype names of the registered layers' output tensors (from the IR)."""
    if reg.ir is None:
        return set()
    out = set()
    for layer in reg.layers:
        for tensor in layer.outputs:
            node, index = ir.split_tensor(tensor)
            if node in reg.ir:
                out.add(reg.ir.nodes[node]["dtypes"][index])
    return out
