"""The pass manager: IR in, registration data out, passes run in order.

``run(traced, loss=None) -> PassResult`` imports the traced graph into the IR,
marks where it computes in a narrower float than its inputs (precision),
canonicalizes it, matches layers and the loss, and records how long each
pass took (``timings``, seconds).
"""
from __future__ import annotations

import dataclasses
import time

import networkx as nx

from passes import frontends
from passes.canonicalize import canonicalize
from passes.errors import TraceError
from passes.match_layers import LayerMatch, match_layers
from passes.match_loss import LossMatch, match_loss
from passes.precision import mark_narrowing


@dataclasses.dataclass(frozen=True)
class PassResult:
    traced: frontends.Traced
    graph: nx.DiGraph
    layers: tuple[LayerMatch, ...]
    loss: LossMatch
    timings: dict


def run(traced: frontends.Traced, loss: str | None = None) -> PassResult:
    timings = {}
    start = time.perf_counter()
    g = frontends.to_ir(traced)
    timings["import"] = time.perf_counter() - start
    for name, step in (("precision", mark_narrowing), ("canonicalize", canonicalize)):
        start = time.perf_counter()
        g = step(g)
        timings[name] = time.perf_counter() - start
    start = time.perf_counter()
    layers = match_layers(g)
    timings["match_layers"] = time.perf_counter() - start
    if not layers:
        raise TraceError(f"{traced.name}: the loss depends on no trainable variable")
    start = time.perf_counter()
    loss_match = match_loss(g, loss)
    timings["match_loss"] = time.perf_counter() - start
    return PassResult(traced, g, layers, loss_match, timings)
