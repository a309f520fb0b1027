"""Privacy accounting for DP-SGD with dp-accounting (Google's library, the one
TensorFlow Privacy uses).

One DP-SGD step releases the clipped-gradient sum plus Gaussian noise of
standard deviation ``sigma * C`` (``sigma`` the noise multiplier, ``C`` the
clipping sensitivity, see ``clipping.py``): a Gaussian mechanism of noise
multiplier ``sigma`` run on a random sample of the data. ``T`` steps compose
``T`` such events. Which sampled event depends on the sampler, and the
accounting is only valid for the sampler it assumes:

============  ==============================================  ===========================
sampling      the batch of each step                          event, adjacency
============  ==============================================  ===========================
``poisson``   every example in independently with             ``PoissonSampledDpEvent(q)``,
              probability ``q`` (``poisson_batches``)         add-or-remove-one
``fixed``     ``B`` examples drawn uniformly without           ``SampledWithoutReplacement
              replacement from the ``N``, fresh every step     DpEvent(N, B)``, replace-one
              (``fixed_size_batches``)                        (RDP only)
============  ==============================================  ===========================

Shuffling once per epoch and cutting the permutation into batches (what
``model.fit`` does by default) matches neither; the common practice of
accounting it as Poisson sampling is not a proof, and nothing here does it.

``accountant="rdp"`` (Rényi DP, Mironov 2017; orders 1.1 ... 1024, the
library's defaults) or ``"pld"`` (privacy loss distributions, tighter, slower;
Poisson sampling only). Steps from epochs: ``ceil(epochs / q)``, as TensorFlow
Privacy's ``compute_dp_sgd_privacy_statement`` counts them.
"""
from __future__ import annotations

import dataclasses
import math

import dp_accounting as dpa

SAMPLINGS = ("poisson", "fixed")
ACCOUNTANTS = ("rdp", "pld")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each step's batch is drawn: ``kind`` in ``SAMPLINGS``; ``rate`` the
    probability ``q`` that an example is in a step's batch (Poisson), or
    ``batch_size / num_examples`` (fixed); ``num_examples`` N (needed for
    ``fixed`` and for epochs); ``batch_size`` the expected (Poisson) or exact
    (fixed) batch size."""

    kind: str
    rate: float
    num_examples: int | None = None
    batch_size: float | None = None

    @classmethod
    def make(cls, sampling="poisson", sample_rate=None, num_examples=None, batch_size=None):
        """From ``sample_rate`` or ``num_examples`` and ``batch_size`` (one-line
        ``ValueError`` for what is missing or out of range)."""
        if sampling not in SAMPLINGS:
            raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
        if num_examples is not None and (not float(num_examples).is_integer()
                                         or num_examples < 1):
            raise ValueError(f"num_examples must be an integer >= 1, got {num_examples!r}")
        if sample_rate is None:
            if num_examples is None or batch_size is None:
                raise ValueError("give sample_rate, or num_examples and batch_size")
            sample_rate = batch_size / num_examples
        elif batch_size is None and num_examples is not None:
            batch_size = sample_rate * num_examples
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"the sampling rate must be in (0, 1], got {sample_rate!r}")
        if sampling == "fixed":
            if num_examples is None or batch_size is None:
                raise ValueError("fixed-size sampling is accounted from num_examples and "
                                 "batch_size")
            if not float(batch_size).is_integer():
                raise ValueError(f"fixed-size sampling needs an integer batch_size, got "
                                 f"{batch_size!r}")
            batch_size = int(batch_size)
        return cls(sampling, float(sample_rate),
                   None if num_examples is None else int(num_examples), batch_size)

    def steps_for_epochs(self, epochs: float) -> int:
        """``ceil(epochs / q)``: the steps in ``epochs`` passes' worth of samples."""
        return int(math.ceil(epochs / self.rate - 1e-9))


def dp_event(noise_multiplier: float, steps: int, sampling: Sampling) -> dpa.DpEvent:
    """The ``DpEvent`` of ``steps`` DP-SGD steps under ``sampling``."""
    gaussian = dpa.GaussianDpEvent(noise_multiplier)
    if sampling.kind == "poisson":
        one = dpa.PoissonSampledDpEvent(sampling.rate, gaussian)
    else:
        one = dpa.SampledWithoutReplacementDpEvent(sampling.num_examples,
                                                   sampling.batch_size, gaussian)
    return dpa.SelfComposedDpEvent(one, int(steps))


def make_accountant(name: str, sampling: Sampling):
    if name not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {name!r}")
    if sampling.kind == "fixed":
        if name == "pld":
            raise ValueError("the PLD accountant does not support fixed-size batches "
                             "(sampling without replacement); use accountant='rdp'")
        return dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    if name == "pld":
        return dpa.pld.PLDAccountant()
    return dpa.rdp.RdpAccountant()


def check(noise_multiplier, delta):
    if not (isinstance(noise_multiplier, (int, float)) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be a number >= 0, got {noise_multiplier!r}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")


def epsilon(noise_multiplier: float, delta: float, *, steps: int | None = None,
            epochs: float | None = None, sample_rate: float | None = None,
            num_examples: int | None = None, batch_size: float | None = None,
            sampling: str = "poisson", accountant: str = "rdp") -> float:
    """Epsilon at ``delta`` after ``steps`` DP-SGD steps (or ``epochs`` worth)
    with noise multiplier ``noise_multiplier``, sampled by ``sampling`` at
    ``sample_rate`` (or ``batch_size / num_examples``). ``inf`` with no noise;
    0 with no steps."""
    check(noise_multiplier, delta)
    s = Sampling.make(sampling, sample_rate, num_examples, batch_size)
    steps = _steps(s, steps, epochs)
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    acc = make_accountant(accountant, s)
    acc.compose(dp_event(float(noise_multiplier), steps, s))
    return float(acc.get_epsilon(delta))


def _steps(s: Sampling, steps, epochs) -> int:
    if (steps is None) == (epochs is None):
        raise ValueError("give exactly one of steps and epochs")
    if epochs is not None:
        if epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {epochs!r}")
        return s.steps_for_epochs(epochs)
    if steps < 0 or not float(steps).is_integer():
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    return int(steps)


def noise_for_epsilon(target_epsilon: float, delta: float, *, epochs: float | None = None,
                      steps: int | None = None, sample_rate: float | None = None,
                      num_examples: int | None = None, batch_size: float | None = None,
                      sampling: str = "poisson", accountant: str = "rdp",
                      rtol: float = 1e-3) -> float:
    """The smallest noise multiplier (to relative tolerance ``rtol``) whose
    epsilon at ``delta`` after the planned ``epochs`` (or ``steps``) is at most
    ``target_epsilon``: ``epsilon(noise_for_epsilon(e, ...), ...) <= e``.
    Epsilon falls as the noise grows, so a bracket then bisection in
    ``log sigma`` finds it (for PLD, started from the RDP answer, an upper
    bound, since each PLD evaluation takes seconds at small noise)."""
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon!r}")
    s = Sampling.make(sampling, sample_rate, num_examples, batch_size)
    n_steps = _steps(s, steps, epochs)
    if n_steps == 0:
        raise ValueError("no steps planned: any noise multiplier meets the target")

    def eps(sigma):
        return epsilon(sigma, delta, steps=n_steps, sample_rate=s.rate,
                       num_examples=s.num_examples, batch_size=s.batch_size,
                       sampling=s.kind, accountant=accountant)

    start = 1.0
    if accountant == "pld":  # PLD's epsilon is below RDP's bound: start from RDP's answer
        start = noise_for_epsilon(target_epsilon, delta, steps=n_steps, sample_rate=s.rate,
                                  num_examples=s.num_examples, batch_size=s.batch_size,
                                  sampling=s.kind, accountant="rdp", rtol=rtol)
    lo, hi = start, start
    e_lo = e_hi = eps(start)
    while e_hi > target_epsilon:
        lo, e_lo, hi = hi, e_hi, hi * 2.0
        if hi > 1e6:
            raise ValueError(f"no noise multiplier up to 1e6 reaches epsilon "
                             f"{target_epsilon} at delta {delta}")
        e_hi = eps(hi)
    while e_lo <= target_epsilon:
        hi, e_hi, lo = lo, e_lo, lo / 1.5
        if lo < 1e-3:
            return hi
        e_lo = eps(lo)
    last = None
    while hi / lo > 1.0 + rtol:
        # interpolate log epsilon in log sigma; bisect when one end moved twice
        t, a, b = math.log(target_epsilon), math.log(e_lo), math.log(max(e_hi, 1e-300))
        frac = (a - t) / (a - b) if a > b else 0.5
        frac = min(max(frac, 0.1), 0.9) if last != "same" else 0.5
        mid = lo * (hi / lo) ** frac
        e_mid = eps(mid)
        side = "hi" if e_mid <= target_epsilon else "lo"
        last = "same" if side == last else side
        if side == "hi":
            hi, e_hi = mid, e_mid
        else:
            lo, e_lo = mid, e_mid
    return hi
    while hi / lo > 1.0 + rtol:
        mid = math.sqrt(lo * hi)
        if eps(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return hi


def statement(noise_multiplier: float, delta: float, *, steps: int | None = None,
              epochs: float | None = None, sample_rate: float | None = None,
              num_examples: int | None = None, batch_size: float | None = None,
              sampling: str = "poisson", accountants=("rdp", "pld")) -> str:
    """A privacy statement in the style of TensorFlow Privacy's
    ``compute_dp_sgd_privacy_statement``: the sampler, rate and steps, then
    epsilon at ``delta`` by each accountant that applies."""
    s = Sampling.make(sampling, sample_rate, num_examples, batch_size)
    n_steps = _steps(s, steps, epochs)
    how = ("Poisson sampling (each example in each step's batch independently with "
           f"probability q = {s.rate:.6g}"
           + (f", expected batch size {s.batch_size:.6g}" if s.batch_size else "") + ")"
           if s.kind == "poisson" else
           f"fixed-size batches of {s.batch_size} drawn without replacement, fresh each "
           f"step (q = {s.rate:.6g})")
    data = f"{s.num_examples} examples, " if s.num_examples else ""
    lines = [f"DP-SGD over {data}{how}, {n_steps} steps "
             f"({n_steps * s.rate:.4g} epochs), noise multiplier {noise_multiplier:g}.",
             "The guarantee covers every intermediate model (all checkpoints) as well as "
             "the final one.",
             "Example-level DP with "
             f"{'add-or-remove-one' if s.kind == 'poisson' else 'replace-one'}"
             f" adjacency at delta = {delta:g}:"]
    for name in accountants:
        if s.kind == "fixed" and name == "pld":
            continue
        e = epsilon(noise_multiplier, delta, steps=n_steps, sample_rate=s.rate,
                    num_examples=s.num_examples, batch_size=s.batch_size,
                    sampling=s.kind, accountant=name)
        lines.append(f"    epsilon by {name.upper()} accounting: {e:.3f}")
    return "\n".join(lines)
