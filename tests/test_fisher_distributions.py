"""Predictive distributions: closed-form Fisher, its square root, sampling."""

import numpy as np
import pytest
import tensorflow as tf

from kfac_graph import fisher

F64 = tf.float64
Z = np.array([[0.3, -1.0, 2.0, 0.1], [1.5, 0.2, -0.4, -2.0], [0.0, 0.0, 0.5, 1.0]])
KINDS = ["categorical", "bernoulli", "normal"]


def _sampled_fisher(kind, n, seed=(3, 4)):
    """(1/n) sum_samples grad log p grad log p^T, per example: [B, K, K]."""
    b, k = Z.shape
    z = tf.constant(np.tile(Z, (n, 1)))
    y = fisher.make_distribution(kind, z).sample(tf.constant(seed))
    with tf.GradientTape() as tape:
        tape.watch(z)
        lp = tf.reduce_sum(fisher.make_distribution(kind, z).log_prob(y))
    grads = tape.gradient(lp, z).numpy().reshape(n, b, k)
    return np.einsum("nbi,nbj->bij", grads, grads) / n


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_fisher_converges_to_closed_form(kind):
    closed = fisher.make_distribution(kind, tf.constant(Z)).fisher().numpy()
    errors = [np.abs(_sampled_fisher(kind, n) - closed).max() for n in (200, 20000)]
    scale = np.abs(closed).max()
    # Monte-Carlo error ~ 1/sqrt(n): at n = 20000 well under 5% of the scale.
    assert errors[1] < 0.05 * scale, errors
    assert errors[1] < errors[0]


@pytest.mark.parametrize("kind", KINDS)
def test_square_root_and_structured_products(kind):
    dist = fisher.make_distribution(kind, tf.constant(Z))
    f = dist.fisher().numpy()
    s = dist.sqrt_fisher().numpy()
    np.testing.assert_allclose(s @ np.swapaxes(s, 1, 2), f, atol=1e-12)
    cols = np.stack([c.numpy() for c in dist.sqrt_fisher_columns()], -1)
    np.testing.assert_allclose(cols, s, atol=1e-14)
    v = np.random.default_rng(0).normal(size=Z.shape)
    np.testing.assert_allclose(
        dist.multiply_fisher(tf.constant(v)), np.einsum("bij,bj->bi", f, v), atol=1e-12
    )
    np.testing.assert_allclose(dist.fisher_diagonal(), np.diagonal(f, axis1=1, axis2=2), atol=1e-14)


def test_closed_forms_by_hand():
    p = np.exp(Z) / np.exp(Z).sum(1, keepdims=True)
    cat = fisher.Categorical(tf.constant(Z)).fisher().numpy()
    np.testing.assert_allclose(cat[0], np.diag(p[0]) - np.outer(p[0], p[0]), atol=1e-14)
    q = 1 / (1 + np.exp(-Z))
    np.testing.assert_allclose(
        fisher.Bernoulli(tf.constant(Z)).fisher()[1], np.diag(q[1] * (1 - q[1])), atol=1e-14
    )
    np.testing.assert_allclose(fisher.Normal(tf.constant(Z)).fisher()[2], 2 * np.eye(4), atol=1e-14)


def test_log_probs():
    z = tf.constant(Z)
    ids = tf.constant([2, 0, 3])
    onehot = tf.one_hot(ids, 4, dtype=F64)
    want = -tf.nn.sparse_softmax_cross_entropy_with_logits(ids, z)
    cat = fisher.Categorical(z)
    np.testing.assert_allclose(cat.log_prob(ids), want, atol=1e-12)
    np.testing.assert_allclose(cat.log_prob(onehot), want, atol=1e-12)
    y = tf.constant((np.random.default_rng(1).random(Z.shape) > 0.5) * 1.0)
    np.testing.assert_allclose(
        fisher.Bernoulli(z).log_prob(y),
        -tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(y, z), -1),
        atol=1e-12,
    )
    # variance 1/2: -log p = (y - z)^2 + const
    y1, y2 = tf.constant(Z + 1.0), tf.constant(Z - 0.5)
    normal = fisher.Normal(z)
    np.testing.assert_allclose(
        normal.log_prob(y1) - normal.log_prob(y2), -(4 * 1.0 - 4 * 0.25) * np.ones(3), atol=1e-12
    )


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_is_deterministic_in_the_seed(kind):
    dist = fisher.make_distribution(kind, tf.constant(np.tile(Z, (50, 1))))
    a = dist.sample(tf.constant([1, 2])).numpy()
    b = dist.sample(tf.constant([1, 2])).numpy()
    c = dist.sample(tf.constant([1, 3])).numpy()
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown loss kind"):
        fisher.make_distribution("poisson", tf.constant(Z))
