"""Per-example clipping: which parts of each example's gradient are clipped
together, to which threshold, and how.

The gradient of example i is cut into groups ``g_{i,1}, ..., g_{i,G}`` (sets
of layers: all of them for ``"flat"``, one per layer for ``"per_layer"``, or
named groups of layers), each with its own threshold ``C_k``. Each group is
scaled by its own weight

    standard:   w_{i,k} = min(1, C_k / ||g_{i,k}||)        (Abadi et al. 2016)
    automatic:  w_{i,k} = C_k / (||g_{i,k}|| + gamma)       (AUTO-S, Bu et al. 2022)

so ``||w_{i,k} g_{i,k}|| <= C_k`` and one example moves the clipped sum by at
most the sensitivity ``S = sqrt(sum_k C_k^2)`` in L2; the noise has standard
deviation ``sigma * S`` (Opacus's rule for per-layer clipping). A zero
gradient keeps weight 1 (standard) or ``C_k / gamma`` (automatic; it is zero
anyway). ``mask`` (padding of Poisson batches) multiplies every weight: a
padded example contributes exactly nothing.

``clipping`` takes:

- ``"flat"``: one group; ``l2_norm_clip`` a number (or tensor).
- ``"per_layer"``: one group per registered layer; ``l2_norm_clip`` a number
  (every layer), a sequence aligned with ``registration.layers``, or a dict
  ``{layer name: threshold}`` naming every layer.
- a dict ``{group name: [layer-name patterns]}`` (``fnmatch`` patterns, e.g.
  ``{"body": ["*conv*"], "head": ["*logits*"]}``): every layer must match
  exactly one group; ``l2_norm_clip`` a number (every group) or a dict
  ``{group name: threshold}``.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Mapping, Sequence

import tensorflow as tf

from passes.errors import KfacGraphError


@dataclasses.dataclass(frozen=True)
class ClipPlan:
    """``groups[k]``: the indices of the registration's layers in group k;
    ``names[k]`` its name; ``thresholds[k]`` its ``C_k`` (a number, or a
    tensor for a single flat threshold); ``automatic`` and ``gamma`` as in
    the module docstring."""

    groups: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]
    thresholds: tuple
    automatic: bool = False
    gamma: float = 0.01

    @property
    def structure(self):
        """What a compiled step depends on (the thresholds are its inputs)."""
        return (self.groups, self.automatic, self.gamma)

    def threshold_vector(self) -> tf.Tensor:
        """``[G]`` float64 thresholds (cast to each gradient's dtype where used)."""
        return tf.stack([tf.cast(c, tf.float64) if tf.is_tensor(c) or isinstance(c, tf.Variable)
                         else tf.constant(c, tf.float64) for c in self.thresholds])


def plan(registration, clipping="flat", l2_norm_clip=1.0, automatic: bool = False,
         gamma: float = 0.01) -> ClipPlan:
    """The ``ClipPlan`` for ``registration``'s layers (one-line ``ValueError``
    naming what does not fit)."""
    names = [layer.name for layer in registration.layers]
    if not names:
        raise KfacGraphError("nothing to clip: the registration has no layers")
    if not (isinstance(gamma, (int, float)) and gamma > 0):
        raise ValueError(f"gamma (automatic clipping's stability constant) must be > 0, "
                         f"got {gamma!r}")
    if isinstance(clipping, str) and clipping == "flat":
        _check_threshold("l2_norm_clip", l2_norm_clip, dynamic=True)
        return ClipPlan((tuple(range(len(names))),), ("all",), (l2_norm_clip,),
                        bool(automatic), float(gamma))
    if isinstance(clipping, str) and clipping == "per_layer":
        groups = tuple((i,) for i in range(len(names)))
        thresholds = _thresholds(l2_norm_clip, names, "layer")
        return ClipPlan(groups, tuple(names), thresholds, bool(automatic), float(gamma))
    if isinstance(clipping, Mapping):
        group_names = list(clipping)
        members = {g: [] for g in group_names}
        for i, name in enumerate(names):
            hits = [g for g in group_names if any(fnmatch.fnmatchcase(name, p)
                                                  for p in _patterns(g, clipping[g]))]
            if len(hits) != 1:
                raise ValueError(f"clipping groups: layer {name!r} matches "
                                 f"{'no group' if not hits else 'groups ' + ', '.join(hits)}; "
                                 "every layer must match exactly one")
            members[hits[0]].append(i)
        empty = [g for g in group_names if not members[g]]
        if empty:
            raise ValueError(f"clipping group {empty[0]!r} matches no layer (layers: "
                             f"{', '.join(names)})")
        thresholds = _thresholds(l2_norm_clip, group_names, "group")
        return ClipPlan(tuple(tuple(members[g]) for g in group_names), tuple(group_names),
                        thresholds, bool(automatic), float(gamma))
    raise ValueError(f"clipping must be 'flat', 'per_layer' or a dict {{group: [layer-name "
                     f"patterns]}}, got {clipping!r}")


def _patterns(group, value):
    if isinstance(value, str):
        return [value]
    if isinstance(value, Sequence) and all(isinstance(p, str) for p in value):
        return list(value)
    raise ValueError(f"clipping group {group!r}: give a list of layer-name patterns, "
                     f"got {value!r}")


def _check_threshold(what, value, dynamic=False):
    if dynamic and (tf.is_tensor(value) or isinstance(value, tf.Variable)):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


def _thresholds(l2_norm_clip, names, what):
    if isinstance(l2_norm_clip, Mapping):
        missing = [n for n in names if n not in l2_norm_clip]
        extra = [k for k in l2_norm_clip if k not in names]
        if missing or extra:
            raise ValueError(f"l2_norm_clip: no threshold for {what} {missing[0]!r}" if missing
                             else f"l2_norm_clip: no {what} named {extra[0]!r}")
        return tuple(_check_threshold(f"l2_norm_clip[{n!r}]", l2_norm_clip[n]) for n in names)
    if isinstance(l2_norm_clip, Sequence) and not isinstance(l2_norm_clip, str):
        if len(l2_norm_clip) != len(names):
            raise ValueError(f"l2_norm_clip: {len(l2_norm_clip)} thresholds for "
                             f"{len(names)} {what}s")
        return tuple(_check_threshold(f"l2_norm_clip[{i}]", c)
                     for i, c in enumerate(l2_norm_clip))
    c = _check_threshold("l2_norm_clip", l2_norm_clip)
    return tuple(c for _ in names)


def group_squared_norms(plan_: ClipPlan, layer_squared_norms) -> list:
    """Per group, ``[B]``: the sum of its layers' squared norms (float64 if any
    layer's is, else float32)."""
    dtype = (tf.float64 if any(t.dtype == tf.float64 for t in layer_squared_norms)
             else tf.float32)
    return [tf.add_n([tf.cast(layer_squared_norms[i], dtype) for i in g])
            for g in plan_.groups]


def clip_weights(plan_: ClipPlan, squared_norms, thresholds, mask=None) -> list:
    """Per group, ``[B]`` weights ``w_{i,k}`` (module docstring) in the norms'
    dtype; ``thresholds``: ``[G]``; ``mask``: ``[B]`` or None."""
    out = []
    for k, sq in enumerate(squared_norms):
        norms = tf.sqrt(sq)
        c = tf.cast(thresholds[k], sq.dtype)
        if plan_.automatic:
            w = c / (norms + tf.cast(plan_.gamma, sq.dtype))
        else:
            w = tf.minimum(tf.cast(1.0, sq.dtype), c / tf.maximum(norms, 1e-12))
        if mask is not None:
            w = w * tf.cast(mask, sq.dtype)
        out.append(w)
    return out


def sensitivity(thresholds) -> tf.Tensor:
    """``sqrt(sum_k C_k^2)``: the L2 sensitivity of the clipped sum."""
    return tf.sqrt(tf.reduce_sum(tf.square(tf.cast(thresholds, tf.float64))))
