"""Losses that are no likelihood (kind "ggn"): the curvature is the loss's
Hessian at the model output, the generalised Gauss-Newton matrix.

A Huber, log-cosh, Poisson, focal, KL or cosine loss, or a cross-entropy
with a positive weight (``tf.nn.weighted_cross_entropy_with_logits``, a
linear term of the output beside a curved one: before, the linear term
made the whole loss read as piecewise linear), has a model output the
pass finds (``passes/loss_output.py``: the first tensor of examples every
path from the variables to the loss goes through); the Fisher blocks take
``F = (1/B) sum_i J_i^T H_i J_i`` with ``H_i`` the Hessian of example i's
own loss at ``z_i``, made positive semidefinite (``kfac_graph/fisher/
ggn.py``). Checked against a brute-force ``J^T H J`` from GradientTape
Jacobians and Hessians; a loss with no curvature (L1, hinge), a loss over
the whole batch (Dice with ``axis=None``) and a head too wide are refused
or stay opaque, each with its reason.
"""
import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph.fisher.ggn import GGN
from passes.errors import LossNotFoundError

B, T, D, K = 5, 3, 3, 3
L = keras.losses


@pytest.fixture
def float64():
    """Keras losses compute in floatx: float64 for the brute-force checks."""
    keras.config.set_floatx("float64")  # (conftest restores both)
    keras.config.set_dtype_policy("float64")


def _dense(seed=0):
    rng = np.random.default_rng(seed)
    return (tf.Variable(rng.normal(size=(D, K)), name="kernel"),
            tf.Variable(rng.normal(size=(K,)) * 0.1, name="bias"))


def _targets(name, shape, seed=1):
    rng = np.random.default_rng(seed)
    if name in ("focal", "kld"):
        y = np.eye(K)[rng.integers(0, K, shape[:-1])]
        return tf.constant(y * 0.8 + 0.2 / K if name == "kld" else y)
    if name == "weighted_ce":
        return tf.constant(rng.integers(0, 2, size=shape).astype("float64"))
    if name == "poisson":
        return tf.constant(rng.poisson(2.0, size=shape).astype("float64"))
    return tf.constant(rng.normal(size=shape))


# loss(y, z) on the model output z (any activation inside the loss)
LOSSES = {
    "huber": lambda y, z: L.Huber(delta=0.5)(y, z),
    "log_cosh": lambda y, z: L.LogCosh()(y, z),
    "poisson": lambda y, z: L.Poisson()(y, tf.nn.softplus(z)),
    "focal": lambda y, z: L.CategoricalFocalCrossentropy(from_logits=True)(y, z),
    "kld": lambda y, z: L.KLDivergence()(y, tf.nn.softmax(z)),
    "cosine": lambda y, z: L.CosineSimilarity()(y, z),
    # (1 - y) z plus a curved term of z: the linear term joins the curved one
    "weighted_ce": lambda y, z: tf.reduce_mean(
        tf.nn.weighted_cross_entropy_with_logits(y, z, pos_weight=3.0)),
}


def _brute_ggn(params, x, y, loss, sample_weight=None):
    """(1/B) sum_i J_i^T H_i^+ J_i over the parameters, by GradientTape: J_i
    the Jacobian of z_i, H_i the Hessian of example i's loss (a batch of one)
    at z_i, its negative eigenvalues set to zero."""
    total = 0.0
    for i in range(x.shape[0]):
        xi, yi = x[i:i + 1], y[i:i + 1]
        wi = None if sample_weight is None else sample_weight[i:i + 1]
        with tf.GradientTape(persistent=True) as tape:
            zi = tf.einsum("...d,dk->...k", xi, params[0]) + params[1]
        jac = tape.jacobian(zi, params, experimental_use_pfor=False)
        j = np.concatenate([np.reshape(a.numpy(), [zi.shape.num_elements(), -1])
                            for a in jac], -1)
        z0 = tf.Variable(zi)
        with tf.GradientTape(persistent=True) as outer:
            with tf.GradientTape() as inner:
                li = loss(yi, z0) if wi is None else loss(yi, z0, wi)
            g = inner.gradient(li, z0)
        h = np.reshape(outer.jacobian(g, z0).numpy(), [j.shape[0], j.shape[0]])
        values, vectors = np.linalg.eigh(0.5 * (h + h.T))
        h = (vectors * np.maximum(values, 0.0)) @ vectors.T
        total = total + j.T @ h @ j
    return total / x.shape[0]


@pytest.mark.parametrize("name", list(LOSSES))
def test_keras_loss_is_ggn_and_its_block_is_brute_force(name, float64):
    params = _dense()
    x = tf.constant(np.random.default_rng(3).normal(size=(B, D)))
    y = _targets(name, (B, K))
    fn = kg.auto_register(lambda x, y: LOSSES[name](y, x @ params[0] + params[1]))
    reg = fn.registration(x, y)
    assert reg.loss.kind == "ggn", reg.loss
    assert reg.loss.output.split(":")[0] in ("add", "BiasAdd")
    assert "curvature: the loss's Hessian" in reg.summary()
    est = kg.FisherEstimator(fn, estimation_mode="exact", cov_ema_decay=0.0,
                             approximations={"dense": "full"})
    est.update(x, y)
    want = _brute_ggn(params, x, y, LOSSES[name])
    np.testing.assert_allclose(est.blocks[0].full_matrix().numpy(), want,
                               rtol=1e-8, atol=1e-12)


def _mixture_density(y, z):
    """A mixture density network's loss, 3 components of a 1-D Gaussian."""
    logits, mean, log_scale = tf.split(z, 3, axis=-1)
    log_density = -0.5 * tf.square((y - mean) / tf.exp(log_scale)) - log_scale
    return -tf.reduce_mean(tf.reduce_logsumexp(tf.nn.log_softmax(logits) + log_density, -1))


def test_mixture_density_block_is_brute_force(float64):
    """A mixture density network. Before, ``tf.split``'s output was refused
    (its rank read from its axis operand), so the output taken was the
    log-sum-exp's input, where ``-logsumexp`` is concave: its Hessian made
    positive semidefinite is zero, and so was every block, silently
    (``kg.verify``'s exact check shares the Hessian, and passed).
    ``tf.reduce_logsumexp`` adds its maximum back under a ``stop_gradient``:
    a term of no gradient, which adds no output."""
    rng = np.random.default_rng(4)
    params = (tf.Variable(rng.normal(size=(D, 9))), tf.Variable(rng.normal(size=(9,)) * 0.1))
    x, y = tf.constant(rng.normal(size=(B, D))), tf.constant(rng.normal(size=(B, 1)))
    fn = kg.auto_register(lambda x, y: _mixture_density(y, x @ params[0] + params[1]))
    reg = fn.registration(x, y)
    assert reg.loss.kind == "ggn" and reg.loss.output.split(":")[0] == "add", reg.loss  # xW + b
    est = kg.FisherEstimator(fn, estimation_mode="exact", cov_ema_decay=0.0,
                             approximations={"dense": "full"})
    est.update(x, y)
    np.testing.assert_allclose(est.blocks[0].full_matrix().numpy(),
                               _brute_ggn(params, x, y, _mixture_density), rtol=1e-8,
                               atol=1e-12)


def test_per_token_weighted_huber_block_is_brute_force(float64):
    """A ``[B, T, K]`` output, Huber per token with a ``[B, T]`` sample weight:
    ``H_i`` is block-diagonal over positions, the weights inside it; one
    column per position and class gives the exact block."""
    params = _dense()
    rng = np.random.default_rng(4)
    x = tf.constant(rng.normal(size=(B, T, D)))
    y, w = _targets("huber", (B, T, K)), tf.constant(rng.random((B, T)))
    huber = lambda y, z, w=None: L.Huber(delta=0.5)(y, z, sample_weight=w)  # noqa: E731
    fn = kg.auto_register(lambda x, y, w: huber(y, tf.einsum("btd,dk->btk", x, params[0])
                                                + params[1], w))
    reg = fn.registration(x, y, w)
    assert reg.loss.kind == "ggn"
    est = kg.FisherEstimator(fn, estimation_mode="exact", cov_ema_decay=0.0,
                             position_columns="separate", approximations={"dense": "full"})
    est.update(x, y, w)
    want = _brute_ggn(params, x, y, huber, w)
    np.testing.assert_allclose(est.blocks[0].full_matrix().numpy(), want,
                               rtol=1e-8, atol=1e-12)
    report = kg.verify(fn, x, y, w, estimation_mode="exact")
    assert report.passed, report.table()


def test_head_that_mixes_positions_takes_the_output_after_them(float64):
    """Huber on the mean over positions: the head below the dense output
    mixes positions, so the model output is the mean (a later dominator)."""
    params = _dense()
    x = tf.constant(np.random.default_rng(5).normal(size=(B, T, D)))
    y = _targets("huber", (B, K))
    fn = kg.auto_register(lambda x, y: L.Huber()(y, tf.reduce_mean(
        tf.einsum("btd,dk->btk", x, params[0]) + params[1], axis=1)))
    reg = fn.registration(x, y)
    assert reg.loss.kind == "ggn" and reg.loss.output.startswith("Mean")
    report = kg.verify(fn, x, y, estimation_mode="exact")
    assert report.passed, report.table()


def test_losses_with_no_curvature_or_no_examples_say_why(float64):
    params = _dense()
    x = tf.constant(np.random.default_rng(6).normal(size=(B, D)))
    y = _targets("huber", (B, K))
    for loss in (L.MeanAbsoluteError(), L.Hinge()):
        fn = kg.auto_register(lambda x, y: loss(y, x @ params[0] + params[1]))
        spec = fn.registration(x, y).loss
        assert spec.kind == "opaque" and "piecewise linear in the model output" in spec.reason
        with pytest.raises(kg.KfacGraphError, match="the loss is opaque"):
            kg.FisherEstimator(fn).update(x, y)
    dice = kg.auto_register(lambda x, y: L.Dice()(y, tf.sigmoid(x @ params[0] + params[1])))
    with pytest.raises(LossNotFoundError, match="no sum of per-example terms"):
        dice.registration(x, y)
    assert kg.auto_register(lambda x, y: L.Dice(axis=1)(
        y, tf.sigmoid(x @ params[0] + params[1]))).registration(x, y).loss.kind == "ggn"
    wide = tf.Variable(np.random.default_rng(7).normal(size=(D, 300)))
    fn = kg.auto_register(lambda x, y: L.CategoricalFocalCrossentropy(from_logits=True)(
        y, x @ wide))
    spec = fn.registration(x, tf.zeros([B, 300], tf.float64)).loss
    assert spec.kind == "opaque" and "300 classes, beyond the 256" in spec.reason
    # an elementwise head has a diagonal Hessian: one backward pass (ggn_blocks)
    fn = kg.auto_register(lambda x, y: L.Huber()(y, x @ wide))
    y = tf.constant(np.random.default_rng(8).normal(size=(B, 300)))
    spec = fn.registration(x, y).loss
    assert spec.kind == "ggn" and spec.blocks == ((300, 1),)
    opt = kg.KFAC(fn)
    losses = [float(opt.step(x, y)) for _ in range(3)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0


def test_a_named_loss_with_no_per_example_terms_says_what_its_rows_are(float64, caplog):
    """Dice over the whole batch, named "bernoulli" as the refusal offers:
    K-FAC has a Fisher, but each example's row is its share of the batch
    gradient, not its own loss's gradient. The registration warns and its
    summary says so; the rows still sum to the batch gradient; DP-SGD
    refuses (before: no word, rows 7e-2 from one-example tapes)."""
    params = _dense()
    x = tf.constant(np.random.default_rng(9).normal(size=(B, D)))
    y = tf.constant(np.random.default_rng(10).integers(0, 2, (B, K)), tf.float64)
    loss = lambda x, y: L.Dice()(y, tf.sigmoid(x @ params[0] + params[1]))  # noqa: E731
    fn = kg.auto_register(loss, loss="bernoulli")
    with caplog.at_level(logging.WARNING):
        reg = fn.registration(x, y)
    assert any("named 'bernoulli', but the pass read no per-example terms" in r.getMessage()
               for r in caplog.records)
    assert "no per-example terms read (" in reg.summary()
    with tf.GradientTape() as tape:
        batch = tape.gradient(loss(x, y), params)
    for row, want in zip(kg.per_example_gradients(fn, x, y), batch):
        np.testing.assert_allclose(tf.reduce_mean(row, 0), want, atol=1e-12)
    with pytest.raises(ValueError, match="did not find the per-example loss terms"):
        kg.dp_gradients(fn, x, y, l2_norm_clip=1.0, noise_multiplier=0.0)


def test_ggn_square_root_and_samples():
    """``S S^T`` is ``H`` with its negative eigenvalue set to zero; ``S eps``
    has that covariance."""
    h = np.array([[2.0, 0.5, 0.0], [0.5, 1.0, 0.3], [0.0, 0.3, -0.5]])
    values, vectors = np.linalg.eigh(h)
    want = (vectors * np.maximum(values, 0)) @ vectors.T
    n = 40000
    ggn = GGN(tf.constant(np.broadcast_to(h, (n, 3, 3))))
    np.testing.assert_allclose(ggn.fisher()[0], want, atol=1e-12)
    v = np.array([1.0, -2.0, 0.5])
    np.testing.assert_allclose(ggn.multiply_fisher(tf.constant(v[None]))[0], want @ v,
                               atol=1e-12)
    samples = ggn.sample_cotangent(tf.constant([1, 2])).numpy()
    np.testing.assert_allclose(samples.T @ samples / n, want, atol=0.05)


@pytest.mark.parametrize("name", ["huber", "focal"])
def test_kfac_with_defaults_trains_on_a_ggn_loss(name):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(7)
    x = tf.constant(rng.normal(size=(32, 6)), tf.float32)
    y = tf.cast(_targets(name, (32, K)), tf.float32)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(K)])
    fn = kg.auto_register(lambda x, y: LOSSES[name](y, model(x)))
    opt = kg.KFAC(fn)
    losses = [float(opt.step(x, y)) for _ in range(20)]
    assert all(np.isfinite(losses)) and int(opt.skipped_steps) == 0
    assert losses[-1] < 0.7 * losses[0]


def test_saved_model_with_an_unknown_batch_is_read_and_rewritten(tmp_path):
    """A SavedModel's loss with a ``None`` batch: the rows follow the Huber
    loss's comparison and select (``ir.ELEMENTWISE``), so its per-example
    terms and model output are found without example arguments, and
    ``kfac-rewrite``'s output trains and gives the in-process per-example
    gradients."""
    from tools import kfac_rewrite
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(K)])
    module = tf.Module()
    module.model = model
    module.loss = tf.function(lambda x, y: L.Huber()(y, module.model(x)),
                              input_signature=[tf.TensorSpec([None, 6]), tf.TensorSpec([None, K])])
    tf.saved_model.save(module, str(tmp_path / "input"))
    assert kg.register_saved_model(str(tmp_path / "input"), "loss").loss.kind == "ggn"
    assert kfac_rewrite.main(["kfac-rewrite", "--input", str(tmp_path / "input"), "--function",
                              "loss", "--output", str(tmp_path / "out")]) == 0
    rng = np.random.default_rng(8)
    x = tf.constant(rng.normal(size=(16, 6)), tf.float32)
    y = tf.constant(rng.normal(size=(16, K)), tf.float32)
    rewritten = tf.saved_model.load(str(tmp_path / "out"))
    fn = kg.auto_register(lambda x, y: L.Huber()(y, model(x)))
    for got, want in zip(rewritten.per_example_gradients(x, y), kg.per_example_gradients(fn, x, y)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    losses = [float(rewritten.kfac_step(x, y)) for _ in range(5)]
    assert all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses


def test_class_axis_moved_by_a_transpose(float64):
    """A cross-entropy written on ``log_softmax(axis=1)`` of channels-first
    logits: transposes that keep the examples first move the class axis and
    the head stays per position, so the output is the dense layer's and the
    block is the brute-force one (before: opaque, "op 'transpose' mixes")."""
    params = _dense()
    rng = np.random.default_rng(9)
    x = tf.constant(rng.normal(size=(B, T, D)))
    y = tf.constant(np.transpose(np.eye(K)[rng.integers(0, K, (B, T))], (0, 2, 1)))

    def cross_entropy(y, z):  # z [B, T, K]; y one-hot [B, K, T]
        logp = tf.nn.log_softmax(tf.transpose(z, (0, 2, 1)), axis=1)
        return -tf.reduce_mean(tf.reduce_sum(y * logp, axis=1))
    fn = kg.auto_register(lambda x, y: cross_entropy(
        y, tf.einsum("btd,dk->btk", x, params[0]) + params[1]))
    reg = fn.registration(x, y)
    assert reg.loss.kind == "ggn" and reg.loss.output.startswith("add")
    est = kg.FisherEstimator(fn, estimation_mode="exact", cov_ema_decay=0.0,
                             position_columns="separate", approximations={"dense": "full"})
    est.update(x, y)
    np.testing.assert_allclose(est.blocks[0].full_matrix().numpy(),
                               _brute_ggn(params, x, y, cross_entropy), rtol=1e-8, atol=1e-12)


def test_verify_notes_a_loss_with_no_curvature_at_its_output(float64):
    """``-logsumexp`` of the output is concave: its Hessian made positive
    semidefinite is zero, every block with it. ``kg.verify``'s exact check
    shares that Hessian, so it passes; the report says the curvature is
    zero, which a curved loss's does not."""
    params = _dense()
    x = tf.constant(np.random.default_rng(3).normal(size=(B, D)))
    concave = kg.auto_register(
        lambda x: -tf.reduce_mean(tf.reduce_logsumexp(x @ params[0] + params[1], -1)))
    report = kg.verify(concave, x, estimation_mode="exact")
    assert report.passed and any("is zero on every example" in n for n in report.notes), report
    huber = kg.auto_register(lambda x, y: LOSSES["huber"](y, x @ params[0] + params[1]))
    report = kg.verify(huber, x, _targets("huber", (B, K)), estimation_mode="exact")
    assert report.passed and not any("zero on every example" in n for n in report.notes)
