"""Multiply-adds of a K-FAC step, counted at registration, per layer and block.

For layer ``l`` with uses ``u`` (output ``s_u``, static shape; an unknown
axis counts as the batch ``B`` if leading, else 1), ``W`` its first variable
and ``C`` the output's last axis (channels last):

- ``forward``: ``sum_u |s_u| * |W| / C`` (dense ``d_in``, conv ``k k c_in``,
  depthwise ``k k``); ``|s_u|`` for scale-and-shift and embedding layers,
  ``B |W|`` for generic ones. The backward pass counts twice the forward,
  so an SGD step is ``3 F`` with ``F`` the sum over layers;
- ``statistics`` (a covariance update): per Kronecker factor of dimension
  ``d`` (``g`` groups; ``g d`` if diagonal, ``d k`` in diagonal blocks of
  ``k``), ``rows * g d^2`` with ``rows =
  sum_u |s_u| / C`` (examples times locations), the output factor once per
  source ``S`` (samples, or the ``K`` Fisher columns in exact mode); a block
  fed per-example gradients ``B n^2`` (``B n`` diagonal), ``n`` its
  parameters; plus one more backward pass per source (``2 F S``);
- ``precondition``: ``g (d_A^2 d_G + d_A d_G^2)`` per Kronecker block (a
  diagonal factor's side ``d_A d_G``, a block-diagonal one's ``d_A k d_G``);
  ``n^2`` or ``n`` otherwise;
- ``inverse`` (one refresh): ``g d^3`` per dense factor (Cholesky and
  triangular inverse), ``d`` diagonal, ``c k^3`` in ``c`` blocks of ``k``;
  ``n^3`` for a full block (the same inverse), ``n`` diagonal; each dense
  factorisation's count divided by ``FACTORISATION_RATE`` (they run at a
  fraction of a matrix product's rate).

A block that sums Kronecker terms over the same two sides and inverts the
sum jointly (``kronecker_terms()``: ``[(left, right)]`` factor pairs, a tied
embedding's ``[V]``/``[V, V]`` by ``[D, D]``): statistics ``rows * S *
sum(side(f))`` over all its factors (each counted on all the layer's rows:
a bound), preconditioning two products per side, ``2 (side_L d_R + d_L
side_R)`` (a side is diagonal only if all its factors are), and a refresh
``4 (cube_L + 2 cube_R)`` (the eigendecompositions of the simultaneous
diagonalisation; a dense side's cube over ``FACTORISATION_RATE``).

The step (``step_multiply_adds``): ``3 F`` + statistics / cov period +
preconditioning + inverses / inverse period, plus the quadratic model's two
exact Fisher-vector products (``2 * 4 F``: a double backward each; on a
share ``f < 1`` of the batch ``f (2 * 4 + 1) F``, their forward pass
included) or two K-FAC products (``2 *`` preconditioning), and the damping
rule's forward pass every ``damping_adaptation_interval`` steps. Spread
covariances (``covariance_slices.py``) take a slice of ``n = ceil(B / P)``
of the ``B`` examples every step: the statistics and the slice's own forward
pass count ``n / B`` of a batch's each step, not ``1 / P`` (a period longer
than the batch still takes one example a step; ``B`` unknown: ``1 / P``).
With a slice every ``s`` steps (``s`` divides ``P``), ``n = ceil(B s / P)``
and they count ``n / (s B)``; the budget takes the largest stride whose
slice steps stay within ``SLICE_STEP_SHARE`` of a step (``choose_stride``):
fewer, larger slices use the machine better than many small ones.
Operations between the
layers (activations, normalisers, the loss) and memory traffic are not
counted: the ratio is the arithmetic's (factorisations weighted by their
rate), a floor on the time's.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

import passes.ir
from kfac_graph.layers import dense
from kfac_graph.optimizer import covariance_slices

# spread covariances take a slice every ``s`` steps, the largest ``s`` whose
# slice steps count at most this share of a step more than the others (the
# 99th-percentile step at most 1.5x the median one)
SLICE_STEP_SHARE = 0.5
# the periods ``choose_periods`` considers (the inverse period first), smallest first
COV_PERIODS = (1, 2, 5, 10, 20, 50, 100)
INVERSE_PERIODS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
EIGEN_FACTOR = 4  # an eigendecomposition against a Cholesky inverse, per n^3
# A dense factorisation (Cholesky and its triangular solves, or an
# eigendecomposition) ran at a half to a quarter of a matrix product's rate per
# multiply-add on the CPUs measured (README, "Cold start and scale"): its count
# is divided by this rate, so that the budget weighs a refresh by its time. At
# 0.5 a refresh of every block measured 1.2-1.6x its count on ResNet50 and
# 1.3x on BERT-small (``benchmarks/factor_blocks.py``).
FACTORISATION_RATE = 0.35


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """Multiply-adds of one layer (module docstring)."""

    name: str
    forward: float
    statistics: float
    precondition: float
    inverse: float


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What the step does besides the periods: ``sources`` of the statistics'
    backward pass, ``qmodel`` (``"exact"``, ``"kfac"`` or None), the share of
    the batch the exact forms run on (``qmodel_fraction``; below 1 with a
    forward pass of their own), the damping rule's interval (None: no
    adaptation) and whether the covariances are spread over the period
    (``spread``: a slice's forward pass of its own every ``slice_stride``
    steps, ``batch`` examples cut into slices; None: unknown)."""

    sources: int = 1
    qmodel: str | None = "exact"
    qmodel_fraction: float = 1.0
    damping_interval: int | None = 5
    spread: bool = False
    batch: int | None = None
    slice_stride: int = 1


def layer_costs(registration, blocks, batch: int, sources: int = 1,
                factor_block_size: int | None = None) -> list:
    """A ``LayerCost`` per registered layer (aligned with ``blocks``);
    ``factor_block_size``: counted as if the blocks had been made with it
    (their factors in the layouts ``factor.blocks_for`` gives), else as they are."""
    out = []
    for layer, block in zip(registration.layers, blocks):
        forward, rows = _forward(registration, layer, batch)
        stats, pre, inv = _block_costs(block, rows, batch, sources, factor_block_size)
        out.append(LayerCost(layer.name, forward, stats + 2.0 * forward * sources, pre, inv))
    return out


def _forward(registration, layer, batch):
    """``(forward multiply-adds, rows)`` of one layer over its uses."""
    kernels = layer.variables[:dense.kernel_variables(layer)] if layer.kind == "dense" else \
        layer.variables[:1]
    size = float(sum(np.prod([int(d) for d in v.shape]) for v in kernels))
    forward = rows = 0.0
    for output in layer.outputs:
        shape = static_shape(registration, output) or ()
        dims = [d if d is not None else (batch if i == 0 else 1) for i, d in enumerate(shape)]
        numel = float(np.prod(dims)) if dims else 1.0
        width = float(dims[-1]) if dims else 1.0
        rows += numel / max(width, 1.0)
        if layer.kind in ("scale_and_shift", "embedding"):
            forward += numel
        elif layer.kind == "generic":
            forward += batch * size
        else:
            forward += numel * size / max(width, 1.0)
    if not layer.outputs:
        forward, rows = batch * size, float(batch)
    return forward, rows


def static_shape(registration, tensor):
    """A tensor's static shape in the registration's IR (None if unknown)."""
    if registration.ir is None or not tensor:
        return None
    return passes.ir.shape_of(registration.ir, tensor)


def _factors(block):
    """The block's Kronecker factors ``(input, output)``, or None."""
    a, g = getattr(block, "input_factor", None), getattr(block, "output_factor", None)
    return (a, g) if a is not None and g is not None else None


def _block_costs(block, rows, batch, sources, block_size=None):
    """``(statistics, precondition, inverse)`` of one block (module docstring)."""
    inner = getattr(block, "block", None)
    if inner is not None:
        return _block_costs(inner, rows, batch, sources, block_size)
    parts = getattr(block, "parts", None)
    if parts is not None:
        totals = [_block_costs(p, rows, batch, sources, block_size) for p in parts]
        return tuple(float(sum(t[i] for t in totals)) for i in range(3))
    terms = getattr(block, "kronecker_terms", None)
    if terms is not None:
        return _kron_sum_costs(terms(), rows, sources)
    kron = _factors(block)
    if kron is not None:
        a, g = kron
        if block_size is not None and getattr(block, "takes_factor_blocks", False):
            la, lg = a.blocks_for(block_size), g.blocks_for(block_size)
        else:
            la, lg = a.blocks, g.blocks
        groups = float(np.prod(a.batch_shape)) if a.batch_shape else 1.0
        stats = rows * groups * (_side(a, la) + sources * _side(g, lg))
        pre = groups * (_side(a, la) * g.dim + a.dim * _side(g, lg))
        inv = groups * (_cube(a, la) + _cube(g, lg))
        return float(stats), float(pre), float(inv)
    n = float(block.num_params)
    factor = getattr(block, "factor", None)
    if factor is not None and getattr(factor, "diagonal", False):
        return batch * n * sources, n, n
    return batch * n * n * sources, n * n, _factorisation(n)


def _side(factor, blocks=None):
    """Entries of one factor kept (and multiply-adds of its product with a
    vector): ``d`` diagonal, ``d k`` in ``blocks`` of ``k``, ``d^2`` full."""
    if blocks is not None:
        return factor.dim * blocks.size
    return factor.dim if factor.diagonal else factor.dim ** 2


def _cube(factor, blocks=None):
    """A refresh's multiply-adds: ``d`` diagonal, ``c k^3`` in ``c`` blocks of ``k``, ``d^3``."""
    if blocks is not None:
        return blocks.count * _factorisation(blocks.size)
    return factor.dim if factor.diagonal else _factorisation(factor.dim)


def _factorisation(d):
    """A dense ``d x d`` factorisation's count: ``d^3`` at ``FACTORISATION_RATE``."""
    return d ** 3 / FACTORISATION_RATE


def _kron_sum_costs(terms, rows, sources):
    """``(statistics, precondition, inverse)`` of a jointly inverted sum of
    Kronecker terms (module docstring)."""
    stats = rows * sources * sum(_side(f) for pair in terms for f in pair)
    dims, sides, cubes = [], [], []
    for k in range(2):
        factors = [pair[k] for pair in terms]
        diagonal = all(f.diagonal for f in factors)
        dim = factors[0].dim
        dims.append(dim)
        sides.append(dim if diagonal else dim ** 2)
        cubes.append(dim if diagonal else _factorisation(dim))
    pre = 2 * (sides[0] * dims[1] + dims[0] * sides[1])
    inv = EIGEN_FACTOR * (cubes[0] + 2 * cubes[1])
    return float(stats), float(pre), float(inv)


def step_multiply_adds(costs, cov_period: int, inverse_period: int,
                       options: StepOptions = StepOptions()) -> float:
    """The amortised multiply-adds of one K-FAC step (module docstring)."""
    f = sum(c.forward for c in costs)
    pre = sum(c.precondition for c in costs)
    share = covariance_share(cov_period, options)
    total = 3 * f + sum(c.statistics for c in costs) * share + pre
    if options.spread and cov_period > 1:
        total += f * share  # the slice's forward pass
    total += sum(c.inverse for c in costs) / inverse_period
    if options.qmodel == "exact":
        part = options.qmodel_fraction
        total += 2 * 4 * f * part + (f * part if part < 1 else 0.0)
    elif options.qmodel == "kfac":
        total += 2 * pre
    if options.damping_interval:
        total += f / options.damping_interval
    return total


def covariance_share(cov_period: int, options: StepOptions = StepOptions()) -> float:
    """The share of a batch's statistics one step pays on average: ``1 / P``,
    or spread over a known batch ``B > 1`` with stride ``s``, ``n / (s B)``
    with ``n = ceil(B s / P)`` (module docstring)."""
    if _sliced(cov_period, options):
        return slice_examples(cov_period, options) / (options.slice_stride * options.batch)
    return 1.0 / cov_period


def _sliced(cov_period: int, options: StepOptions) -> bool:
    """Whether the covariances are spread in slices of a known batch ``B > 1``."""
    return bool(options.spread and cov_period > 1 and options.batch and options.batch > 1)


def slice_examples(cov_period: int, options: StepOptions) -> int:
    """``n``: the examples of one spread slice (``covariance_slices.py``: the
    ``P / s`` slice steps of a period share the batch)."""
    return covariance_slices.slice_size(options.batch, cov_period // options.slice_stride)


def slice_strides(cov_period: int) -> list:
    """The strides a spread period may take: its divisors below it, largest first."""
    return [s for s in range(cov_period - 1, 0, -1) if cov_period % s == 0]


def choose_stride(costs, cov_period: int, inverse_period: int, options: StepOptions) -> int:
    """The largest of ``slice_strides(P)`` up to the inverse period (a slice
    lands between two refreshes of a block) whose slice steps count at most
    ``SLICE_STEP_SHARE`` of the amortised step more than the steps between
    them (a slice's statistics and forward pass, ``(S + F) n / B``), so that
    no step is more than 1.5x the others; 1 if none is (or not spread)."""
    if not _sliced(cov_period, options):
        return 1
    f = sum(c.forward for c in costs)
    stats = sum(c.statistics for c in costs)
    for stride in [s for s in slice_strides(cov_period) if s <= inverse_period]:
        at = dataclasses.replace(options, slice_stride=stride)
        spike = (stats + f) * slice_examples(cov_period, at) / options.batch
        if spike <= SLICE_STEP_SHARE * step_multiply_adds(costs, cov_period, inverse_period, at):
            return stride
    return 1


def sgd_multiply_adds(costs) -> float:
    """An SGD step: forward and backward, ``3 F``."""
    return 3 * sum(c.forward for c in costs)


@dataclasses.dataclass(frozen=True)
class PeriodChoice:
    """The periods ``choose_periods`` picked and the counted ratio they give
    (``within``: whether it is at most the budget); ``factor_block_size``:
    the block size the budget picked for the factors (None: none);
    ``qmodel_batch_fraction``: the share of the batch it picked for the
    quadratic model's exact forms (None: none picked); ``slice_stride``: the
    steps between spread slices (``choose_stride``)."""

    cov_update_period: int
    inverse_update_period: int
    ratio: float
    budget: float
    within: bool
    factor_block_size: int | None = None
    qmodel_batch_fraction: float | None = None
    slice_stride: int = 1


def choose_periods(costs, budget: float, options: StepOptions = StepOptions(),
                   given: tuple = (None, None)) -> PeriodChoice:
    """The smallest inverse period, then the smallest covariance period, from
    ``INVERSE_PERIODS`` x ``COV_PERIODS`` whose amortised step is at most
    ``budget`` SGD steps; if none is, the cheapest pair (``within`` False).
    ``given``: ``(cov, inverse)`` periods fixed by the caller (None: free).
    Without spread covariances the inverse period is a multiple of the
    covariance period (a refresh between two updates would see the same
    factors); spread, every step updates them and any pair may be taken.

    The inverse period comes first because fresh inverses bought more
    progress per step than fresh statistics (README, "Cold start and scale":
    on the digits models of ``benchmarks/convergence.py``, covariances every
    50 steps with inverses every 5 reached Adam's loss in fewer steps than
    covariances every 5 with inverses every 50); with the adapted damping a
    refresh is also when a block takes up a new damping."""
    sgd = sgd_multiply_adds(costs)
    covs = COV_PERIODS if given[0] is None else (given[0],)
    inverses = INVERSE_PERIODS if given[1] is None else (given[1],)
    every = [(c, i) for i in inverses for c in covs]
    pairs = [(c, i) for c, i in every if options.spread or i % c == 0] or every
    priced = []  # (cov, inverse, stride, ratio), in the order tried
    for c, i in pairs:
        stride = choose_stride(costs, c, i, options)
        step = step_multiply_adds(costs, c, i, dataclasses.replace(options, slice_stride=stride))
        priced.append((c, i, stride, step / sgd if sgd else math.inf))
    first = next((p for p in priced if p[3] <= budget), None)
    c, i, stride, ratio = first or min(priced, key=lambda p: (p[3], p[1]))
    return PeriodChoice(c, i, ratio, budget, first is not None, slice_stride=stride)


def balanced_slots(weights, period: int) -> tuple:
    """A slot in ``range(period)`` per weight (a block's inverse cost) such
    that the slots' totals are balanced: the heaviest first, each into the
    slot with the least so far (ties: the lowest slot)."""
    totals = [0.0] * period
    slots = [0] * len(weights)
    for index in sorted(range(len(weights)), key=lambda k: (-weights[k], k)):
        slot = min(range(period), key=lambda s: (totals[s], s))
        slots[index] = slot
        totals[slot] += weights[index]
    return tuple(slots)


def summary(costs, choice: PeriodChoice | None, cov_period: int, inverse_period: int,
            options: StepOptions = StepOptions()) -> str:
    """A table of the per-layer counts and the step's ratio over SGD."""
    lines = [f"{'layer':<40} {'forward':>10} {'statistics':>11} {'precondition':>13} "
             f"{'inverse':>10}"]
    for c in costs:
        lines.append(f"{c.name[:40]:<40} {c.forward:>10.3g} {c.statistics:>11.3g} "
                     f"{c.precondition:>13.3g} {c.inverse:>10.3g}")
    ratio = step_multiply_adds(costs, cov_period, inverse_period, options) / max(
        sgd_multiply_adds(costs), 1.0)
    spread = (f" (spread: a slice every {options.slice_stride} steps)"
              if options.spread and cov_period > 1 else "")
    lines.append(f"cov_update_period={cov_period}{spread}, inverse_update_period="
                 f"{inverse_period}: counted step / SGD step = {ratio:.2f}")
    if choice is not None:
        verdict = "within" if choice.within else "NOT within (the largest periods tried)"
        blocks = (f", factors in diagonal blocks of at most {choice.factor_block_size}"
                  if choice.factor_block_size else "")
        if choice.qmodel_batch_fraction:
            blocks += f", exact forms on {choice.qmodel_batch_fraction:g} of the batch"
        lines.append(f"overhead_budget={choice.budget:g}: periods{blocks} chosen by the "
                     f"budget, {verdict}")
    return "\n".join(lines)
