"""Privacy spent over phases of training under different samplers.

``DPModel.fit`` called again at another batch size, or on another number
of examples (``validation_split``, new data), runs its later steps under
another mechanism. Charging every step at the last phase's rate
understates epsilon: 10 steps at q = 0.5, then 10 at q = 0.1, read as 20
at q = 0.1 give 4.2 where their composition gives 11.8.

A ``Ledger`` keeps each finished phase (noise multiplier, sampler, steps)
and composes it with the current one: RDP adds the phases' curves order
by order (each phase's one-step curve times its steps), PLD composes the
phases' events. Phases must share one neighbouring relation: Poisson
sampling's add-or-remove-one and fixed-size batches' replace-one give no
single guarantee together, so a switch between them is refused.
"""
from __future__ import annotations

import dataclasses
import math

import dp_accounting as dpa

from kfac_graph import options
from kfac_graph.privacy import accounting
from kfac_graph.privacy.privatize import OPTIONS as PRIVATIZE_OPTIONS
from kfac_graph.privacy.accounting import Sampling, dp_event, make_accountant


@dataclasses.dataclass(frozen=True)
class Phase:
    """``steps`` DP-SGD steps at ``noise_multiplier`` under ``sampling``."""

    noise_multiplier: float
    sampling: Sampling
    steps: int

    def describe(self) -> str:
        s = self.sampling
        how = (f"Poisson sampling at q = {s.rate:.6g}" if s.kind == "poisson"
               else f"fixed-size batches of {s.batch_size} (q = {s.rate:.6g})")
        return f"{self.steps} steps, {how}, noise multiplier {self.noise_multiplier:g}"


class Ledger:
    """The finished phases of one model's training (module docstring)."""

    def __init__(self, phases=()):
        self.phases = tuple(phases)
        self._curves = {}  # (noise, sampling) -> (orders, one step's RDP)

    @property
    def steps(self) -> int:
        """The steps the finished phases took."""
        return sum(p.steps for p in self.phases)

    def check(self, sampling: Sampling, noise_multiplier, owner: str = "kg.DPModel.fit"):
        """One-line ``ValueError`` where ``sampling`` cannot compose with the
        phases (without noise, here or before, there is no guarantee to compose)."""
        kinds = {p.sampling.kind for p in self.phases}
        if (kinds and sampling.kind not in kinds and noise_multiplier != 0
                and all(p.noise_multiplier != 0 for p in self.phases)):
            raise ValueError(
                f"{owner}: the steps so far were drawn by {kinds.pop()} sampling and these "
                f"are drawn by {sampling.kind} sampling: their neighbouring relations differ, "
                "so no one guarantee composes them; keep one sampling, or train a new model")

    def close(self, noise_multiplier: float, sampling: Sampling, total_steps: int) -> None:
        """Ends the current phase at ``total_steps`` (the optimizer's count)."""
        steps = int(total_steps) - self.steps
        if steps > 0:
            self.check(sampling, noise_multiplier)
            self.phases += (Phase(float(noise_multiplier), sampling, steps),)

    def with_current(self, noise_multiplier, sampling, total_steps) -> tuple[Phase, ...]:
        """The finished phases and the current one, ``total_steps`` in all."""
        steps = int(total_steps) - self.steps
        current = (Phase(float(noise_multiplier), sampling, steps),) if steps > 0 else ()
        return self.phases + current

    def epsilon(self, delta: float, noise_multiplier, sampling, total_steps,
                accountant: str = "rdp") -> float:
        """Epsilon at ``delta`` of every phase, the current one's steps up to
        ``total_steps``. ``inf`` where a phase had no noise; 0 with no steps."""
        phases = self.with_current(noise_multiplier, sampling, total_steps)
        if not phases:
            return 0.0
        if any(p.noise_multiplier == 0 for p in phases):
            return math.inf
        if accountant != "rdp":
            acc = make_accountant(accountant, phases[0].sampling)
            for p in phases:
                acc.compose(dp_event(p.noise_multiplier, p.steps, p.sampling))
            return float(acc.get_epsilon(delta))
        orders, total = None, 0.0
        for p in phases:
            orders, curve = self._curve(p)
            total = total + curve * p.steps
        return float(dpa.rdp.compute_epsilon(orders, total, delta)[0])

    def _curve(self, phase: Phase):
        key = (phase.noise_multiplier, phase.sampling)
        if key not in self._curves:
            acc = make_accountant("rdp", phase.sampling)
            acc.compose(dp_event(phase.noise_multiplier, 1, phase.sampling))
            self._curves[key] = (acc.orders, acc.rdp)
        return self._curves[key]

    def statement(self, delta: float, noise_multiplier, sampling, total_steps) -> str:
        """``accounting.statement`` while there is one phase; else each phase on
        a line, then epsilon at ``delta`` by each accountant that applies."""
        if not self.phases:
            return accounting.statement(noise_multiplier, delta, steps=int(total_steps),
                                        sample_rate=sampling.rate,
                                        num_examples=sampling.num_examples,
                                        batch_size=sampling.batch_size, sampling=sampling.kind)
        phases = self.with_current(noise_multiplier, sampling, total_steps)
        lines = [f"DP-SGD in {len(phases)} phases, {sum(p.steps for p in phases)} steps:"]
        lines += [f"    {p.describe()}" for p in phases]
        lines.append("The guarantee covers every intermediate model (all checkpoints) as well "
                     "as the final one.")
        fixed = sampling.kind == "fixed"
        lines.append(f"Example-level DP with {'replace-one' if fixed else 'add-or-remove-one'}"
                     f" adjacency at delta = {delta:g}:")
        for name in ("rdp",) if fixed else ("rdp", "pld"):
            e = self.epsilon(delta, noise_multiplier, sampling, total_steps, name)
            lines.append(f"    epsilon by {name.upper()} accounting: {e:.3f}")
        return "\n".join(lines)

    def to_config(self) -> list:
        return [{"noise_multiplier": p.noise_multiplier, "steps": p.steps,
                 **dataclasses.asdict(p.sampling)} for p in self.phases]

    @classmethod
    def from_config(cls, config) -> "Ledger":
        return cls(Phase(c["noise_multiplier"], Sampling(c["kind"], c["rate"], c["num_examples"],
                                                         c["batch_size"]), int(c["steps"]))
                   for c in config or ())


class StepAccountant:
    """Epsilon after any number of steps of one mechanism (a noise multiplier
    and a sampler), as ``accounting.epsilon`` computes it: a ledger of no
    finished phase. RDP: the one-step curve is computed once and scaled by
    the steps (composition adds RDP), so a query costs microseconds and can
    run after every step; PLD composes afresh on each query (about a second
    for 10^4 steps)."""

    def __init__(self, noise_multiplier: float, sampling: Sampling):
        if not noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}")
        self.noise_multiplier = float(noise_multiplier)
        self.sampling = sampling
        self._ledger = Ledger()

    def epsilon(self, steps: int, delta: float, accountant: str = "rdp") -> float:
        accounting.check(self.noise_multiplier, delta)
        return self._ledger.epsilon(delta, self.noise_multiplier, self.sampling, steps,
                                    accountant)


class TracedOption:
    """A value a DP-SGD step reads when its function is traced (``kg.DPSGD``'s
    and ``kg.DPModel``'s): setting it traces the step anew (the owner's
    ``_step_function = None``; before, a value set later changed nothing).
    ``validate(owner, value)`` runs first."""

    def __init__(self, validate=None):
        self.validate = validate

    def __set_name__(self, owner, name):
        self.name = "_" + name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj, self.name)

    def __set__(self, obj, value):
        if self.validate is not None:
            self.validate(obj, value)
        setattr(obj, self.name, value)
        obj._step_function = None


def new_noise(obj, value):
    """A new noise multiplier ends the owner's phase at its steps so far
    (``obj``: ``sampling``, ``_ledger``, ``_steps()``)."""
    options.check(f"kg.{type(obj).__name__}", "noise_multiplier", value,
                  PRIVATIZE_OPTIONS["noise_multiplier"])
    old, steps = getattr(obj, "_noise_multiplier", None), obj._steps()
    if old is not None and value != old and obj.sampling is not None and steps:
        obj._ledger.close(old, obj.sampling, steps)


class LedgerAccounting:
    """Epsilon and the privacy statement of a model trained by DP-SGD in
    phases (``kg.DPModel``'s): it holds ``sampling`` (the current sampler or
    None), ``delta``, ``accountant``, ``_ledger`` (the finished phases) and
    an ``optimizer`` whose ``iterations`` count the steps. A new noise
    multiplier ends a phase (before, the step kept the old noise while
    epsilon was computed at the new one)."""

    noise_multiplier = TracedOption(new_noise)
    l2_norm_clip = TracedOption()

    def epsilon(self, delta: float | None = None, accountant: str | None = None) -> float:
        """Epsilon at ``delta`` (default the constructor's) for the optimizer's
        steps so far, each phase of training at its own sampler's rate (a
        ``fit`` at another batch size starts a phase: ``privacy/ledger.py``)."""
        if self.sampling is None:
            raise ValueError("kg.DPModel: the sampler is unknown: fit on arrays or on "
                             "kg.privacy.poisson_batches / fixed_size_batches, or give "
                             "sample_rate= / num_examples= and batch_size=")
        return self._ledger.epsilon(delta or self.delta, self.noise_multiplier, self.sampling,
                                    self._steps(), accountant or self.accountant)

    def privacy_statement(self, delta: float | None = None) -> str:
        """``kg.privacy.statement`` for the steps taken so far (with a line per
        phase where the sampler changed between fits)."""
        self.epsilon(delta)
        return self._ledger.statement(delta or self.delta, self.noise_multiplier, self.sampling,
                                      self._steps())

    def _steps(self) -> int:
        optimizer = getattr(self, "optimizer", None)
        return 0 if optimizer is None else int(optimizer.iterations.numpy())

    def _use_sampling(self, sampling):
        """``sampling`` draws the coming steps; the steps taken under another
        end a phase of the ledger (each accounted at its own rate)."""
        if self.sampling is not None and self.sampling != sampling and self._steps():
            self._ledger.close(self.noise_multiplier, self.sampling, self._steps())
        self._ledger.check(sampling, self.noise_multiplier)
        self.sampling = sampling
