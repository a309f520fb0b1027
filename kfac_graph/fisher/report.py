"""What each layer's Fisher block keeps, and how much memory it takes.

For a registration and its blocks (aligned with `Registration.layers`),
per layer:

- the block's class and, for Kronecker blocks, how it treats positions
  ("expand" or "reduce", `positions.py`) and each factor's width, group
  count and layout: "full", "diagonal" (the block's own choice, e.g. an
  embedding's id frequencies), "diagonal (wide)" (wider than the
  estimator's `max_factor_size`, so only its diagonal is kept) or
  "blocks c x k" (wider than the estimator's `factor_block_size`: its c
  diagonal blocks of k, `factor_blocks.py`);
- bytes of the layer's parameters (its variables), of the block's
  statistics (every variable of the block that is not a cached inverse:
  the factors' moving averages, their debiasing weights, counters) and of
  its cached inverses / decompositions (`block.inverse_variables()`).

Bytes are element counts times the variables' dtype sizes, as allocated
(one replica's copy under `tf.distribute`). `memory_report` returns plain
data for benchmarks; `format_report` the table `FisherEstimator.summary()`
prints.
"""

import numpy as np
import tensorflow as tf


def factors_of(block):
    """``[(label, factor)]``: the covariance factors a block keeps (a
    ``PartsBlock``'s labelled by part, a wrapper's those of the block inside,
    a block with several named factors its ``named_factors()``)."""
    inner = getattr(block, "block", None)
    if inner is not None:
        return factors_of(inner)
    parts = getattr(block, "parts", None)
    if parts is not None:
        return [(f"{part.name}_{label}", factor) for part in parts
                for label, factor in factors_of(part)]
    named = getattr(block, "named_factors", None)
    if named is not None:
        return list(named())
    out = []
    for label in ("input_factor", "output_factor", "factor"):
        factor = getattr(block, label, None)
        if factor is not None and hasattr(factor, "value"):
            out.append((label.replace("_factor", "") or label, factor))
    return out


def _positions(block):
    inner = getattr(block, "block", None)
    if inner is not None:
        return _positions(inner)
    parts = getattr(block, "parts", None)
    if parts is not None:
        found = {p for p in map(_positions, parts) if p is not None}
        return found.pop() if len(found) == 1 else None
    return getattr(block, "positions", None)


def _layout(factor):
    blocks = getattr(factor, "blocks", None)
    if blocks is not None:
        return f"blocks {blocks.count} x {blocks.size}"
    if getattr(factor, "wide", False):
        return "diagonal (wide)"
    return "diagonal" if factor.diagonal else "full"


def _bytes(variables):
    return int(sum(int(np.prod(_shape(v))) * tf.as_dtype(v.dtype).size for v in variables))


def _shape(v):
    shape = v.shape
    if shape is None or getattr(shape, "rank", 0) is None:
        return ()
    return tuple(int(d) for d in (shape.as_list() if hasattr(shape, "as_list") else shape))


def _unique(variables):
    seen, out = set(), []
    for v in variables:
        key = v.ref() if hasattr(v, "ref") else id(v)
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


def block_memory(block):
    """``(statistics bytes, inverse bytes)`` of one block."""
    inverses = _unique(block.inverse_variables())
    cached = {v.ref() for v in inverses}
    stats = [v for v in _unique(block.variables) if v.ref() not in cached]
    return _bytes(stats), _bytes(inverses)


def memory_report(layers, blocks) -> dict:
    """Plain data: ``{"layers": [...], "total": {...}}``; each layer's entry
    has ``name``, ``kind``, ``block``, ``positions`` (None for blocks without
    positions), ``factors`` (``[{label, dim, groups, layout}]``) and the bytes
    ``parameters``, ``factors_bytes``, ``inverses_bytes``; ``total`` sums the bytes."""
    rows = []
    for layer, block in zip(layers, blocks):
        stats, inverses = block_memory(block)
        factors = [{"label": label, "dim": factor.dim, "groups": factor.groups,
                    "layout": _layout(factor)} for label, factor in factors_of(block)]
        rows.append({"name": layer.name, "kind": layer.kind, "block": _block_name(block),
                     "positions": _positions(block), "factors": factors,
                     "parameters": _bytes(layer.variables), "factors_bytes": stats,
                     "inverses_bytes": inverses})
    total = {key: sum(r[key] for r in rows)
             for key in ("parameters", "factors_bytes", "inverses_bytes")}
    return {"layers": rows, "total": total}


def _block_name(block):
    inner = getattr(block, "block", None)
    return type(block).__name__ if inner is None else _block_name(inner)


def _factor_text(factor):
    groups = f" (x{factor['groups']})" if factor["groups"] else ""
    return f"{factor['label']} {factor['dim']}{groups} {factor['layout']}"


def human_bytes(n) -> str:
    """``n`` bytes as B, KiB, MiB or GiB (one decimal above bytes)."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_report(report, max_factor_size=None, factor_block_size=None) -> str:
    """The table of ``memory_report``: one row per layer, then the totals."""
    header = ("#", "layer", "kind", "block", "positions", "factors", "params", "factors mem",
              "inverses mem")
    rows = [header]
    for i, r in enumerate(report["layers"]):
        rows.append((str(i), r["name"], r["kind"], r["block"], r["positions"] or "-",
                     ", ".join(map(_factor_text, r["factors"])) or "-",
                     human_bytes(r["parameters"]), human_bytes(r["factors_bytes"]),
                     human_bytes(r["inverses_bytes"])))
    total = report["total"]
    rows.append(("", "total", "", "", "", "", human_bytes(total["parameters"]),
                 human_bytes(total["factors_bytes"]), human_bytes(total["inverses_bytes"])))
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    line = lambda row: "  ".join(s.ljust(w) for s, w in zip(row, widths)).rstrip()  # noqa: E731
    out = [line(rows[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in rows[1:]]
    budget = "none" if max_factor_size is None else f"{max_factor_size:,}"

    def over_budget(layout):
        return [r["name"] for r in report["layers"]
                if any(layout(f["layout"]) for f in r["factors"])]

    diagonal = over_budget(lambda layout: layout == "diagonal (wide)")
    out.append(f"max_factor_size: {budget}; factors kept diagonal for it: "
               + (", ".join(diagonal) if diagonal else "none"))
    blocked = over_budget(lambda layout: layout.startswith("blocks"))
    if factor_block_size is not None or blocked:
        out.append(f"factor_block_size: {factor_block_size or 'none'}; factors kept in "
                   "diagonal blocks for it: " + (", ".join(blocked) if blocked else "none"))
    return "\n".join(out)
