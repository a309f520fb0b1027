"""The notes under ``kg.verify``'s table, and when one-example is skipped.

Example ``i``'s per-example gradient is its share of the batch gradient.
It is the gradient of ``fn`` on the batch of one ``args[i:i+1]`` only where
example ``i``'s term reads nothing but its own data. Where it reads the
other examples, the one-example check has nothing to compare and is
skipped, with a note:

- coupling (``reg.coupling``, batch normalisation in training mode): the
  term reads other examples through the weights;
- statistics of the batch's data (``reg.batch_statistics``) on a loss
  without data weights: the term reads a reduction of every example's data
  (inputs standardised by the batch's moments, ``MelSpectrogram``'s
  ``top_db`` floor at the batch's maximum), held at the batch's value, so
  ``pxg_i = d term_i(x_i; s(x_1..x_B))`` while the batch of one computes
  ``s(x_i)``. A loss with data weights (a masked mean's ``sum(w)``) keeps
  its check: ``verify_weights`` rescales the references instead.
"""
from __future__ import annotations

import tensorflow as tf

from kfac_graph import verify_weights
from passes import precision


def batch_statistics(reg) -> tuple[str, ...]:
    """The ops of statistics of the batch's data that make one-example
    incomparable: ``reg.batch_statistics`` where no data weight of the loss
    accounts for them (module docstring)."""
    return () if reg.loss.weighted else tuple(reg.batch_statistics)


def narrowing(reg):
    """``passes.precision``'s ops that narrow a float on the way to the loss
    to less than every variable's (a float32 model fed float64 data is not
    news)."""
    found = tuple(reg.ir.graph.get("narrowing", ())) if reg.ir is not None else ()
    widths = [precision.WIDTH.get(tf.as_dtype(v.dtype).name, 0) for v in reg.variables]
    least = min((w for w in widths if w), default=0)
    return tuple(entry for entry in found if precision.WIDTH[entry[2]] < least)


def _named(ops):
    return ops[0] + (f" and {len(ops) - 1} more" if len(ops) > 1 else "")


def notes(reg, coupling, one_error):
    """The report's notes: coupling or batch statistics (one-example
    skipped), a batch of one that fails, data weights, padding to the
    longest row, and a float narrower than the variables'."""
    notes = []
    statistics = batch_statistics(reg)
    if coupling:
        named = _named(coupling)
        norm = bool(set(coupling) - set(reg.coupling))  # layers, not the pass's ops
        where = (f"batch normalisation in training mode ({named})" if norm else
                 f"the loss at op {named} (batch statistics, or two tensors of examples combined)")
        notes.append(f"{where} couples the examples: every per-example gradient is the "
                     "example's contribution to the batch gradient, not a batch-of-one gradient, "
                     "so one-example is skipped"
                     + (" (call the model with training=False to check it)" if norm else ""))
    elif statistics:
        notes.append(f"the loss reads statistics of the batch's data at op {_named(statistics)}"
                     " (inputs standardised by the batch's moments, a spectrogram's floor at "
                     "the batch's maximum): every per-example gradient holds them at the "
                     "batch's values, and a batch of one computes its own, so one-example is "
                     "skipped (DP-SGD refuses the loss)")
    elif one_error:
        notes.append(verify_weights.skip_note(one_error)
                     or f"one-example skipped: fn fails on a batch of one: {one_error}")
    notes += verify_weights.notes(reg, one_error)
    if reg.padded_to_longest:
        notes.append(f"op {reg.padded_to_longest[0]!r} pads each example to the batch's longest "
                     "row: where the padding is not masked out, an example's gradient alone "
                     "differs from its share of the batch's (one-example), and DP-SGD refuses "
                     "the loss; give every example one fixed length")
    found = narrowing(reg)
    if found:
        op, wide, narrow = found[0]
        more = f" and {len(found) - 1} more op(s)" if len(found) > 1 else ""
        notes.append(f"the loss computes in {narrow} at {op}{more} ({wide} in): its gradients "
                     f"and Fisher are only as precise as {narrow}, so are the tolerances (a "
                     "mixed-precision policy, or a Keras layer without dtype= in a float64 model, "
                     "which takes the float32 policy)")
    return tuple(notes)
