"""The Kronecker block of a tied embedding (``TiedEmbeddingKroneckerBlock``),
float64.

References: the factors by definition in numpy (id frequencies, output
gradient and input covariances, the replica counts), the Jacobian Fisher of
each use's gradient taken separately (the table copied per role, so the
brute force has no lookup-projection cross terms), and ``np.linalg.inv`` of
the dense matrix ``multiply`` applies. End to end: a tiny tied transformer
language model trained by ``kg.KFAC`` with this block.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_reference import F64, brute_fisher, cov, operator_matrix
from kfac_graph import fisher
from kfac_graph.fisher import block_choice, report
from kfac_graph.optimizer import costs

V, D, LAM = 5, 3, 0.3
ROLES = ("lookup", "projection", "lookup")


def _data(rng, batch=4):
    """Two lookups (3 and 2 positions) and one projection (4 positions)."""
    ids = [rng.integers(0, V, size=(batch, t)) for t in (3, 2)]
    g = [rng.normal(size=(batch, t, D)) for t in (3, 2)]
    h, q = rng.normal(size=(batch, 4, D)), rng.normal(size=(batch, 4, V))
    uses = [(tf.constant(ids[0]), tf.constant(g[0])), (tf.constant(h), tf.constant(q)),
            (tf.constant(ids[1]), tf.constant(g[1]))]
    return uses, ids, g, h, q


def _block(budget=None, roles=ROLES, **kw):
    return fisher.TiedEmbeddingKroneckerBlock([(V, D)], {"tied_roles": roles}, dtype=F64,
                                              ema_decay=0.0, damping=LAM,
                                              max_factor_size=budget, **kw)


def _numpy_block(ids, g, h, q, budget=None):
    """``R_L diag(p) (x) G_L + R_P Q (x) H`` from the definitions."""
    batch = h.shape[0]
    flat_ids = np.concatenate([i.ravel() for i in ids])
    p = np.bincount(flat_ids, minlength=V) / flat_ids.size
    gl = cov(np.concatenate([x.reshape(-1, D) for x in g]))
    qq, hh = cov(q), cov(h)
    if budget is not None and V > budget:
        qq = np.diag(np.diag(qq))
    if budget is not None and D > budget:
        gl, hh = np.diag(np.diag(gl)), np.diag(np.diag(hh))
    r_l, r_p = flat_ids.size / batch, q.shape[1]
    return r_l * np.kron(np.diag(p), gl) + r_p * np.kron(qq, hh)


@pytest.mark.parametrize("budget", [None, 4, 2])
def test_full_matrix_is_the_sum_of_the_two_kronecker_terms(budget):
    uses, ids, g, h, q = _data(np.random.default_rng(0))
    block = _block(budget)
    block.update(uses)
    assert block.projection_grads.wide == (budget is not None)
    assert block.lookup_grads.wide == (budget == 2)
    np.testing.assert_allclose(block.full_matrix(), _numpy_block(ids, g, h, q, budget),
                               rtol=1e-10, atol=1e-12)


def test_full_matrix_is_the_jacobian_fisher_of_each_use_for_one_example():
    """One example, one lookup and one projection position, exact mode: the
    block is the brute-force Fisher of the lookup's gradient plus that of the
    projection's (each use's Jacobian from its own copy of the table)."""
    keras.config.set_floatx("float64")
    rng = np.random.RandomState(4)
    table = tf.Variable(rng.normal(size=(V, D)), name="table")
    w = tf.Variable(rng.normal(size=(D, D)), name="w")

    def logits_of(look, proj, x):
        return tf.tanh(tf.gather(look, x) @ w) @ tf.transpose(proj)

    @kg.auto_register
    def loss_fn(x, y):
        z = logits_of(table, table, x)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, z))

    x, y = tf.constant([2]), tf.constant([4])
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact",
                             approximations={"tied_embedding": "kron"})
    est.update(x, y)
    block = est.blocks[0]
    assert type(block).__name__ == "TiedEmbeddingKroneckerBlock", est.summary()
    softmax_fisher = lambda z: (lambda p: tf.linalg.diag(p) - p[:, :, None] * p[:, None, :])(
        tf.nn.softmax(z))
    copy = lambda: tf.Variable(table.numpy())  # noqa: E731
    look, proj = copy(), copy()
    f_lookup = brute_fisher(lambda p, xx: logits_of(p[0], proj, xx), [look], x, softmax_fisher)
    f_proj = brute_fisher(lambda p, xx: logits_of(look, p[0], xx), [proj], x, softmax_fisher)
    np.testing.assert_allclose(block.full_matrix(), f_lookup + f_proj, rtol=1e-6, atol=1e-12)
    exact = brute_fisher(lambda p, xx: logits_of(p[0], p[0], xx), [table], x, softmax_fisher)
    assert not np.allclose(exact, f_lookup + f_proj)  # the cross terms are dropped


def _damped(block, damping=LAM):
    return operator_matrix(lambda vs: block.multiply(vs, damping=damping), block.var_shapes)


def _inverse(block, damping=LAM, refreshed=False):
    return operator_matrix(
        lambda vs: block.multiply_inverse(vs, refreshed=refreshed, damping=damping),
        block.var_shapes)


@pytest.mark.parametrize("budget", [None, 4, 2])
def test_multiply_inverse_is_the_inverse_of_multiply(budget):
    """Full Q (no budget), diagonal Q (4), both sides diagonal (2); the
    damped matrix is the undamped block plus the lookup term's pi-split
    damping; cached (refreshed) and current inverses agree."""
    rng = np.random.default_rng(1)
    uses, ids, g, h, q = _data(rng)
    block = _block(budget)
    block.update(uses)
    damped = _damped(block)
    # multiply is M1 + R_P Q (x) H, M1 the pi-damped lookup term
    r_l = 5.0  # lookups per example: 3 + 2 positions
    flat_ids = np.concatenate([i.ravel() for i in ids])
    p = np.bincount(flat_ids, minlength=V) / flat_ids.size
    gl = np.asarray(block.lookup_grads.value())
    gl = np.diag(gl) if gl.ndim == 1 else gl
    r = np.sqrt(LAM / r_l)
    pi = np.sqrt((p.sum() / V) / (np.trace(gl) / D))
    m1 = r_l * np.kron(np.diag(p) + pi * r * np.eye(V), gl + r / pi * np.eye(D))
    undamped = _numpy_block(ids, g, h, q, budget)
    np.testing.assert_allclose(damped, undamped - r_l * np.kron(np.diag(p), gl) + m1,
                               rtol=1e-10, atol=1e-12)
    want = np.linalg.inv(damped)
    assert bool(block.inverses_stale(LAM))
    np.testing.assert_allclose(_inverse(block), want, rtol=1e-7, atol=1e-9)  # on the fly
    block.update_inverses(LAM)
    assert not bool(block.inverses_stale(LAM))
    np.testing.assert_allclose(_inverse(block, refreshed=True), want, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(_inverse(block), want, rtol=1e-7, atol=1e-9)
    # L L^T is the damped block, L^{-1} L = I
    chol = operator_matrix(lambda vs: block.multiply_cholesky(vs, damping=LAM), block.var_shapes)
    np.testing.assert_allclose(chol @ chol.T, damped, rtol=1e-8, atol=1e-10)
    chol_t = operator_matrix(lambda vs: block.multiply_cholesky(vs, True, LAM), block.var_shapes)
    np.testing.assert_allclose(chol_t, chol.T, rtol=1e-8, atol=1e-10)
    chol_inv = operator_matrix(lambda vs: block.multiply_cholesky_inverse(vs, damping=LAM),
                               block.var_shapes)
    np.testing.assert_allclose(chol_inv @ chol, np.eye(V * D), atol=1e-8)
    chol_inv_t = operator_matrix(lambda vs: block.multiply_cholesky_inverse(vs, True, LAM),
                                 block.var_shapes)
    np.testing.assert_allclose(chol_inv_t, chol_inv.T, rtol=1e-8, atol=1e-10)
    with pytest.raises(NotImplementedError, match="TiedEmbeddingKroneckerBlock.multiply_matpower"):
        block.multiply_matpower([tf.ones([V, D], F64)], 0.5)


def test_cached_inverse_is_a_snapshot_and_a_damping_change_makes_it_stale():
    rng = np.random.default_rng(2)
    block = _block()
    block.update(_data(rng)[0])
    block.update_inverses(LAM)
    old = np.linalg.inv(_damped(block))
    block.update(_data(rng)[0])  # new statistics, same damping: the cache is not stale
    assert not bool(block.inverses_stale(LAM))
    np.testing.assert_allclose(_inverse(block, refreshed=True), old, rtol=1e-7, atol=1e-9)
    assert not np.allclose(old, np.linalg.inv(_damped(block)))
    # another damping: stale, and the unrefreshed inverse is the current one
    assert bool(block.inverses_stale(2 * LAM))
    np.testing.assert_allclose(_inverse(block, damping=2 * LAM),
                               np.linalg.inv(_damped(block, 2 * LAM)), rtol=1e-7, atol=1e-9)
    block.update_inverses(2 * LAM)
    assert not bool(block.inverses_stale(2 * LAM)) and bool(block.inverses_stale(LAM))
    assert len(block.inverse_variables()) == 5


@pytest.mark.parametrize("roles", [("lookup", "lookup"), ("projection",)])
def test_a_layer_without_both_roles_is_a_one_line_error_naming_it(roles):
    """Built as the estimator builds it (its name carries the layer's)."""
    layer = kg.Layer(kind="tied_embedding", variables=(tf.Variable(tf.zeros([V, D])),),
                     name="tok_table", uses=len(roles),
                     use_attrs=tuple({"tied_role": r} for r in roles))
    with pytest.raises(kg.KfacGraphError, match="tok_table") as err:
        block_choice.make_layer_block(layer, {"tied_embedding": "kron"},
                                      name=f"block_0_{layer.name}")
    assert "\n" not in str(err.value) and "lookup and projection" in str(err.value)


class _TiedHead(keras.layers.Layer):
    """Logits ``h E^T`` from the token embedding's table ``E``."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.embedding.embeddings))


def _tied_lm(vocab=11, seq=6, width=8, batch=8):
    """A tiny tied language model: ids ``[B, T]`` -> embedding -> a tanh
    Dense -> LayerNorm -> ``h E^T``, per-token cross-entropy on shifted ids."""
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    ids = keras.Input((seq,), dtype="int32")
    tokens = keras.layers.Embedding(vocab, width)
    h = keras.layers.Dense(width, activation="tanh")(tokens(ids))
    logits = _TiedHead(tokens)(keras.layers.LayerNormalization()(h))
    model = keras.Model(ids, logits)

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    rng = np.random.default_rng(3)
    text = (np.arange(batch * (seq + 1)).reshape(batch, seq + 1) * 3 + rng.integers(
        0, 2, size=(batch, 1))) % vocab
    return loss_fn, (tf.constant(text[:, :-1], tf.int32), tf.constant(text[:, 1:], tf.int32))


def test_estimator_runs_the_block_and_reports_its_factors():
    loss_fn, args = _tied_lm()
    est = kg.FisherEstimator(loss_fn, approximations={"tied_embedding": "kron"},
                             max_factor_size=8)
    est.update(*args)
    est.update_inverses()
    table = loss_fn.registration(*args).layers[0]
    assert table.kind == "tied_embedding"
    block = est.blocks[0]
    assert isinstance(block, fisher.TiedEmbeddingKroneckerBlock)
    assert block.roles == ("lookup", "projection")
    assert not bool(block.inverses_stale())
    vs = [tf.ones_like(v) for v in table.variables]
    assert np.all(np.isfinite(block.multiply_inverse(vs)[0].numpy()))
    row = est.memory()["layers"][0]
    assert row["block"] == "TiedEmbeddingKroneckerBlock" and row["positions"] == "expand"
    assert [(f["label"], f["dim"], f["layout"]) for f in row["factors"]] == [
        ("lookup ids", 11, "diagonal"), ("lookup grads", 8, "full"),
        ("projection inputs", 8, "full"), ("projection grads", 11, "diagonal (wide)")]
    # cached: K_a [V] and s_a [V] (Q wide), K_b [D, D], s_b [D], the damping
    assert row["inverses_bytes"] == 8 * (11 + 11 + 64 + 8 + 1)
    text = est.summary()
    assert "TiedEmbeddingKroneckerBlock" in text and "projection grads 11 diagonal (wide)" in text
    assert report.factors_of(block)[0][0] == "lookup ids"
    # counted costs (optimizer/costs.py), V 11 (both V factors diagonal), D 8:
    # statistics rows (11 + 64 + 64 + 11), products 2 (V D + V D^2), eigh 4 (V + 2 D^3),
    # the dense side's cube at the factorisations' rate
    eigh = 4 * (11 + 2 * 8 ** 3 / costs.FACTORISATION_RATE)
    assert costs._block_costs(block, 10.0, 8, 1) == pytest.approx((1500.0, 1584.0, eigh))


@pytest.mark.parametrize("momentum_type", ["qmodel", pytest.param("regular",
                                                                    marks=pytest.mark.slow)])
def test_kfac_trains_the_tied_model_with_the_block(momentum_type):
    """``kg.KFAC`` with its defaults (and regular momentum) lowers the loss in
    20 steps with no skipped step."""
    loss_fn, args = _tied_lm()
    opt = kg.KFAC(loss_fn, approximations={"tied_embedding": "kron"},
                  momentum_type=momentum_type)
    losses = [float(opt.step(*args)) for _ in range(20)]
    assert isinstance(opt.estimator.blocks[0], fisher.TiedEmbeddingKroneckerBlock)
    assert all(np.isfinite(losses)) and int(opt.skipped_steps) == 0, losses
    assert losses[-1] < 0.5 * losses[0], losses
