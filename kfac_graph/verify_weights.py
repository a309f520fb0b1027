"""``kg.verify``'s one-example references for a loss with data weights.

A weighted loss (``LossSpec.weighted``: a padding mask, Keras's
``sample_weight`` or ``ignore_class``, a masked mean ``sum(l * w) /
sum(w)``) may weigh its tokens by a batch statistic (``sum(w)`` over the
batch). Example i's per-example gradient holds the batch's statistic,
while ``fn`` on the batch of one ``args[i:i+1]`` computes its own, so the
two differ by the ratio of the token weights (``kfac_graph.token_weights``):

    pxg_i = r_i * grad fn(args[i:i+1]),   r_i = w_it(batch) / w_t(one),

which is the same for every token of the example whenever the statistic
is a scalar (a constant ``sum(w)``, Keras's ``total / valid``). The
reference is the one-example gradient times ``r_i``; when the ratio is not
one number per example, the check cannot be made and says so.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from kfac_graph.taps import LayerTaps

_NOT_A_MULTIPLE = "'s token weights in the batch are not a multiple of its own"
_NOT_FINITE = "'s gradient on its own is not finite (its token weights divide by zero)"


def token_weights_function(reg):
    """A ``tf.function`` of the arguments: ``reg``'s token weights ``[B, ...]``."""

    @tf.function(autograph=False)
    def run(*args):
        return LayerTaps.build(reg, args).token_weights

    return run


def ratios(fn, reg, args, one_args: dict, cache: dict, rtol: float):
    """``({i: r_i}, "")``, or ``({}, why not)`` for the picked examples
    ``one_args`` (``{i: args[i:i+1]}``). ``cache``: where the traced
    functions are kept (``fn.derived``)."""
    if not reg.loss.data_weighted:  # (w_it = s alike in the batch and on one example)
        return {i: 1.0 for i in one_args}, ""
    key = ("verify_token_weights", id(reg))
    if key not in cache:
        cache[key] = token_weights_function(reg)
    batch = cache[key](*args)
    if batch is None:
        return {}, ("the loss's token weights need a model output" if reg.loss.output is None
                    else "the loss's token weights are held in its Gauss-Newton curvature, "
                    "not read per token")
    batch = np.reshape(batch.numpy(), (batch.shape[0], -1))
    out = {}
    for i, one in one_args.items():
        reg_one = fn.registration(*one)
        key_one = ("verify_token_weights", id(reg_one))
        if key_one not in cache:
            cache[key_one] = token_weights_function(reg_one)
        single = np.reshape(cache[key_one](*one).numpy(), (-1,))
        mine = batch[i]
        if not np.any(mine):
            out[i] = 0.0
            continue
        live = (single != 0) & np.isfinite(single)  # (0/0 where a token is masked)
        if not np.any(live) or np.any(mine[~live]):
            return {}, f"example {i}{_NOT_A_MULTIPLE}"
        r = mine[live] / single[live]
        if np.max(np.abs(r - r[0])) > rtol * np.max(np.abs(r)):
            return {}, f"example {i}{_NOT_A_MULTIPLE}"
        out[i] = float(r[0])
    return out, ""


def rescaled(fn, reg, args, ones: dict, one_args: dict, tol):
    """The one-example gradients ``ones`` (``{i: [numpy per variable]}``) times
    each example's ratio: ``(ones, "")`` or ``({}, why not)``."""
    found, why = ratios(fn, reg, args, one_args, fn.derived, max(tol[0], 1e-6))
    if why:
        return {}, why
    for i, grads in ones.items():
        if found[i] != 0 and not all(np.all(np.isfinite(g)) for g in grads):
            return {}, f"example {i}{_NOT_FINITE}"
    return {i: [np.zeros_like(g) if found[i] == 0 else g * found[i] for g in grads]
            for i, grads in ones.items()}, ""


def skip_note(one_error: str) -> str:
    """The report's note when the ratios could not be read ("" otherwise)."""
    if any(m in one_error for m in (_NOT_A_MULTIPLE, _NOT_FINITE, "token weights ")):
        return f"one-example skipped: {one_error}"
    return ""


def notes(reg, one_error: str) -> list:
    """The report's note on a weighted loss's rescaled references."""
    if not reg.loss.weighted or one_error:
        return []
    return ["the loss weighs its tokens by data (" + ", ".join(
        reg.loss.weights + reg.loss.divided_by) + "): each one-example reference is the gradient "
        "on the batch of one times the ratio of the example's token weights in the batch to "
        "those on its own (a divisor such as sum(w) is the batch's)"]
