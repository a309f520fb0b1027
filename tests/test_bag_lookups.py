"""Lookups of a ``tf.Variable`` by its handle (``ResourceGather``:
``tf.nn.embedding_lookup`` and ``embedding_lookup_sparse`` on a variable).

A bag of ids per example (a multi-hot feature: ``embedding_lookup_sparse``
with a mean combiner) looks up N ids for B examples, then combines them per
example: the table is generic, with the reason, at registration (before, it
was taken for an embedding of the examples and stopped at run time on the
invariant), and a generic table read by ``ResourceGather`` gets exact
per-example gradients (before: "its reads cannot be replaced"), so
per-example gradients equal one-example tapes, and K-FAC and DP-SGD train."""
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import double_backward

B, V, E, K = 6, 9, 3, 4


def _problem():
    rng = np.random.default_rng(0)
    table = tf.Variable(rng.normal(size=(V, E)), name="bag_table")
    positions = tf.Variable(rng.normal(size=(5, E)), name="position_table")
    w = tf.Variable(rng.normal(size=(E, K)), name="head")
    ids = rng.integers(0, V, size=(B, 5))
    for i, n in enumerate(rng.integers(1, 6, B)):
        ids[i, n:] = -1  # padding: bags of 1 to 5 ids

    @kg.auto_register
    def loss_fn(ids, y):
        bag = tf.RaggedTensor.from_tensor(ids, padding=-1).to_sparse()
        pooled = tf.nn.embedding_lookup_sparse(table, bag, None, combiner="mean")
        # a table looked up by constant ids and summed: meets every example alike
        pooled += tf.reduce_mean(tf.nn.embedding_lookup(positions, tf.range(5)), axis=0)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, pooled @ w))

    return loss_fn, (tf.constant(ids), tf.constant(rng.integers(0, K, B)))


def test_bag_lookup_is_generic_with_its_reason_and_exact():
    loss_fn, args = _problem()
    reg = loss_fn.registration(*args)
    kinds = {layer.variables[0].name.split(":")[0]: layer for layer in reg.layers}
    assert kinds["bag_table"].kind == "generic"
    assert "a sparse or ragged bag's ids" in kinds["bag_table"].reason
    assert kinds["position_table"].kind == "generic" and kinds["head"].kind == "dense"
    grads = kg.per_example_gradients(loss_fn, *args)
    for i in range(B):
        with tf.GradientTape() as tape:
            loss = loss_fn(*(a[i:i + 1] for a in args))
        for g, w in zip(grads, tape.gradient(loss, reg.variables)):
            np.testing.assert_allclose(g[i], tf.convert_to_tensor(w), rtol=1e-10, atol=1e-12)


def test_kfac_and_dpsgd_train_it():
    loss_fn, args = _problem()
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(8)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0
    dp = kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=0.5)
    assert np.isfinite(float(dp.step(*args)))


@pytest.mark.parametrize("kind", ["Sum", "Mean", "SqrtN"])
@pytest.mark.parametrize("v2", [False, True])
def test_the_segment_reduction_gradient_differentiates_again(kind, v2):
    """``double_backward``'s gradient of ``SparseSegment<kind>Grad[V2]``
    (TensorFlow has none: the quadratic model's double backward through
    ``embedding_lookup_sparse`` stopped with "No gradient defined"), against
    the transpose of the linear map written out in numpy."""
    rng = np.random.default_rng(1)
    indices = np.array([4, 0, 4, 2, 7, 0])
    segments = np.array([0, 0, 1, 2, 2, 2])
    g = rng.normal(size=(3, 2))
    counts = np.bincount(segments)
    scale = {"Sum": np.ones(3), "Mean": 1 / counts, "SqrtN": 1 / np.sqrt(counts)}[kind]
    rows = np.unique(indices) if v2 else np.arange(V)
    m = np.zeros((len(rows), 3))  # out = m @ g
    for i, s in zip(indices, segments):
        m[np.searchsorted(rows, i), s] += scale[s]
    dy = rng.normal(size=(len(rows), 2))
    op = getattr(tf.raw_ops, f"SparseSegment{kind}Grad{'V2' if v2 else ''}")

    @tf.function
    def gradient(g, dy):  # as the quadratic model differentiates (exact_fisher.py)
        with double_backward.differentiable():
            out = op(grad=g, indices=indices, segment_ids=segments,
                     **{"dense_output_dim0" if v2 else "output_dim0": V})
        values = out[0] if v2 else out
        return values, tf.gradients(values, g, grad_ys=dy)[0]

    values, got = gradient(tf.constant(g), tf.constant(dy))
    np.testing.assert_allclose(values, m @ g, rtol=1e-12)
    np.testing.assert_allclose(got, m.T @ dy, rtol=1e-12)
