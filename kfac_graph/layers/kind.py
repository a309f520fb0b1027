"""The record of one layer kind: everything the runtime knows of it.

A `LayerKind` says, for layers the pass registered with that kind name,

- `spec(layer, use)`: the rule's frozen spec of one use, read from the
  matched op's attributes (`layer.use_attrs[use]`) and the variables' shapes;
- `operands(layer, use, tensors, grads)`: what its rules take from the
  graph: from the tensors the pass recorded for the use (`tensors`, as
  `LayerTaps.inputs` holds them) and the gradients at the use's output (one
  per source), the pair `(a, [g, ...])` the rule and the Fisher blocks read
  (reshaped to the op's static shapes, channels-last where a vector scale
  broadcasts);
- `rule`: the per-example gradient and norm rule (`per_example_grads(uses,
  spec)`, `squared_norms(uses, spec)`), None when the kind has none
  ("generic": its per-example gradients are a Jacobian of the loss terms);
- `blocks`: the Fisher approximations it allows, alias -> the name of a
  block factory in `kfac_graph.fisher`, and `default_block`, the alias it
  gets unless asked otherwise; the factors those blocks keep are computed
  from this kind's module (rows of inputs and output gradients, or the
  rule's per-example gradients), not from a second copy of its math;
- `colour`: its fill in `Registration.to_dot`.

Records are plain frozen values; the one table of kinds is
`kfac_graph.layers.KINDS`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """One layer kind (see the module docstring)."""

    name: str
    blocks: Mapping[str, str]
    default_block: str
    colour: str
    rule: Any = None
    spec: Callable | None = None
    operands: Callable | None = None

    def __post_init__(self):
        if self.default_block not in self.blocks:
            raise ValueError(f"layer kind {self.name!r}: default block {self.default_block!r} "
                             f"is not among its blocks {sorted(self.blocks)}")


def reshape_like(tensor: tf.Tensor, shape) -> tf.Tensor:
    """Reshapes to a static op shape whose batch axis may be unknown (only
    unit axes differ: the pass sees through them). With more than one axis
    unknown (rows read ``[B, k, ..]``, both known at run time only), a tensor
    of that rank whose sizes agree is returned as it is, and one that differs
    by unit axes alone gets them added or dropped."""
    if shape is None or tensor.shape.as_list() == list(shape):
        return tensor
    if (sum(d is None for d in shape) > 1 and tensor.shape.rank == len(shape)
            and tensor.shape.is_compatible_with(shape)):
        return tensor
    if sum(d is None for d in shape) > 1 and tensor.shape.rank is not None:
        # unit axes added or dropped (Conv1D's [B, T, C] as [B, 1, T, C], T unknown):
        # the other axes, in order, keep their run-time sizes
        kept = [i for i, d in enumerate(tensor.shape.as_list()) if d != 1]
        if len(kept) == sum(d != 1 for d in shape):
            sizes, it = tf.shape(tensor), iter(kept)
            return tf.reshape(tensor, [1 if d == 1 else sizes[next(it)] for d in shape])
    return tf.reshape(tensor, [-1 if d is None else d for d in shape])


def split_rows(t: tf.Tensor, axis: int, batch) -> tf.Tensor:
    """``t [.., k B, ..]``, whose axis ``axis`` holds each example's ``k``
    rows in turn, as ``[.., B, k, ..]``: ``k`` from ``t``'s size and the
    batch ``B`` (a use's ``run_time_rows``: tokens of sequences whose
    length is known at run time only)."""
    sizes = [d if d is not None else tf.shape(t)[i] for i, d in enumerate(t.shape.as_list())]
    return tf.reshape(t, [*sizes[:axis], batch, -1, *sizes[axis + 1:]])


def split_operands(tensors, grads, axis, batch):
    """``split_rows`` of each tensor and each gradient of a use."""
    return ([split_rows(t, axis, batch) for t in tensors],
            [split_rows(g, axis, batch) for g in grads])


def variable_shapes(layer) -> list:
    """The shapes of ``layer``'s variables, as tuples of ints."""
    return [tuple(int(d) for d in v.shape) for v in layer.variables]
