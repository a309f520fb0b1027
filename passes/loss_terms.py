"""Sums on the loss's path: the likelihood's terms, a weight penalty's, and
other per-example terms added beside them.

A loss ``L = c * reduce_i(l_i) + R(theta) + c' * reduce_i(e_i)`` adds to the
negative log-likelihood's terms ``l_i``

- **penalties** ``R``: terms that depend on the variables but not on the data
  (Keras's ``kernel_regularizer``, an explicit ``lambda * sum(W^2)``). They
  belong to every batch of one: example ``i``'s gradient, the gradient of the
  loss evaluated on example ``i`` alone, is ``c dl_i + dR`` (the per-example
  engine adds ``dR``; DP-SGD adds it once, after clipping and noise, since it
  costs no privacy). The Fisher is the likelihood's alone.
- **extra per-example terms** ``e_i``: data-dependent terms that are not a
  likelihood but are reduced over the examples as the likelihood is (Keras's
  ``activity_regularizer``, ``sum(|h|) / B``; a VAE's KL term). Example
  ``i``'s own loss is ``c l_i + c' e_i``: they enter its gradient, not the
  Fisher.

Contract: ``split_sum(g, node, inputs, data, params) -> (data_terms,
penalties)`` sorts an ``Add``/``AddN``'s inputs; ``combine(node, found,
outer)`` builds the loss's match from the walks down each data term
(``found``: per term, its likelihood match or the examples-first match the
walk stopped below, or the error). Exactly one term must be a likelihood;
the others need their own examples-first terms, no weights of their own
(``outer``: whether weights or divisors were read above the sum) and the
likelihood's reduction (a mean over the examples, or a sum): otherwise a
``LossNotFoundError`` names the op.
"""
from __future__ import annotations

import dataclasses

from passes import ir
from passes.errors import LOSS_HOW_TO, LossNotFoundError


def split_sum(g, node, inputs, data, params):
    """``(data_terms, penalties)``: the inputs that depend on the data and the
    variables, and those that depend on the variables alone (a term of the
    data or constants alone has no gradient: it is neither)."""
    trained = [t for t in inputs if ir.split_tensor(t)[0] in params]
    data_terms = [t for t in trained if ir.split_tensor(t)[0] in data]
    return data_terms, [t for t in trained if t not in data_terms]


def combine(node, found, outer: bool):
    """The match of a loss that adds several data terms at ``node`` (module
    docstring); ``found``: ``[(tensor, match or None, opaque match or None,
    error)]``."""
    likelihoods = [m for _, m, _, _ in found if m is not None and m.kind != "opaque"]
    if len(likelihoods) != 1:
        what = ("none is a likelihood the pass reads" if not likelihoods else
                f"{len(likelihoods)} are likelihoods (a model with several outputs?)")
        first_error = next((str(e).split("; ")[0] for _, m, _, e in found if e), "")
        raise LossNotFoundError(
            f"op {node!r} adds {len(found)} data-dependent terms and {what}"
            + (f" ({first_error})" if first_error and not likelihoods else "")
            + f"; {LOSS_HOW_TO}")
    main = likelihoods[0]
    extras, penalties = list(main.extras), list(main.penalties)
    for tensor, match, opaque, error in found:
        if match is main:
            continue
        extra = match if match is not None else opaque
        if extra is None:
            raise LossNotFoundError(
                f"op {node!r} adds to the likelihood a data-dependent term {tensor} that is not "
                f"a sum or mean of per-example terms ({str(error).split('; ')[0]}); {LOSS_HOW_TO}")
        if outer or extra.weights or extra.divisors:
            raise LossNotFoundError(
                f"op {node!r} adds a weighted term {tensor} to the likelihood: per-example terms "
                f"beside the likelihood must not be weighted; {LOSS_HOW_TO}")
        if extra.reduction != main.reduction:
            raise LossNotFoundError(
                f"op {node!r} adds a term {tensor} reduced over the examples by a "
                f"{extra.reduction} to a likelihood reduced by a {main.reduction}: example i's "
                f"own loss would not be a share of the batch's; {LOSS_HOW_TO}")
        extras.append((extra.terms, extra.terms_coefficient))
        extras.extend(extra.extras)
        penalties.extend(extra.penalties)
    return dataclasses.replace(main, extras=tuple(extras), penalties=tuple(penalties))
