"""What ``kg.verify`` found: one row per registered layer, printable as a table.

A ``Check`` is one comparison of the runtime against a reference computed
another way (``error`` = ``|got - reference| / |reference|``), passed,
failed, or skipped with the reason; a ``LayerCheck`` is a layer's row (its
name, kind, the per-example rule that served it, its checks); a
``VerifyReport`` holds the rows, a row of whole-model checks, the settings
and the notes, and says whether everything that ran passed.
"""
from __future__ import annotations

import dataclasses
import math

STATUSES = ("pass", "fail", "skipped")
# What each check compares, for the table's legend.
LEGEND = {
    "mean": "the per-example gradients' mean against the batch gradient (GradientTape), "
            "relative to the larger of its norm and the mean of the examples' norms",
    "sum": "the per-example gradients' sum against the batch gradient (GradientTape), "
           "relative to the larger of its norm and the sum of the examples' norms",
    "one-example": "example i's gradient against the gradient of fn on args[i:i+1], "
                   "worst of the sampled examples",
    "norms": "the rule's per-example norms against the norms of its per-example gradients",
    "fisher": "v.F v of the layer's full Fisher block against the {mode} Fisher's quadratic "
              "form (double-backward Jacobian-vector products), worst of the directions",
}


@dataclasses.dataclass(frozen=True)
class Check:
    """One comparison: ``status`` in ``"pass"``, ``"fail"``, ``"skipped"``;
    ``error`` the relative error (None when skipped); ``note`` why it was
    skipped (short: it is printed in the table's cell)."""

    name: str
    status: str
    error: float | None = None
    note: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    @property
    def passed(self) -> bool:
        """True unless the check ran and failed (a skipped check is not a failure)."""
        return self.status != "fail"

    def cell(self) -> str:
        if self.status == "skipped":
            return f"skipped: {self.note}" if self.note else "skipped"
        text = _number(self.error)
        return text if self.status == "pass" else f"{text} FAIL"


@dataclasses.dataclass(frozen=True)
class LayerCheck:
    """One row: a layer (or the whole model) and its checks."""

    name: str
    kind: str
    rule: str
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def worst_error(self) -> float | None:
        """The largest relative error over the checks that ran (None if none ran)."""
        errors = [c.error for c in self.checks if c.status != "skipped" and c.error is not None]
        if not errors:
            return None
        return max(errors, key=lambda e: math.inf if math.isnan(e) else e)

    def check(self, name: str) -> Check | None:
        """The check called ``name`` (``"mean"``/``"sum"``, ``"one-example"``,
        ``"norms"``, ``"fisher"``), None if this row has none."""
        return next((c for c in self.checks if c.name == name), None)

    @property
    def failed_checks(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.checks if not c.passed)


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """``kg.verify``'s result. ``rows``: one ``LayerCheck`` per registered
    layer, in ``Registration.layers`` order; ``model``: the whole-model
    checks (``per_example_gradient_norms``); ``examples``: the example
    indices the one-example check used; ``rtol``/``atol``: a check passes
    when ``|got - reference| <= atol + rtol * |reference|``."""

    rows: tuple[LayerCheck, ...]
    model: LayerCheck
    batch_size: int
    reduction: str
    examples: tuple[int, ...]
    dtype: str
    rtol: float
    atol: float
    estimation_mode: str | None = None
    seconds: float = 0.0
    notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """True when no check that ran failed."""
        return not self.failures

    @property
    def failures(self) -> tuple[LayerCheck, ...]:
        """The rows (layers, then the whole-model row) with a failing check."""
        return tuple(row for row in (*self.rows, self.model) if not row.passed)

    @property
    def counts(self) -> dict:
        """``{"pass": n, "fail": n, "skipped": n}`` over every check."""
        out = dict.fromkeys(STATUSES, 0)
        for row in (*self.rows, self.model):
            for c in row.checks:
                out[c.status] += 1
        return out

    def table(self) -> str:
        """The report as text: one line per layer, then the whole model, the
        legend, the notes and the verdict."""
        names = []
        for row in (*self.rows, self.model):
            names += [c.name for c in row.checks if c.name not in names]
        header = ("#", "layer", "kind", "rule", *names, "worst", "result")
        lines = [header]
        for i, row in enumerate(self.rows):
            lines.append(_line(str(i), row, names))
        lines.append(_line("-", self.model, names))
        widths = [max(len(r[c]) for r in lines) for c in range(len(header))]
        fmt = lambda r: "  ".join(s.ljust(w) for s, w in zip(r, widths)).rstrip()  # noqa: E731
        out = [fmt(lines[0]), "  ".join("-" * w for w in widths)]
        out += [fmt(r) for r in lines[1:-1]]
        out += ["  ".join("-" * w for w in widths), fmt(lines[-1])]
        ran = any(c.name == "one-example" and c.status != "skipped"
                  for row in self.rows for c in row.checks)
        shown = f"; one-example on examples {', '.join(map(str, self.examples))}" if ran else ""
        out.append(f"batch {self.batch_size}, {self.reduction} loss, {self.dtype}: a check passes "
                   f"when |got - ref| <= {self.atol:g} + {self.rtol:g} |ref|{shown}")
        for name in names:
            if name in LEGEND:
                out.append(f"  {name}: {LEGEND[name].format(mode=self.estimation_mode)}")
        out += [f"note: {note}" for note in self.notes]
        counts = self.counts
        summary = (f"{counts['pass']} passed, {counts['fail']} failed, "
                   f"{counts['skipped']} skipped in {self.seconds:.1f} s")
        if self.passed:
            out.append(f"PASSED: {summary}")
        else:
            failed = "; ".join(f"{row.name} ({', '.join(row.failed_checks)})"
                               for row in self.failures)
            out.append(f"FAILED: {summary}: {failed}")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()


def _line(index, row, names):
    cells = []
    for name in names:
        check = row.check(name)
        cells.append("-" if check is None else check.cell())
    worst = row.worst_error
    return (index, row.name, row.kind, row.rule, *cells,
            "-" if worst is None else _number(worst), "ok" if row.passed else "FAIL")


def _number(x) -> str:
    if x is None:
        return "-"
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:.1e}"
