"""Tied input/output embeddings (kind ``"tied_embedding"``): one table
``E [V, D]`` gathered by token ids and applied transposed as the output
projection (``logits = h @ E^T``: GPT-2's LM head, Keras's
``ReversibleEmbedding(reverse=True)``), ``passes/tied_embedding.py``.

A composition, not new math: each use keeps its role
(``use_attrs[u]["tied_role"]``), a ``"lookup"`` is an embedding use
(``embedding.py``) and a ``"projection"`` a dense use with the kernel stored
``[d_out, d_in] = [V, D]`` (``dense.py``); this module only sums them, so
the layer-kind table keeps one home per kind of math.

Math: with lookups ``ids [B, T]``, their output gradients ``g [B, T, D]``,
and projections of ``h [B, T', D]`` with output gradients ``q [B, T', V]``
(positions and uses of each role concatenated), example i's gradient is

    dE_i = S_i + P_i,   S_i[v] = sum_t [ids_{i,t} = v] g_{i,t},
                        P_i    = sum_t' q_{i,t'}^T h_{i,t'}      [V, D],

exact for the sum of both uses. Its squared norm needs neither matrix:

    |dE_i|^2 = |S_i|^2 + |P_i|^2 + 2 <S_i, P_i>,
    <S_i, P_i> = sum_t g_{i,t} . P_i[ids_{i,t}]
               = sum_{t', t} q_{i, t', ids_{i,t}} (h_{i,t'} . g_{i,t}),

the first two by the embedding and dense norm forms, the cross term by
gathering ``q``'s columns at the ids (``[B, T', T]``) against ``h g^T``:
``B T T' (D + 1)`` multiply-adds.

Fisher blocks: ``"diagonal"`` (the default) and ``"full"`` are fed this
rule's per-example gradients (``NaiveDiagonalBlock``, ``NaiveFullBlock``):
the full block is the exact Fisher of the table, cross terms between the
lookup and the projection included; the diagonal block is its exact
diagonal, and its only approximation is dropping the off-diagonal entries.
Both cost ``B V D`` numbers per step. ``"kron"``
(``TiedEmbeddingKroneckerBlock``, ``fisher/blocks_tied.py``) is fed the
uses' ``(ids, g)`` and ``(h, q)`` pairs instead: the lookups' factors (id
frequencies ``[V]`` by ``g`` covariance ``[D, D]``) and the projections'
(``q`` covariance ``[V, V]``, its diagonal for a wide vocabulary, by ``h``
covariance ``[D, D]``) are over the same two spaces; their sum is no
Kronecker product, but the damped sum is inverted exactly by simultaneous
diagonalisation. It drops the lookup-projection cross terms.
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from kfac_graph.layers import dense, embedding
from kfac_graph.layers import uses as uses_lib
from kfac_graph.layers.kind import LayerKind, variable_shapes

LOOKUP, PROJECTION = "lookup", "projection"
_PROJECTION_SPEC = dense.DenseSpec(transpose_kernel=True)


@dataclasses.dataclass(frozen=True)
class TiedEmbeddingSpec:
    """Table ``[vocab_size, D]``; ``roles``: every use's role, in use order
    (one spec for all uses, so the rule sees them together)."""

    vocab_size: int
    roles: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "vocab_size", int(self.vocab_size))
        object.__setattr__(self, "roles", tuple(self.roles))
        bad = set(self.roles) - {LOOKUP, PROJECTION}
        if bad:
            raise ValueError(f"tied embedding: unknown use roles {sorted(bad)}")


def split_uses(uses, spec):
    """``(lookups, projections)``: the ``(ids, g)`` and ``(h, q)`` pairs."""
    uses = uses_lib.as_uses(uses)
    if len(uses) != len(spec.roles):
        raise ValueError(f"tied embedding: {len(uses)} uses given for the "
                             f"{len(spec.roles)} roles of its spec")
    pick = lambda role: [u for u, r in zip(uses, spec.roles) if r == role]
    return pick(LOOKUP), pick(PROJECTION)


def cross_term(lookups, projections):
    """``[B]``: ``<S_i, P_i>`` (module docstring) without forming either."""
    ids, g = embedding.flatten_ids(lookups)
    h, q = dense.flatten_positions(projections)
    q_at_ids = tf.gather(q, ids, axis=2, batch_dims=1)  # [B, T', T]
    return tf.reduce_sum(q_at_ids * tf.matmul(h, g, transpose_b=True), axis=[1, 2])


@dataclasses.dataclass(frozen=True)
class TiedEmbeddingRule:
    """Rule for kind ``"tied_embedding"`` (spec: ``TiedEmbeddingSpec``): the
    embedding rule on the lookups plus the dense rule on the projections."""

    lookup: embedding.EmbeddingRule = embedding.EmbeddingRule()
    projection: dense.DenseRule = dense.DenseRule()

    def per_example_grads(self, uses, spec):
        """``[[B, V, D]]``: ``S_i + P_i``."""
        lookups, projections = split_uses(uses, spec)
        parts = []
        if lookups:
            parts += self.lookup.per_example_grads(lookups, embedding.EmbeddingSpec(
                spec.vocab_size))
        if projections:
            parts += self.projection.per_example_grads(projections, _PROJECTION_SPEC)
        return [uses_lib.add_all(parts)]

    def squared_norms(self, uses, spec):
        """``[B]``: ``|S_i|^2 + |P_i|^2 + 2 <S_i, P_i>``."""
        lookups, projections = split_uses(uses, spec)
        terms = []
        if lookups:
            terms.append(self.lookup.squared_norms(lookups, embedding.EmbeddingSpec(
                spec.vocab_size)))
        if projections:
            terms.append(self.projection.squared_norms(projections, _PROJECTION_SPEC))
        if lookups and projections:
            terms.append(2 * cross_term(lookups, projections))
        return uses_lib.add_all(terms)


def spec(layer, use):
    """``TiedEmbeddingSpec`` of the table and every use's role."""
    return TiedEmbeddingSpec(variable_shapes(layer)[0][0],
                             tuple(attrs["tied_role"] for attrs in layer.use_attrs))


def operands(layer, use, tensors, grads):
    """A lookup's operands as the embedding kind reads them (ids, ``g``), a
    projection's as the dense kind does (``h``, ``q``)."""
    role = layer.use_attrs[use]["tied_role"]
    return (embedding.operands if role == LOOKUP else dense.operands)(layer, use, tensors, grads)


KIND = LayerKind(
    name="tied_embedding",
    rule=TiedEmbeddingRule(),
    spec=spec,
    operands=operands,
    blocks={"kron": "TiedEmbeddingKroneckerBlock", "diagonal": "NaiveDiagonalBlock",
            "full": "NaiveFullBlock"},
    default_block="diagonal",
    colour="peachpuff",
)
