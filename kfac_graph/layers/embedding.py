"""Per-example gradients of an embedding lookup `tf.gather(table, ids)`.

Math: with `ids [B, ...]` (positions flattened to `T`, uses concatenated) and
`g [B, ..., D]`, the gradient of example i's loss w.r.t. the table `[V, D]` is

    dE_i[v] = sum_t [ids_{i,t} == v] g_{i,t}

returned dense as `[B, V, D]` (a `scatter_nd` that sums repeated ids).

Its squared norm never needs that tensor. Three forms:

* `"gram"`: `|dE_i|^2 = sum_{t,t'} [ids_t == ids_t'] (g_t . g_t')`;
  `T^2 (D + 1)` multiply-adds and `T^2` memory per example.
* `"segment"`: sort the keys `i*V + id`, sum `g` within runs of equal keys
  (a static bound of `B*T` segments keeps it XLA-friendly) and square;
  `O(T D)` memory traffic plus an `O(T log BT)` sort per example.
* `"materialize"`: build `dE_i` and square it; `V D` writes per example.

`"auto"` compares costs in units of one Gram multiply-add: Gram `T^2 (D+1)`,
segment `100 T D`, materialise `25 (V D + T D)`; the smallest wins, which is
Gram for short sequences, and segment when `T` is not static. The unit costs
100 (a segment-form element: gather, sort, scatter-add) and 25 (a
materialised element) are CPU measurements, recorded in README's
kernel-choice section.
"""

import dataclasses

import tensorflow as tf

from kfac_graph.layers import lora, norms
from kfac_graph.layers import uses as uses_lib
from kfac_graph.layers.kind import LayerKind, variable_shapes


@dataclasses.dataclass(frozen=True)
class EmbeddingSpec:
    """`tf.gather(table, ids)` with `table [vocab_size, D]` (no bias)."""

    vocab_size: int

    def __post_init__(self):
        object.__setattr__(self, "vocab_size", int(self.vocab_size))

NORM_METHODS = ("gram", "segment", "materialize")


def flatten_ids(uses):
    """`ids [B, T]`, `g [B, T, D]` over all uses concatenated."""
    ids_parts, g_parts = [], []
    for ids, g in uses:
        batch = uses_lib.batch_size(g)
        ids_parts.append(tf.reshape(ids, [batch, -1]))
        g_parts.append(tf.reshape(g, [batch, -1, g.shape[-1]]))
    if len(ids_parts) == 1:
        return ids_parts[0], g_parts[0]
    return tf.concat(ids_parts, 1), tf.concat(g_parts, 1)


def _example_index(ids):
    """`[B, T]` tensor holding the example index of each entry of `ids`."""
    rows = tf.range(tf.shape(ids)[0], dtype=ids.dtype)[:, None]
    return tf.broadcast_to(rows, tf.shape(ids))


def _gram_norms(ids, g):
    same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), g.dtype)
    return tf.reduce_sum(same * tf.matmul(g, g, transpose_b=True), axis=[1, 2])


def _segment_norms(ids, g, vocab_size):
    keys = tf.reshape(
        _example_index(tf.cast(ids, tf.int64)) * vocab_size + tf.cast(ids, tf.int64), [-1]
    )
    order = tf.argsort(keys)
    keys = tf.gather(keys, order)
    vectors = tf.gather(tf.reshape(g, [-1, g.shape[-1]]), order)
    starts = tf.concat([[0], tf.cast(keys[1:] != keys[:-1], tf.int32)], 0)
    segment = tf.cumsum(starts)
    count = tf.size(keys)
    sums = tf.math.unsorted_segment_sum(vectors, segment, count)
    owner = tf.math.unsorted_segment_max(keys // vocab_size, segment, count)
    sq = tf.reduce_sum(tf.square(sums), axis=1)
    # Unused segments (max over nothing) get the dtype's minimum as owner.
    owner = tf.where(owner < 0, tf.zeros_like(owner), owner)
    return tf.math.unsorted_segment_sum(sq, owner, tf.shape(ids)[0])


@dataclasses.dataclass(frozen=True)
class EmbeddingRule:
    """Rule for kind `"embedding"` (spec: `EmbeddingSpec`).

    Attributes:
      norm_method: `"auto"` or one of `NORM_METHODS`.
    """

    norm_method: str = "auto"

    def per_example_grads(self, uses, spec):
        """`[[B, V, D]]`: the dense per-example gradient of the table."""
        ids, g = flatten_ids(uses_lib.as_uses(uses))
        index = tf.stack([_example_index(ids), ids], axis=-1)
        shape = tf.stack(
            [
                tf.shape(ids, out_type=ids.dtype)[0],
                tf.cast(spec.vocab_size, ids.dtype),
                tf.cast(g.shape[-1], ids.dtype),
            ]
        )
        return [tf.scatter_nd(index, g, shape)]

    def choose_norm_method(self, positions, dim, vocab_size):
        """The norm form for `positions` ids (over all uses) per example."""
        if self.norm_method != "auto":
            if self.norm_method not in NORM_METHODS:
                raise ValueError(f"unknown norm_method {self.norm_method!r}")
            return self.norm_method
        if positions is None:
            return "segment"
        costs = {
            "gram": positions * positions * (dim + 1),
            "segment": 100 * positions * dim,
            "materialize": 25 * (vocab_size * dim + positions * dim),
        }
        return min(costs, key=costs.get)

    def squared_norms(self, uses, spec):
        """`[B]`: squared norm of each example's table gradient."""
        ids, g = flatten_ids(uses_lib.as_uses(uses))
        method = self.choose_norm_method(ids.shape[1], g.shape[-1], spec.vocab_size)
        if method == "gram":
            return _gram_norms(ids, g)
        if method == "segment":
            return _segment_norms(ids, g, spec.vocab_size)
        return norms.sum_of_squares(self.per_example_grads([(ids, g)], spec)[0])


# -- factor statistics -------------------------------------------------------------


def id_frequencies(ids_per_use, vocab_size, dtype):
    """The diagonal A factor's batch estimate `[V]`: each id's share of all
    lookups over the uses (no one-hot tensor is formed)."""
    counts, total = [], []
    for ids in ids_per_use:
        flat = tf.reshape(ids, [-1])
        ones = tf.ones(tf.shape(flat), dtype)
        counts.append(tf.math.unsorted_segment_sum(ones, flat, vocab_size))
        total.append(tf.reduce_sum(ones))
    return tf.add_n(counts) / tf.add_n(total)


# -- the record --------------------------------------------------------------------


def spec(layer, use):
    """`EmbeddingSpec` of the table `[V, D]`."""
    return EmbeddingSpec(vocab_size=variable_shapes(layer)[0][0])


def operands(layer, use, tensors, grads):
    """The ids, and the gradients at the looked-up rows. A position embedding
    (`ids_broadcast`: ids `[T]` with no batch axis, or `[1, T]`, rows added to a
    `[B, T, D]` activation; the gradients are taken at that sum) gets its ids
    broadcast to `[B, T]`: example i's rows are its own `g_i`, so its per-example gradient
    is the scatter of `g_i` into the rows read. A table slice
    `table[start:stop]` added so (`row_range`) reads ids `range(start, stop)`.
    A lookup transposed before the sum (T5's relative-position bias, ids
    `[q, k]`, rows `[q, k, H]` added as `[1, H, q, k]`) has its gradients
    transposed back first (`grad_perm`). One added to `[k B, ..]` rows (a
    video's frames, Swin's windows: `row_groups` k) has each example's `k`
    rows of gradient summed first. A low-rank adapter's A on a table
    (``attrs["lora"]``, ``lora.py``) reads ``s g B^T`` at the rows."""
    attrs = layer.use_attrs[use]
    if attrs.get("row_groups"):  # added to [k B, ..] rows: each example's k rows summed
        k = attrs["row_groups"]  # (rows are followed where shapes are static)
        grads = [tf.reduce_sum(tf.reshape(g, [-1, k, *g.shape[1:]]), axis=1) for g in grads]
    if attrs.get("grad_perm"):  # a transposed lookup's gradient, back in its layout
        grads = [tf.transpose(g, attrs["grad_perm"]) for g in grads]
    ids = tensors[0]
    if attrs.get("row_range"):  # table rows start..stop; stop None: as many as g has positions
        start, stop = attrs["row_range"]
        ids = tf.range(start, start + tf.shape(grads[0])[-2] if stop is None else stop)
    if attrs.get("ids_broadcast"):
        if ids.shape.rank == grads[0].shape.rank - 1:  # [1, T]: the unit axis is the batch's
            ids = tf.reshape(ids, tf.shape(ids)[1:])
        shape = tf.concat([tf.shape(grads[0])[:1], tf.shape(ids)], axis=0)
        ids = tf.broadcast_to(ids[None], shape)
        ids.set_shape(grads[0].shape[:-1])
    if attrs.get("lora"):  # A of a looked-up table's adapter: its gradient s g B^T
        return lora.lookup_operands(attrs["lora"], ids, grads, tensors[1])
    return ids, list(grads)


KIND = LayerKind(
    name="embedding",
    rule=EmbeddingRule(),
    spec=spec,
    operands=operands,
    blocks={"kron": "EmbeddingKroneckerBlock", "diagonal": "NaiveDiagonalBlock",
            "full": "NaiveFullBlock"},
    default_block="kron",
    colour="lightsalmon",
)
