"""Per-token losses beyond per-example gradients: the Fisher of a weighted
per-token loss against the brute-force Jacobian Fisher (exact mode, one
column per position and class), a masked token contributing nothing to the
sampled Fisher, kg.KFAC and kg.DPSGD on a token model and on an LSTM
language model (unroll=False: the pass unrolls the loop), whose per-example
gradients and kg.verify are checked against one-example tapes too."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_reference import brute_fisher

L = keras.layers
B, T, V, D = 3, 4, 5, 3
RTOL = 1e-6


@pytest.fixture(autouse=True)
def _float64():
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")


MASK = tf.constant([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 1]], tf.float64)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.integers(0, V, (B, T)), tf.int32),
            tf.constant(rng.integers(0, V, (B, T)), tf.int32), MASK)


def _masked_mean(logits, y, w):
    ce = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
    return tf.reduce_sum(ce * w) / tf.reduce_sum(w)


def _token_model(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([L.Embedding(V, D, name="tokens"),
                              L.Dense(D, activation="tanh", name="hidden"),
                              L.Dense(V, name="logits")])
    model.build((None, T))
    return model


def _lstm_lm(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([L.Embedding(V, D, name="tokens"),
                              L.LSTM(D, return_sequences=True, unroll=False, name="lstm"),
                              L.Dense(V, name="logits")])
    model.build((None, T))
    return model


def _registered(model, loss=_masked_mean):
    @kg.auto_register
    def loss_fn(ids, y, w):
        return loss(model(ids), y, w)

    return loss_fn


def _weighted_softmax_fisher(w):
    """z [B, T*V] -> [B, T*V, T*V]: block-diagonal, token t's block
    w_t (diag p_t - p_t p_t^T) (the masked mean's weights w / sum(w))."""
    def fisher(z):
        p = tf.nn.softmax(tf.reshape(z, [B, T, V]))
        blocks = (tf.linalg.diag(p) - p[..., :, None] * p[..., None, :]) * w[..., None, None]
        return tf.linalg.LinearOperatorBlockDiag(
            [tf.linalg.LinearOperatorFullMatrix(blocks[:, t]) for t in range(T)]).to_dense()
    return fisher


def test_exact_fisher_of_a_masked_mean_equals_the_jacobian_fisher():
    model = _token_model()
    args = _data()
    fn = _registered(model)
    reg = fn.registration(*args)
    est = kg.FisherEstimator(fn, estimation_mode="exact", position_columns="separate",
                             approximations={layer.name: "full" for layer in reg.layers})
    est.update(*args)
    fisher = _weighted_softmax_fisher(MASK / tf.reduce_sum(MASK))
    ids = args[0]
    for layer, block in zip(reg.layers, est.blocks):
        want = brute_fisher(lambda p, x: tf.reshape(model(x), [B, T * V]),
                            list(layer.variables), ids, fisher)
        got = block.full_matrix().numpy()
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * np.abs(want).max(),
                                   err_msg=layer.name)
    # the columns shared by all positions (the default) add cross-position terms
    shared = kg.FisherEstimator(fn, estimation_mode="exact",
                                approximations={layer.name: "full" for layer in reg.layers})
    shared.update(*args)
    assert not np.allclose(shared.blocks[-1].full_matrix().numpy(),
                           est.blocks[-1].full_matrix().numpy(), rtol=1e-3)


def test_verify_checks_the_fisher_of_a_weighted_per_token_loss_in_exact_mode():
    model = _token_model()
    fn = _registered(model, lambda z, y, w: keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=0)(y, z))
    report = kg.verify(fn, *_data(), estimation_mode="exact")
    assert report.passed, report.table()
    assert [c.status for row in report.rows for c in row.checks if c.name == "fisher"] == [
        "pass"] * 3, report.table()


@pytest.mark.parametrize("mode", ["sampled", "empirical",
                                  pytest.param("exact", marks=pytest.mark.slow)])
def test_a_masked_token_contributes_nothing_to_the_fisher(mode):
    """Changing the ids and targets of masked tokens leaves the dense layers'
    full blocks as they were (the samples of other tokens are drawn row by
    row, unchanged). (A Kronecker block's input factor averages over every
    position, masked ones included; its output factor gets nothing from them.)"""
    model = _token_model()
    ids, y, w = _data()
    masked = tf.constant(MASK.numpy() == 0)
    other = (tf.where(masked, (ids + 1) % V, ids), tf.where(masked, (y + 2) % V, y), w)
    fn = _registered(model)
    full = {layer.name: "full" for layer in fn.registration(ids, y, w).layers[1:]}
    blocks = []
    for args in ((ids, y, w), other, (ids, y, tf.ones_like(w))):
        est = kg.FisherEstimator(fn, estimation_mode=mode, seed=3, approximations=full)
        est.update(*args)
        blocks.append([b.full_matrix().numpy() for b in est.blocks[1:]])
    for a, b in zip(blocks[0], blocks[1]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)
    assert not np.allclose(blocks[0][-1], blocks[2][-1], rtol=1e-3)


@pytest.mark.parametrize("loss", [
    _masked_mean,
    pytest.param(lambda z, y, w: keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
        y, z, sample_weight=w), marks=pytest.mark.slow),
    lambda z, y, w: keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=0)(y, z),
    pytest.param(lambda z, y, w: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        tf.reshape(y, [-1]), tf.reshape(z, [-1, V]))), marks=pytest.mark.slow),
], ids=["masked_mean", "keras_sample_weight", "keras_ignore_class", "flattened"])
def test_kfac_trains_and_dpsgd_runs_on_a_token_model(request, loss):
    model = _token_model()
    fn = _registered(model, loss)
    args = _data()
    opt = kg.KFAC(fn, learning_rate=0.1, damping=1e-2)
    losses = [float(opt.step(*args)) for _ in range(10)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses
    dp = kg.DPSGD(fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0)
    before = [v.numpy().copy() for v in model.trainable_variables]
    if request.node.callspec.id in ("masked_mean", "keras_ignore_class"):
        # divided by the batch's count of tokens: refused (test_coupling.py)
        with pytest.raises(kg.KfacGraphError, match="statistic of the whole batch's data"):
            dp.step(*args)
        assert all(np.array_equal(b, v.numpy()) for b, v in zip(before,
                                                                 model.trainable_variables))
        return
    assert np.isfinite(float(dp.step(*args)))
    assert any(not np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables))


def _masked_sum(logits, y, w):
    """The masked tokens' sum over a constant: what DP-SGD takes (the batch's
    ``sum(w)`` as divisor is a statistic of the other examples' data)."""
    ce = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
    return tf.reduce_sum(ce * w) / 8.0


@pytest.mark.parametrize("loss", [
    _masked_sum,
    lambda z, y, w: keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=0, reduction="sum")(y, z),
    lambda z, y, w: tf.reduce_mean(tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
        y, z) * w, axis=1) / tf.reduce_sum(w, axis=1)),
], ids=["masked_sum", "keras_ignore_class_sum", "own_mean"])
def test_dp_gradients_reweighting_the_weighted_terms_equal_the_clipped_sum(loss):
    """DP-SGD's "reweight" takes a second backward pass of the per-example
    terms (weighted by the tokens' weights); "materialize" clips the
    per-example gradients. Without noise they agree, and with a clip no
    example reaches they are the batch gradient."""
    model = _token_model()
    fn = _registered(model, loss)
    args = _data()
    for clip in (0.05, 1e6):
        got = {m: kg.dp_gradients(fn, *args, l2_norm_clip=clip, noise_multiplier=0.0, method=m)
               for m in ("reweight", "materialize")}
        for a, b in zip(got["reweight"], got["materialize"]):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=RTOL, atol=1e-14)
    with tf.GradientTape() as tape:
        batch = tape.gradient(fn(*args), model.trainable_variables)
    for a, b in zip(got["reweight"], batch):
        np.testing.assert_allclose(a.numpy(), tf.convert_to_tensor(b).numpy(), rtol=RTOL,
                                   atol=1e-14)


def _loop(model, args):
    """Example i's own masked-mean term, divided by the batch's sum(w)."""
    ids, y, w = args
    out = []
    for i in range(B):
        with tf.GradientTape() as tape:
            ce = tf.nn.sparse_softmax_cross_entropy_with_logits(y[i:i + 1], model(ids[i:i + 1]))
            loss = tf.reduce_sum(ce * w[i:i + 1]) / tf.reduce_sum(w)
        out.append(tape.gradient(loss, model.trainable_variables))
    return [np.stack([tf.convert_to_tensor(o[k]).numpy() for o in out])
            for k in range(len(model.trainable_variables))]


def test_lstm_language_model_with_a_masked_mean_equals_the_loop():
    model = _lstm_lm()
    fn = _registered(model)
    args = _data()
    reg = fn.registration(*args)
    assert [layer.kind for layer in reg.layers] == [
        "embedding", "dense", "dense"], reg.summary()
    assert (reg.loss.kind, reg.loss.reduction, reg.loss.weighted) == ("categorical", "sum", True)
    got = kg.per_example_gradients(fn, *args)
    want = _loop(model, args)
    for v, g, r in zip(reg.variables, got, want):
        np.testing.assert_allclose(g.numpy(), r, rtol=RTOL, atol=1e-12, err_msg=v.name)
    norms = np.sqrt(sum(np.sum(np.reshape(r, [B, -1]) ** 2, 1) for r in want))
    np.testing.assert_allclose(kg.per_example_gradient_norms(fn, *args).numpy(), norms,
                               rtol=RTOL)
    report = kg.verify(fn, *args, examples=B)
    assert report.passed, report.table()


@pytest.mark.slow
def test_kfac_trains_and_dpsgd_runs_on_an_lstm_language_model():
    model = _lstm_lm()
    fn = _registered(model)
    args = _data()
    opt = kg.KFAC(fn, learning_rate=0.1, damping=1e-2)
    losses = [float(opt.step(*args)) for _ in range(10)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses
    dp = kg.DPSGD(_registered(model, _masked_sum), learning_rate=0.1, l2_norm_clip=1.0,
                  noise_multiplier=1.0)
    assert np.isfinite(float(dp.step(*args)))
