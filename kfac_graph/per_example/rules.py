"""The registry of per-example gradient rules, keyed by layer kind.

A rule is any object with

    per_example_grads(uses, spec) -> list of [B, *var.shape] tensors
        (kernel or scale first, then bias or shift, as `spec` says)
    squared_norms(uses, spec)     -> [B], the squared norm of each example's
        gradient over all of the layer's variables

where `uses` is one `(a, g)` pair or a sequence of them (one per application
of the weights; see `kfac_graph/layers/uses.py`) and `spec` is the kind's frozen spec.

`RuleRegistry` is an immutable value: `with_rule` returns an extended copy, so
a user adds a kind (or overrides one) without touching this package and
without global state:

    reg = default_registry().with_rule("my_kind", MyRule())
    grads = reg.per_example_grads("my_kind", (a, g), my_spec)
"""

import dataclasses
import types
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from kfac_graph import layers


@runtime_checkable
class PerExampleRule(Protocol):
    """What a registry entry must provide (see the module docstring)."""

    def per_example_grads(self, uses, spec) -> Sequence[Any]: ...

    def squared_norms(self, uses, spec) -> Any: ...


class RuleRegistry:
    """An immutable mapping from layer kind to `PerExampleRule`."""

    __slots__ = ("_rules",)

    def __init__(self, rules: Mapping[str, PerExampleRule] = ()):
        rules = dict(rules)
        for kind, rule in rules.items():
            if not isinstance(rule, PerExampleRule):
                raise TypeError(f"rule for {kind!r} lacks per_example_grads / squared_norms")
        object.__setattr__(self, "_rules", types.MappingProxyType(rules))

    def __setattr__(self, name, value):
        raise AttributeError("RuleRegistry is immutable; use with_rule")

    def with_rule(self, kind: str, rule: PerExampleRule) -> "RuleRegistry":
        """A copy with `rule` registered for `kind` (replacing any previous)."""
        return RuleRegistry({**self._rules, kind: rule})

    def without(self, kind: str) -> "RuleRegistry":
        """A copy without `kind`."""
        return RuleRegistry({k: r for k, r in self._rules.items() if k != kind})

    @property
    def kinds(self):
        return tuple(self._rules)

    def __contains__(self, kind):
        return kind in self._rules

    def __getitem__(self, kind) -> PerExampleRule:
        try:
            return self._rules[kind]
        except KeyError:
            raise KeyError(
                f"no per-example rule for layer kind {kind!r}; known: {sorted(self._rules)}"
            ) from None

    def __repr__(self):
        return f"RuleRegistry({dict(self._rules)!r})"

    def per_example_grads(self, kind, uses, spec):
        """`self[kind].per_example_grads(uses, spec)`."""
        return list(self[kind].per_example_grads(uses, spec))

    def squared_norms(self, kind, uses, spec):
        """`self[kind].squared_norms(uses, spec)`."""
        return self[kind].squared_norms(uses, spec)


def default_registry(xla=None) -> RuleRegistry:
    """The rule of every kind in the table of kinds that has one.

    Args:
      xla: whether the rules will run under XLA (picks the conv and depthwise
        kernels); None detects it at trace time, which is right for
        `tf.function(jit_compile=True)`.
    """
    rules = {}
    for name, record in layers.KINDS.items():
        if record.rule is None:
            continue
        fields = {f.name for f in dataclasses.fields(record.rule)}
        rules[name] = dataclasses.replace(record.rule, xla=xla) if "xla" in fields else record.rule
    return RuleRegistry(rules)
