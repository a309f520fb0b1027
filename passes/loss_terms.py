"""Sums on the loss's path: the likelihood's terms, a weight penalty's, and
other per-example terms added beside them.

A loss ``L = c * reduce_i(l_i) + R(theta) + c' * reduce_i(e_i)`` adds to the
negative log-likelihood's terms ``l_i``

- **penalties** ``R``: terms that depend on the variables but not on the data
  (Keras's ``kernel_regularizer``, an explicit ``lambda * sum(W^2)``). They
  belong to every batch of one: example ``i``'s gradient, the gradient of the
  loss evaluated on example ``i`` alone, is ``c dl_i + dR`` (the per-example
  engine adds ``dR``; DP-SGD adds it once, after clipping and noise, since it
  costs no privacy). The Fisher is the likelihood's alone. A penalty added
  to every example's term of a summed loss (``sum_i (l_i + R)``) is in the
  batch's loss ``B`` times and in example ``i``'s once (``summed_penalties``).
- **extra per-example terms** ``e_i``: data-dependent terms that are not a
  likelihood but are reduced over the examples as the likelihood is (Keras's
  ``activity_regularizer``, ``sum(|h|) / B``; a VAE's KL term). Example
  ``i``'s own loss is ``c l_i + c' e_i``: they enter its gradient, and the
  Gauss-Newton curvature where they have outputs of their own. They may be
  weighted, or the sum divided, by data (a detector's box loss masked to
  its positive anchors, both terms divided by their count): example ``i``'s
  share of each is read at run time as ``dL/de_i . e_i``
  (``kfac_graph.token_weights.own_terms``), the loss being linear in them.

Contract: ``split_sum(g, node, inputs, data, params) -> (data_terms,
penalties)`` sorts an ``Add``/``AddN``'s inputs (or a ``Sub``'s, where
``reduced_difference``: the second term's coefficient negated);
``combine(node, found)`` builds the loss's match from the walks down each data term
(``found``: per term, its likelihood match or the examples-first match the
walk stopped below, or the error). One likelihood keeps its Fisher; with
two (a model with two outputs, each with its loss) or none, the loss is
``"opaque"``: every term per example, the empirical Fisher only. Every
other term needs its own examples-first terms and the first's reduction
(a mean over the examples, or a sum): otherwise a
``LossNotFoundError`` names the op. ``heads`` keeps each term's terms,
likelihood output and kind (None and ``""`` for a term of no likelihood),
a term that is itself a sum (``(a + b) + c``) giving its own terms' heads,
for the Gauss-Newton curvature over all the terms' outputs
(``passes.loss_output.joint_outputs``).
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


def reduced_difference(op, inputs, data, params, reduced) -> bool:
    """Whether a ``Sub`` is a sum ``a + (-1) b`` of two data terms: both
    depend on the data and the variables, and the difference is taken
    above every tensor of examples (``reduced``), on the reduced terms
    (``mean(critic(fake)) - mean(critic(real))``, a WGAN critic's loss:
    example i's own loss is ``critic(fake_i) - critic(real_i)``). A
    difference of per-example tensors (below) stays where the walk stops,
    read as the examples' terms there (opaque or Gauss-Newton)."""
    nodes = [ir.split_tensor(t)[0] for t in inputs]
    return op == "Sub" and reduced and len(set(inputs)) == 2 and all(
        n in params and n in data for n in nodes)


def combine(node, found):
    """The match of a loss that adds several data terms at ``node`` (module
    docstring); ``found``: ``[(tensor, match or None, opaque match or None,
    error)]``. Where no one term is a likelihood (two outputs' losses, or
    none the pass reads) the loss is opaque: every term per example, the
    first's as its terms, no Fisher but the empirical one."""
    parts = [(tensor, match if match is not None else opaque, error)
             for tensor, match, opaque, error in found]
    for tensor, part, error in parts:
        if part is None:
            raise LossNotFoundError(
                f"op {node!r} adds a data-dependent term {tensor} that is not a sum or mean of "
                f"per-example terms ({str(error).split('; ')[0]}); {LOSS_HOW_TO}")
    likelihoods = [k for k, (_, p, _) in enumerate(parts) if p.kind != "opaque"]
    first = likelihoods[0] if len(likelihoods) == 1 else 0
    main = parts[first][1]
    if len(likelihoods) != 1:
        what = ("none is a likelihood the pass reads" if not likelihoods else
                f"{len(likelihoods)} are likelihoods (a model with several outputs)")
        main = dataclasses.replace(
            main, kind="opaque", output=None, targets=None, scale=1.0, op=None,
            reason=f"op {node!r} adds {len(parts)} data-dependent terms and {what}")
    extras, penalties, summed = list(main.extras), list(main.penalties), list(main.summed_penalties)
    for k, (tensor, extra, _) in enumerate(parts):
        if k == first:
            continue
        if extra.reduction != main.reduction:
            raise LossNotFoundError(
                f"op {node!r} adds a term {tensor} reduced over the examples by a "
                f"{extra.reduction} to one reduced by a {main.reduction}: example i's own loss "
                f"would not be a share of the batch's; {LOSS_HOW_TO}")
        extras.append((extra.terms, extra.terms_coefficient))
        extras.extend(extra.extras)
        penalties.extend(extra.penalties)
        summed.extend(extra.summed_penalties)
    heads = tuple(head for _, p, _ in parts for head in p.heads or (  # (a sum's, all of them)
        (p.terms, *((p.output, p.kind) if p.kind != "opaque" else (None, ""))),))
    return dataclasses.replace(main, extras=tuple(extras), penalties=tuple(penalties),
                               summed_penalties=tuple(summed), heads=heads)
