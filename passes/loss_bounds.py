"""Bounds a loss's terms cannot leave, read from the graph by interval arithmetic.

``interval(g, tensor) -> (lo, hi)``: every element of ``tensor`` lies in
``[lo, hi]`` whatever the arguments and variables hold (``-inf``/``inf``
where nothing is known). Each op maps its inputs' intervals to its output's:
constants give their least and greatest values; monotone functions map the
ends (``exp``, ``log``, ``sigmoid``, ``relu``, ``softplus``, ``sqrt``, a
negation swaps them); ``square`` and ``abs`` are ``>= 0``; sums, products
and quotients follow interval arithmetic (a quotient only by an interval
that excludes 0, or ``DivNoNan`` by one ``>= 0``); a sum along axes keeps
the sign, a mean or maximum the interval; shape ops pass it through.
Anything else (a matmul, a convolution, an argument) is unbounded.

Two refinements make the usual losses provable:

- a select on a comparison ``where(u <= c, a, b)`` bounds ``a`` with ``u``
  at most ``c`` and ``b`` with ``u`` at least ``c`` (Keras's Huber loss:
  ``delta |e| - delta^2 / 2 >= delta^2 / 2`` where ``|e| > delta``);
- ``x - min(x, c)`` and ``max(x, c) - x`` are ``>= 0`` (tf.compat.v1's Huber).

Contract: ``nonnegative(g, tensors)``: whether every tensor is ``>= 0``
(``(tensor, sign)`` pairs read the tensor times ``sign``). The quadratic
model's cap needs the loss's terms ``>= 0`` (``kfac_graph.optimizer.qmodel``):
mean absolute error, Huber, hinge, focal and log-error losses are; a
Poisson or KL loss on unnormalised targets, a cosine similarity and Keras's
``log_cosh`` (``x + softplus(-2x) - log 2``) are not proven, and keep no cap.
"""
from __future__ import annotations

import math

import networkx as nx
import numpy as np

from passes import ir

UNKNOWN = (-math.inf, math.inf)
_SAME = frozenset({
    "Identity", "Snapshot", "StopGradient", "PreventGradient", "Reshape", "ExpandDims",
    "Squeeze", "Transpose", "StridedSlice", "Slice", "Tile", "BroadcastTo", "Max", "Min",
    "Mean", "GatherV2", "Gather", "GatherNd", "ReverseV2", "Roll", "EnsureShape",
    "CheckNumerics"})
# ops whose values are some of their inputs': which inputs
_JOINS = {"Pack": slice(None), "ConcatV2": slice(None, -1), "Concat": slice(1, None)}
_INCREASING = {
    "Exp": math.exp, "Expm1": math.expm1, "Log": lambda v: math.log(v) if v > 0 else -math.inf,
    "Log1p": lambda v: math.log1p(v) if v > -1 else -math.inf,
    "Sqrt": lambda v: math.sqrt(max(v, 0.0)), "Sigmoid": lambda v: _sigmoid(v),
    "Tanh": math.tanh, "Relu": lambda v: max(v, 0.0), "Relu6": lambda v: min(max(v, 0.0), 6.0),
    "Softplus": lambda v: _softplus(v), "Erf": math.erf, "Atan": math.atan,
    "Softsign": lambda v: v / (1 + abs(v)) if math.isfinite(v) else math.copysign(1.0, v),
    "Elu": lambda v: v if v > 0 else math.expm1(v), "Floor": math.floor, "Ceil": math.ceil,
    "Round": round, "Rint": round, "Sign": lambda v: float(np.sign(v))}
_FIXED = {"Softmax": (0.0, 1.0), "LogSoftmax": (-math.inf, 0.0), "L2Loss": (0.0, math.inf),
          "EuclideanNorm": (0.0, math.inf), "ZerosLike": (0.0, 0.0), "OnesLike": (1.0, 1.0),
          "Cosh": (1.0, math.inf), "SquaredDifference": (0.0, math.inf),
          "Size": (0.0, math.inf), "Shape": (0.0, math.inf)}
_COMPARE = {"Less": False, "LessEqual": False, "Greater": True, "GreaterEqual": True}


def nonnegative(g: nx.DiGraph, tensors) -> bool:
    """Whether each of ``tensors`` (a name, or ``(name, sign)``) is ``>= 0``
    times its sign for any input (module docstring)."""
    pairs = [(t, 1.0) if isinstance(t, str) or t is None else t for t in tensors]
    if any(t is None for t, _ in pairs):
        return False
    for tensor, sign in pairs:
        lo, hi = interval(g, tensor)
        if not (lo >= 0 if sign > 0 else hi <= 0):
            return False
    return True


def interval(g: nx.DiGraph, tensor: str) -> tuple[float, float]:
    """``(lo, hi)`` bounding every element of ``tensor`` (module docstring)."""
    tensor = ir.resolve(g, tensor)
    node = ir.split_tensor(tensor)[0]
    if node not in g:
        return UNKNOWN
    return _Bounds(g).of(tensor, nx.ancestors(g, node) | {node})


class _Bounds:
    """Intervals of the tensors ``of`` is asked for, each op's from its
    inputs', in topological order; ``given`` overrides a tensor's (a
    select's branch, where its comparison holds)."""

    def __init__(self, g, given=None):
        self.g, self.given, self.known = g, dict(given or {}), {}

    def of(self, tensor, nodes):
        for node in nx.topological_sort(self.g.subgraph(nodes)):
            if ir.tensor_name(node) not in self.known:
                value = self._op(node)
                name = ir.tensor_name(node)
                self.known[name] = _meet(value, self.given[name]) if name in self.given else value
        return self._in(tensor)

    def _in(self, t):
        node, index = ir.split_tensor(t)
        if index != 0:
            return UNKNOWN
        return self.known.get(ir.tensor_name(node), UNKNOWN)

    def _op(self, node):
        d = self.g.nodes[node]
        op, inputs = d["op"], [t for t in d["inputs"] if not t.startswith("^")]
        value = ir.const_value(self.g, ir.tensor_name(node))
        if value is not None:
            values = np.asarray(value)
            if values.size and values.dtype.kind in "biuf" and np.all(np.isfinite(values)):
                return float(values.min()), float(values.max())
            return UNKNOWN
        if op in _FIXED:
            return _FIXED[op]
        ins = [self._in(t) for t in inputs]
        if op in _SAME and ins:
            return ins[0]
        if op in _JOINS and ins[_JOINS[op]]:
            data = ins[_JOINS[op]]
            return min(v[0] for v in data), max(v[1] for v in data)
        if op == "Cast":
            return (0.0, 1.0) if d["attrs"].get("DstT") == "bool" else ins[0]
        if op in _INCREASING:
            f = _INCREASING[op]
            return _safe(f, ins[0][0], -math.inf), _safe(f, ins[0][1], math.inf)
        if op == "Neg":
            return -ins[0][1], -ins[0][0]
        if op in ("Square", "Abs"):
            lo, hi = _abs(ins[0])
            return (lo * lo, hi * hi) if op == "Square" else (lo, hi)
        if op in ("Add", "AddV2", "BiasAdd", "AddN"):
            return sum(v[0] for v in ins), sum(v[1] for v in ins)
        if op == "Sub":
            lo, hi = ins[0][0] - ins[1][1], ins[0][1] - ins[1][0]
            return (max(lo, 0.0), hi) if self._sub_nonnegative(inputs) else (lo, hi)
        if op == "Mul" and inputs[0] == inputs[1]:
            lo, hi = _abs(ins[0])
            return lo * lo, hi * hi
        if op == "Mul":
            return _product(ins[0], ins[1])
        if op in ("RealDiv", "Div", "DivNoNan", "Reciprocal", "Inv", "Rsqrt"):
            return self._quotient(op, ins)
        if op in ("Maximum", "Minimum"):
            pick = max if op == "Maximum" else min
            return pick(ins[0][0], ins[1][0]), pick(ins[0][1], ins[1][1])
        if op == "ClipByValue":
            lo = min(max(ins[0][0], ins[1][0]), ins[2][0])
            return lo, min(max(ins[0][1], ins[1][1]), ins[2][1])
        if op in ("Select", "SelectV2"):
            return self._select(inputs, ins)
        if op in ("Sum", "Prod", "Cumsum"):
            lo, hi = ins[0]
            if op == "Prod":
                return (0.0, math.inf) if lo >= 0 else UNKNOWN
            return (0.0 if lo >= 0 else -math.inf), (0.0 if hi <= 0 else math.inf)
        if op == "Pow":
            return (0.0, math.inf) if ins[0][0] >= 0 or _even(ins[1]) else UNKNOWN
        if op in ("Xlogy", "Xlog1py"):
            log = _INCREASING["Log" if op == "Xlogy" else "Log1p"]
            logs = (_safe(log, ins[1][0], -math.inf), _safe(log, ins[1][1], math.inf))
            return _product(ins[0], logs)
        if op == "Fill":
            return ins[1]
        return UNKNOWN

    def _sub_nonnegative(self, inputs):
        """``x - min(x, c)`` or ``max(x, c) - x``."""
        a, b = (ir.split_tensor(ir.resolve(self.g, t))[0] for t in inputs)
        da, db = self.g.nodes[a], self.g.nodes[b]
        return (db["op"] == "Minimum" and inputs[0] in db["inputs"]) or (
            da["op"] == "Maximum" and inputs[1] in da["inputs"])

    def _quotient(self, op, ins):
        if op in ("Reciprocal", "Inv"):
            return _product((1.0, 1.0), _reciprocal(ins[0]))
        if op == "Rsqrt":
            lo, hi = ins[0]
            return (_safe(lambda v: 1 / math.sqrt(v), hi, 0.0), math.inf if lo <= 0
                    else 1 / math.sqrt(lo)) if lo >= 0 else UNKNOWN
        if op == "DivNoNan" and ins[1][0] >= 0:  # x / y, 0 where y == 0
            lo, hi = _product(ins[0], (0.0, math.inf))
            return min(lo, 0.0), max(hi, 0.0)
        return _product(ins[0], _reciprocal(ins[1]))

    def _select(self, inputs, ins):
        """The union of the branches, each bounded where its condition holds."""
        condition = ir.split_tensor(ir.resolve(self.g, inputs[0]))[0]
        d = self.g.nodes[condition]
        if d["op"] not in _COMPARE:
            return min(ins[1][0], ins[2][0]), max(ins[1][1], ins[2][1])
        u, v = (ir.resolve(self.g, t) for t in d["inputs"][:2])
        if _COMPARE[d["op"]]:
            u, v = v, u  # u > v is v < u
        iu, iv = self._in(u), self._in(v)
        branches = []
        # true: u <= v, so u <= hi(v) and v >= lo(u); false: u >= lo(v), v <= hi(u)
        for branch, given in ((inputs[1], {u: (iu[0], min(iu[1], iv[1])),
                                           v: (max(iv[0], iu[0]), iv[1])}),
                              (inputs[2], {u: (max(iu[0], iv[0]), iu[1]),
                                           v: (iv[0], min(iv[1], iu[1]))})):
            given = {_zero(t): b for t, b in given.items() if ir.split_tensor(t)[1] == 0}
            branches.append(self._under(branch, given))
        return min(b[0] for b in branches), max(b[1] for b in branches)

    def _under(self, tensor, given):
        """``tensor``'s interval with ``given`` tensors bounded as given: the
        ops between them and ``tensor`` computed again where each reads the
        same elements (elementwise ops alone: a reduction of ``u`` also reads
        elements where the comparison fails), the rest as known."""
        node = ir.split_tensor(tensor)[0]
        sources = {ir.split_tensor(t)[0] for t in given}
        between = (nx.ancestors(self.g, node) | {node}) & _elementwise_reach(self.g, sources)
        branch = _Bounds(self.g, {**self.given, **given})
        branch.known = {k: v for k, v in self.known.items()
                        if ir.split_tensor(k)[0] not in between}
        for name, bound in given.items():
            if name in branch.known:
                branch.known[name] = _meet(branch.known[name], bound)
        return branch.of(tensor, between | {node})


def _elementwise_reach(g, sources):
    """``sources`` and the ops reached from them through elementwise ops alone."""
    seen, stack = set(sources), list(sources)
    while stack:
        for nxt in g.successors(stack.pop()):
            if nxt not in seen and g.nodes[nxt]["op"] in ir.ELEMENTWISE:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def _zero(tensor):
    node, _ = ir.split_tensor(tensor)
    return ir.tensor_name(node)


def _meet(a, b):
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo <= hi else a  # an empty branch: no refinement


def _safe(f, v, default):
    try:
        out = float(f(v))
    except (ValueError, OverflowError):
        return default
    return default if math.isnan(out) else out


def _sigmoid(v):
    return 0.0 if v == -math.inf else 1.0 if v == math.inf else 1 / (1 + math.exp(-v)) \
        if v > -700 else 0.0


def _softplus(v):
    return v if v > 30 else 0.0 if v < -700 else math.log1p(math.exp(v))


def _abs(i):
    lo, hi = i
    if lo >= 0:
        return lo, hi
    if hi <= 0:
        return -hi, -lo
    return 0.0, max(-lo, hi)


def _times(a, b):
    return 0.0 if a == 0 or b == 0 else a * b


def _product(a, b):
    corners = [_times(x, y) for x in a for y in b]
    return min(corners), max(corners)


def _reciprocal(i):
    lo, hi = i
    if lo > 0 or hi < 0:
        return (1 / hi if hi != 0 else -math.inf), (1 / lo if lo != 0 else math.inf)
    if lo == 0 and hi > 0:
        return 1 / hi if math.isfinite(hi) else 0.0, math.inf
    return UNKNOWN


def _even(i):
    return i[0] == i[1] and float(i[0]).is_integer() and int(i[0]) % 2 == 0
