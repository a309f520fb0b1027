"""The pass manager: IR in, registration data out, passes run in order.

``run(traced, loss=None) -> PassResult`` unrolls the loops whose trip count
is static (``passes.unroll``, at most ``max_loop_iterations`` each), imports
the traced graph into the IR, marks the variables the loss's gradient never
reaches (``passes.gradient_stops``: behind a ``StopGradient`` on every path)
not trainable, marks where it computes in a narrower float
than its inputs (precision), canonicalizes it, reads static slices of
variables as parts of them (variable_parts), marks low-rank adapters'
kernels (lora), writes ``tf.nn.l2_loss`` out as ``0.5 * sum(x * x)``
(``passes.l2_loss``), finds the examples' rows (``passes.example_rows``; where the
batch is known at run time only, from probes, ``passes.shape_probe``, which
also restores the static shapes such a graph lost), matches layers and the
loss,
and records how long each pass took (``timings``, seconds). The graph the
runtime re-imports has each grouped Conv3D written per group, and NCDHW
ones as NDHWC (``passes.grouped_conv3d``: TensorFlow's CPU Conv3D has no
groups, and runs NCDHW in float32 only).
"""
from __future__ import annotations

import dataclasses
import time

import networkx as nx

from passes import frontends, ir
from passes.canonicalize import canonicalize
from passes.errors import KfacGraphError, TraceError
from passes.coupling import batch_statistics, coupling_ops, padded_to_longest
from passes.example_rows import graph_rows
from passes.gradient_coupling import replayed_coupling
from passes.gradient_stops import unreached
from passes.grouped_conv3d import split_grouped_conv3d
from passes.lora import mark_lora
from passes.match_layers import LayerMatch, match_layers
from passes.joined_outputs import join_outputs
from passes.l2_loss import written_out
from passes.match_loss import LossMatch, match_loss
from passes.precision import mark_narrowing
from passes.shape_probe import probed_rows, restore_shapes
from passes.unroll import DEFAULT_MAX_ITERATIONS, unroll_loops
from passes.variable_parts import mark_parts


@dataclasses.dataclass(frozen=True)
class PassResult:
    traced: frontends.Traced
    graph: nx.DiGraph
    layers: tuple[LayerMatch, ...]
    loss: LossMatch
    timings: dict
    coupling: tuple[str, ...] = ()  # ops where the examples meet (passes.coupling), and
    # replayed custom gradients whose function reads across them (gradient_coupling)
    batch_statistics: tuple[str, ...] = ()  # the data's own, on the way to the loss
    padded_to_longest: tuple[str, ...] = ()  # ragged data padded to the batch's longest row


def run(traced: frontends.Traced, loss: str | None = None,
        max_loop_iterations: int = DEFAULT_MAX_ITERATIONS) -> PassResult:
    """``PassResult.traced`` is the graph the layers' tensors belong to (the
    unrolled one)."""
    timings = {}
    start = time.perf_counter()
    traced = unroll_loops(traced, max_loop_iterations)
    graph_def = written_out(traced.graph_def)  # tf.nn.l2_loss as 0.5 * sum(x * x)
    if graph_def is not traced.graph_def:
        traced = dataclasses.replace(traced, graph_def=graph_def)
    timings["unroll"] = time.perf_counter() - start
    start = time.perf_counter()
    traced = restore_shapes(traced)
    timings["shape_probe"] = time.perf_counter() - start
    start = time.perf_counter()
    g = frontends.to_ir(traced)
    timings["import"] = time.perf_counter() - start
    g = _prepared(g, timings)
    start = time.perf_counter()
    # sizes known at run time only (the batch's, a length's): rows from probes too,
    # the rows of the tensors whose shapes are known first
    rows = {**probed_rows(traced, lambda t: graph_rows(_prepared(frontends.to_ir(t))), g),
            **graph_rows(g)}
    timings["rows"] = time.perf_counter() - start
    start = time.perf_counter()
    layers = match_layers(g, rows)
    timings["match_layers"] = time.perf_counter() - start
    if not layers:
        raise TraceError(f"{traced.name}: the loss depends on no trainable variable")
    start = time.perf_counter()
    loss_match = match_loss(g, loss, rows)
    _batch_first_output(g, rows, loss_match, traced.name)
    coupling = tuple(dict.fromkeys([*(op for terms in (loss_match.terms, *(
        t for t, _ in loss_match.extras)) for op in coupling_ops(g, rows, terms)),
        *replayed_coupling(traced.graph_def, g, rows)]))
    statistics = batch_statistics(g, rows, g.graph["output"])
    padded = padded_to_longest(g, g.graph["output"])
    timings["match_loss"] = time.perf_counter() - start
    graph_def = split_grouped_conv3d(traced.graph_def, g)
    if loss_match.joined:
        graph_def = join_outputs(graph_def, g, loss_match.joined,
                                 [t for t, *_ in loss_match.heads])
    if graph_def is not traced.graph_def:
        traced = dataclasses.replace(traced, graph_def=graph_def)
    return PassResult(traced, g, layers, loss_match, timings, coupling, statistics, padded)


def _prepared(g, timings=None):
    """The IR after the passes that precede matching, each timed."""
    for name, step in (("gradient_stops", unreached), ("precision", mark_narrowing),
                       ("canonicalize", canonicalize),
                       ("variable_parts", mark_parts), ("lora", mark_lora)):
        start = time.perf_counter()
        g = step(g)
        if timings is not None:
            timings[name] = time.perf_counter() - start
    return g


def _batch_first_output(g, rows, loss_match, name):
    """The loss's model output must hold the examples on its first axis (the
    per-token Fisher, the per-example loss terms and their normalisation
    read them there): a time-major ``[T, B, C]`` output is refused, one line."""
    node = ir.node_of(g, loss_match.output) if loss_match.output else None
    axis = rows[node].axis if node in rows else None
    if axis:
        raise KfacGraphError(
            f"{name}: the loss reads its model output {loss_match.output} with the examples on "
            f"axis {axis} (time-major), but reads a loss's examples on the first axis: "
            "transpose the output and targets to batch-first before the loss")
