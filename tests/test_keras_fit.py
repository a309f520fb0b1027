"""kg.KFACModel: K-FAC through Keras's fit, with metrics and callbacks."""
import os

import keras
import numpy as np
import pytest

import kfac_graph as kg

def _data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 10)).astype("float32")
    w = rng.normal(size=(10, 3))
    y = np.argmax(x @ w + 0.3 * rng.normal(size=(n, 3)), axis=1)
    return x, y


def _model(seed=0, **options):
    keras.utils.set_random_seed(seed)
    inner = keras.Sequential([keras.Input((10,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(3)])
    options.setdefault("damping", 1e-2)
    model = kg.KFACModel(inner, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         **options)
    model.compile(metrics=["accuracy"])
    return model


def test_fit_with_metrics_and_callbacks(tmp_path):
    x, y = _data()
    model = _model()
    weights = tmp_path / "ckpt.weights.h5"
    logs = tmp_path / "tb"
    stop = keras.callbacks.EarlyStopping(monitor="loss", min_delta=100.0, patience=2)
    callbacks = [stop, keras.callbacks.ModelCheckpoint(str(weights), save_weights_only=True),
                 keras.callbacks.TensorBoard(str(logs))]
    history = model.fit(x, y, batch_size=64, epochs=10, verbose=0, callbacks=callbacks)
    losses = history.history["loss"]
    assert len(losses) == 3, "EarlyStopping (min_delta=100, patience=2) stops after 3 epochs"
    assert stop.stopped_epoch == 2
    assert losses[-1] < 0.7 * losses[0]
    assert "accuracy" in history.history and history.history["accuracy"][-1] > 0.7
    assert weights.exists()
    assert any(files for _, _, files in os.walk(logs)), "TensorBoard wrote no event file"
    assert int(model.kfac.iterations.numpy()) == 12
    assert int(model.optimizer.iterations.numpy()) == 12
    loss, accuracy = model.evaluate(x, y, verbose=0)
    assert np.isfinite(loss) and accuracy > 0.7
    assert model.predict(x[:5], verbose=0).shape == (5, 3)


@pytest.mark.slow  # K-FAC's state round-trips in test_optimizer.py's checkpoint test (fast)
def test_checkpoint_restores_kfac_state(tmp_path):
    """Weights and K-FAC's state (factors, inverses, counters) round-trip
    through save_weights/load_weights, also into a model not trained yet."""
    x, y = _data()
    path = str(tmp_path / "state.weights.h5")
    a = _model()
    a.fit(x, y, batch_size=64, epochs=1, verbose=0)
    a.save_weights(path)
    b = _model(seed=1)  # other initial weights
    b.load_weights(path)
    for model in (a, b):  # one more step each, same batch
        model.fit(x[:64], y[:64], batch_size=64, epochs=1, verbose=0, shuffle=False)
    for u, v in zip(a.variables, b.variables):
        np.testing.assert_array_equal(u.numpy(), v.numpy())
    state_a = a.optimizer.kfac_variables(a.model.variables)
    state_b = b.optimizer.kfac_variables(b.model.variables)
    assert len(state_a) == len(state_b) > 3
    for u, v in zip(state_a, state_b):
        np.testing.assert_array_equal(u.numpy(), v.numpy())
    assert int(b.kfac.iterations.numpy()) == 5


def test_learning_rate_callback_reaches_kfac():
    x, y = _data(128)
    model = _model(learning_rate=0.2, momentum_type="regular")  # qmodel picks its own rate
    history = model.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[
        keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.2 * 0.5 ** epoch)])
    assert history.history["learning_rate"] == pytest.approx([0.2, 0.1])
    assert float(model.kfac.learning_rate.numpy()) == pytest.approx(0.1)


def test_misuse_is_reported():
    inner = keras.Sequential([keras.Input((10,)), keras.layers.Dense(3)])
    model = kg.KFACModel(inner, loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="K-FAC"):
        model.compile(optimizer="adam")
    model.compile()
    x, y = _data(32)
    model.fit(x, y, sample_weight=np.ones(32), batch_size=16, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="every batch needs sample weights or none"):
        model.fit(x, y, batch_size=16, verbose=0)
    plain = kg.KFACModel(inner, loss=lambda t, p: keras.losses.sparse_categorical_crossentropy(
        t, p, from_logits=True))
    plain.compile()
    with pytest.raises(ValueError, match="need a keras.losses.Loss"):
        plain.fit(x, y, sample_weight=np.ones(32), verbose=0)
    with pytest.raises(ValueError, match="needs a loss"):
        kg.KFACModel(inner).compile()


def test_per_token_sample_weights_train_as_kfac_on_the_weighted_loss():
    """``fit(x, y, sample_weight=mask)`` on a token model (a causal LM's padding
    mask, ``[B, T]``) takes the steps ``kg.KFAC`` takes on ``loss(y, model(x),
    sample_weight=mask)``, batch for batch."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 12, (32, 6))
    mask = (rng.uniform(size=(32, 6)) < 0.8).astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def inner():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,)), keras.layers.Embedding(12, 8),
                                 keras.layers.Dense(12)])

    fitted = kg.KFACModel(inner(), loss=loss, damping=1e-2, momentum_type="regular")
    fitted.compile()
    fitted.fit(ids, ids, sample_weight=mask, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = inner()

    @kg.auto_register
    def weighted(x, y, w):
        return loss(y, model(x, training=True), sample_weight=w)

    opt = kg.KFAC(weighted, damping=1e-2, momentum_type="regular")
    for _ in range(2):
        for start in (0, 16):
            batch = slice(start, start + 16)
            opt.step(ids[batch], ids[batch], mask[batch])
    for u, v in zip(fitted.model.variables, model.variables):
        np.testing.assert_allclose(u.numpy(), v.numpy(), rtol=1e-5, atol=1e-6)
    assert float(loss(ids, model(ids), sample_weight=mask)) < float(
        loss(ids, inner()(ids), sample_weight=mask))


@pytest.mark.slow
def test_full_model_save_and_load(tmp_path):
    x, y = _data()
    a = _model()
    a.fit(x, y, batch_size=64, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    a.save(path)
    b = keras.models.load_model(path)
    assert isinstance(b, kg.KFACModel)
    np.testing.assert_allclose(b.evaluate(x, y, verbose=0), a.evaluate(x, y, verbose=0))
    b.fit(x[:64], y[:64], batch_size=64, epochs=1, verbose=0)
    assert int(b.kfac.iterations.numpy()) == 5


def test_an_unreduced_keras_loss_is_averaged():
    """``reduction=None`` (or ``"none"``, as TensorFlow Privacy's tutorials
    write it) trains on the batch mean, the steps those of the default
    reduction. Before: "returns a tensor of shape (32,); it must return a
    scalar loss"."""
    x, y = _data(64)
    runs = []
    for reduction in (None, "none", "sum_over_batch_size"):
        keras.utils.set_random_seed(0)
        inner = keras.Sequential([keras.Input((10,)), keras.layers.Dense(3)])
        model = kg.KFACModel(inner, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=reduction))
        model.compile()
        history = model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
        runs.append((history.history["loss"], [v.numpy() for v in inner.trainable_variables]))
    for losses, weights in runs[:2]:
        np.testing.assert_allclose(losses, runs[2][0], rtol=1e-6)
        for a, b in zip(weights, runs[2][1]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_loss_weights_weigh_each_outputs_loss():
    """``compile(loss_weights=...)`` weighs each output's loss in the steps,
    as in Keras's: the run equals one with the weight written into the loss
    (before, the weights reached evaluate alone and fit trained on the plain
    sum, logging 3.04 where Keras logged 18.9)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6)).astype("float32"), rng.integers(0, 3, 32)
    t = rng.normal(size=(32, 2)).astype("float32")
    mse = keras.losses.MeanSquaredError()
    runs = []
    for value_loss, weights in ((mse, {"label": 1.0, "value": 10.0}),
                                (lambda a, b: 10.0 * mse(a, b), None)):
        keras.utils.set_random_seed(0)
        i = keras.Input((6,))
        h = keras.layers.Dense(8, activation="tanh")(i)
        inner = keras.Model(i, {"label": keras.layers.Dense(3, name="label")(h),
                                "value": keras.layers.Dense(2, name="value")(h)})
        model = kg.KFACModel(inner, loss={
            "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "value": value_loss})
        model.compile(loss_weights=weights)
        history = model.fit(x, {"label": y, "value": t}, batch_size=32, epochs=2, verbose=0,
                            shuffle=False)
        runs.append((history.history["loss"], [v.numpy() for v in inner.trainable_variables]))
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-6)
    for a, b in zip(runs[0][1], runs[1][1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
