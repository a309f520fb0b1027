"""kg.DPModel: Keras fit with DP-SGD, Poisson sampling and epsilon in the logs."""
import glob
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))


def _small(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
                              keras.layers.Dense(3)])
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((40, 4)).astype("float32")
    y = rng.integers(0, 3, 40).astype("int32")
    return model, x, y


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_digits_reach_90_percent_at_epsilon_8():
    import dp_digits
    accuracy, spent, sigma, dp = dp_digits.train(8.0, epochs=10, batch_size=128, seed=0)
    assert spent <= 8.0
    assert accuracy >= 0.90, accuracy
    history = dp.history.history
    assert len(history["epsilon"]) == 10 and history["epsilon"][-1] == pytest.approx(spent)
    assert np.all(np.diff(history["epsilon"]) > 0)


def test_without_noise_and_clipping_a_step_is_the_optimizers_step():
    model, x, y = _small()
    before = [v.numpy() for v in model.trainable_variables]
    with tf.GradientTape() as tape:
        loss = _loss()(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    dp = kg.DPModel(model, loss=_loss(), l2_norm_clip=1e9, noise_multiplier=0.0)
    dp.compile(optimizer=keras.optimizers.SGD(0.1))
    batches = kg.privacy.fixed_size_batches((x, y), 40, steps=1, seed=0)
    history = dp.fit(batches, epochs=1, verbose=0)
    for v, b, g in zip(model.trainable_variables, before, grads):
        np.testing.assert_allclose(v.numpy(), b - 0.1 * g.numpy(), rtol=1e-5, atol=1e-6)
    assert history.history["loss"][0] == pytest.approx(float(loss), rel=1e-5)
    assert history.history["epsilon"] == [np.inf]


def test_the_logged_loss_holds_the_models_own_losses():
    """A layer's ``add_loss`` term and a kernel regularizer: the step and the
    logged loss are Keras's SGD's (before, the log left them out: 1.28
    where Keras logged 3.13)."""
    class Penalised(keras.layers.Layer):
        def call(self, h):
            self.add_loss(0.5 * tf.reduce_mean(tf.reduce_sum(tf.square(h), axis=1)))
            return h

    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), Penalised(),
            keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.1))])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6)).astype("float32"), rng.integers(0, 3, 32)
    plain = model()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    want = plain.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False).history["loss"]
    inner = model()
    dp = kg.DPModel(inner, loss=_loss(), l2_norm_clip=1e9, noise_multiplier=0.0)
    dp.compile(optimizer=keras.optimizers.SGD(0.1))
    got = dp.fit(kg.privacy.fixed_size_batches((x, y), 32, steps=1, seed=0), epochs=1,
                 verbose=0).history["loss"]
    assert got == pytest.approx(want, rel=1e-5)
    for a, b in zip(plain.trainable_variables, inner.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", [None, "sum"])
def test_unreduced_and_summed_losses(reduction):
    """An unreduced loss (TensorFlow Privacy's tutorials ask for one) trains
    on the batch mean, its step the default reduction's (before, it was
    refused as not scalar); a summed one logs the sum, as Keras does (before,
    the mean: 1.28 where Keras logged 41.0)."""
    model, x, y = _small()
    before = [v.numpy() for v in model.trainable_variables]
    mean = _loss()
    with tf.GradientTape() as tape:
        loss = mean(y, model(x, training=True)) * (len(x) if reduction == "sum" else 1)
    grads = tape.gradient(loss, model.trainable_variables)
    dp = kg.DPModel(model, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=reduction), l2_norm_clip=1e9, noise_multiplier=0.0)
    dp.compile(optimizer=keras.optimizers.SGD(0.01))
    history = dp.fit(kg.privacy.fixed_size_batches((x, y), len(x), steps=1, seed=0),
                     epochs=1, verbose=0)
    for v, b, g in zip(model.trainable_variables, before, grads):
        np.testing.assert_allclose(v.numpy(), b - 0.01 * g.numpy(), rtol=1e-5, atol=1e-6)
    assert history.history["loss"][0] == pytest.approx(float(loss), rel=1e-5)


@pytest.mark.slow  # loss_weights: test_keras_fit.py's K-FAC case in the fast set
def test_loss_weights_weigh_each_outputs_loss():
    """``compile(loss_weights=...)``: the step and the logged loss are Keras's
    SGD's on the weighted sum (before, the plain sum: 3.04 where Keras logged
    18.9)."""
    def model():
        keras.utils.set_random_seed(0)
        i = keras.Input((6,))
        h = keras.layers.Dense(8, activation="tanh")(i)
        return keras.Model(i, {"label": keras.layers.Dense(3, name="label")(h),
                               "value": keras.layers.Dense(2, name="value")(h)})
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6)).astype("float32"), rng.integers(0, 3, 32)
    targets = {"label": y, "value": rng.normal(size=(32, 2)).astype("float32")}
    losses = {"label": _loss(), "value": keras.losses.MeanSquaredError()}
    plain = model()
    plain.compile(optimizer=keras.optimizers.SGD(0.01), loss=losses,
                  loss_weights={"label": 1.0, "value": 10.0})
    want = plain.fit(x, targets, batch_size=32, epochs=1, verbose=0,
                     shuffle=False).history["loss"]
    inner = model()
    dp = kg.DPModel(inner, loss=losses, l2_norm_clip=1e9, noise_multiplier=0.0)
    dp.compile(optimizer=keras.optimizers.SGD(0.01), loss_weights={"label": 1.0, "value": 10.0})
    got = dp.fit(kg.privacy.fixed_size_batches((x, targets), 32, steps=1, seed=0), epochs=1,
                 verbose=0).history["loss"]
    assert got == pytest.approx(want, rel=1e-5)
    for a, b in zip(plain.trainable_variables, inner.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    # targets as a list in the outputs' order, on arrays (the sampler's dataset
    # returned the list, which tf.data refuses)
    dp.fit(x, [targets["label"], targets["value"]], batch_size=16, epochs=1, verbose=0)


def test_a_keras_py_dataset_or_a_generator_is_streamed_as_a_dataset():
    """Batches from a ``keras.utils.PyDataset`` or a generator are taken as
    they come, the sampler as the constructor states it (before: "needs
    targets y", the input read as arrays)."""
    model, x, y = _small()

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return x[10 * i:10 * (i + 1)], y[10 * i:10 * (i + 1)]

    def generator():
        yield from (Batches()[i] for i in range(4))
    for data in (Batches(), generator()):
        dp = kg.DPModel(model, loss=_loss(), l2_norm_clip=1.0, noise_multiplier=1.0,
                        sampling="fixed", num_examples=40, batch_size=10)
        dp.compile(optimizer=keras.optimizers.SGD(0.1))
        history = dp.fit(data, epochs=1, verbose=0).history
        assert np.isfinite(history["loss"][0]) and np.isfinite(history["epsilon"][0])
        assert int(dp.optimizer.iterations) == 4


def test_per_token_sample_weights_step_as_the_weighted_loss():
    """``fit(x, y, sample_weight=mask)`` on token sequences (a causal LM's
    padding mask): without noise and clipping, a step over the whole data set
    (fixed-size batches of all of it) is the optimizer's step on
    ``loss(y, model(x), sample_weight=mask)``, whose zeros count for nothing."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Embedding(12, 8),
                              keras.layers.Dense(12)])
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 12, (16, 6)).astype("int32")
    mask = (rng.uniform(size=(16, 6)) < 0.7).astype("float32")
    before = [v.numpy() for v in model.trainable_variables]
    with tf.GradientTape() as tape:
        loss = _loss()(ids, model(ids, training=True), sample_weight=mask)
    grads = tape.gradient(loss, model.trainable_variables)
    dp = kg.DPModel(model, loss=_loss(), l2_norm_clip=1e9, noise_multiplier=0.0,
                    sampling="fixed")
    dp.compile(optimizer=keras.optimizers.SGD(0.1))
    history = dp.fit(ids, ids, sample_weight=mask, batch_size=16, epochs=1, verbose=0)
    for v, b, g in zip(model.trainable_variables, before, grads):
        np.testing.assert_allclose(v.numpy(), b - 0.1 * tf.convert_to_tensor(g).numpy(),
                                   rtol=1e-5, atol=1e-6)
    assert history.history["loss"][0] == pytest.approx(float(loss), rel=1e-5)
    with pytest.raises(ValueError, match="sample_weight with a dataset"):
        dp.fit(tf.data.Dataset.from_tensor_slices((ids, ids)).batch(4), sample_weight=mask)
    poisson = kg.DPModel(model, loss=_loss(), l2_norm_clip=1.0, noise_multiplier=1.0)
    poisson.compile(optimizer=keras.optimizers.SGD(0.1))  # padded batches: (w, mask)
    logs = poisson.fit(ids, ids, sample_weight=mask, batch_size=4, verbose=0).history
    assert np.isfinite(logs["loss"][0]) and np.isfinite(logs["epsilon"][0])


def test_sample_weights_per_output_step_as_the_weighted_loss():
    """A model with two outputs, ``sample_weight={"label": w1, "value": w2}``:
    without noise and clipping a step over the whole data set is the
    optimizer's step on the sum of each output's weighted loss, and the
    logged loss is that sum. Before, DPModel refused the weights ("needs a
    keras.losses.Loss")."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(6, activation="tanh")(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(3, name="label")(h),
                                 keras.layers.Dense(2, name="value")(h)])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 5)).astype("float32")
    y = {"label": rng.integers(0, 3, 16), "value": rng.normal(size=(16, 2)).astype("float32")}
    w = {"label": rng.uniform(size=16).astype("float32"),
         "value": (rng.uniform(size=16) > 0.4).astype("float32")}
    losses = {"label": _loss(), "value": keras.losses.Huber()}
    before = [v.numpy() for v in model.trainable_variables]
    with tf.GradientTape() as tape:
        label, value = model(x, training=True)
        loss = (losses["label"](y["label"], label, sample_weight=w["label"])
                + losses["value"](y["value"], value, sample_weight=w["value"]))
    grads = tape.gradient(loss, model.trainable_variables)
    dp = kg.DPModel(model, loss=losses, l2_norm_clip=1e9, noise_multiplier=0.0,
                    sampling="fixed")
    dp.compile(optimizer=keras.optimizers.SGD(0.1))
    history = dp.fit(x, y, sample_weight=w, batch_size=16, epochs=1, verbose=0)
    for v, b, g in zip(model.trainable_variables, before, grads):
        np.testing.assert_allclose(v.numpy(), b - 0.1 * tf.convert_to_tensor(g).numpy(),
                                   rtol=1e-5, atol=1e-6)
    assert history.history["loss"][0] == pytest.approx(float(loss), rel=1e-5)


def test_poisson_padding_counts_for_nothing_and_the_mean_uses_the_expected_size():
    """In the step, the loss and the metrics (Keras's plain metrics take no
    sample weight: the padding rows are dropped before them)."""
    model, x, y = _small(1)
    batches = kg.privacy.poisson_batches((x, y), 0.25, steps=1, seed=4, pad_multiple=8)
    xb, yb, mask = next(iter(batches))
    real = mask.numpy() == 1
    assert not real.all()  # some padding in this draw
    before = [v.numpy() for v in model.trainable_variables]
    with tf.GradientTape() as tape:
        per_example = _loss().call(yb[real], model(xb[real], training=True))
        total = tf.reduce_sum(per_example) / 10.0  # q N = 0.25 * 40
    grads = tape.gradient(total, model.trainable_variables)
    logits = model(xb, training=True).numpy()
    accuracy = np.mean(np.argmax(logits[real], 1) == yb.numpy()[real])
    assert accuracy != np.mean(np.argmax(logits, 1) == yb.numpy())  # padding would count
    dp = kg.DPModel(model, loss=_loss(), l2_norm_clip=1e9, noise_multiplier=0.0)
    dp.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"])
    drawn = tf.data.Dataset.from_tensors((xb, yb, mask))  # the batch drawn above
    drawn.privacy_sampling = batches.privacy_sampling
    history = dp.fit(drawn, epochs=1, verbose=0)
    for v, b, g in zip(model.trainable_variables, before, grads):
        np.testing.assert_allclose(v.numpy(), b - 0.1 * g.numpy(), rtol=1e-5, atol=1e-6)
    assert history.history["loss"][0] == pytest.approx(float(tf.reduce_mean(per_example)),
                                                       rel=1e-5)
    assert history.history["accuracy"][0] == pytest.approx(accuracy)  # real rows alone


def test_epsilon_in_history_tensorboard_and_checkpoints(tmp_path):
    model, x, y = _small(2)
    dp = kg.DPModel(model, loss=_loss(), l2_norm_clip=1.0, noise_multiplier=1.0, delta=1e-4)
    dp.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"])
    ckpt = str(tmp_path / "dp.weights.h5")
    dp.fit(x, y, batch_size=20, epochs=2, verbose=0,
           callbacks=[keras.callbacks.ModelCheckpoint(ckpt, save_weights_only=True),
                      keras.callbacks.TensorBoard(str(tmp_path / "tb"))])
    assert int(dp.optimizer.iterations) == 4  # floor(40 / 20) Poisson steps per epoch
    want = kg.privacy.epsilon(1.0, 1e-4, steps=4, sample_rate=0.5)
    assert dp.epsilon() == pytest.approx(want, rel=1e-12)
    assert dp.history.history["epsilon"][-1] == pytest.approx(want, rel=1e-12)
    assert "4 steps" in dp.privacy_statement()
    tags = set()
    for path in glob.glob(str(tmp_path / "tb" / "train" / "*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags.update(v.tag for v in event.summary.value)
    assert "epoch_epsilon" in tags
    # a fresh model restored from the checkpoint resumes the privacy count
    fresh, _, _ = _small(3)
    again = kg.DPModel(fresh, loss=_loss(), l2_norm_clip=1.0, noise_multiplier=1.0,
                       delta=1e-4, sample_rate=0.5, num_examples=40)
    again.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"])
    again.optimizer.build(again.trainable_variables)
    again.load_weights(ckpt)
    for a, b in zip(fresh.weights, model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert again.epsilon() == pytest.approx(want, rel=1e-12)


def test_pld_epsilon_is_logged_per_epoch_and_per_layer_clipping_trains():
    model, x, y = _small(4)
    dp = kg.DPModel(model, loss=_loss(), l2_norm_clip=[1.0, 0.5], clipping="per_layer",
                    noise_multiplier=1.0, accountant="pld", seed=1)
    dp.compile(optimizer=keras.optimizers.SGD(0.1))
    history = dp.fit(x, y, batch_size=10, epochs=1, verbose=0)
    want = kg.privacy.epsilon(1.0, 1e-5, steps=4, sample_rate=0.25, accountant="pld")
    assert history.history["epsilon"] == [pytest.approx(want, rel=1e-9)]


def test_bad_use_is_a_one_line_error():
    model, x, y = _small()
    dp = kg.DPModel(model, loss=_loss(), l2_norm_clip=1.0, noise_multiplier=1.0)
    dp.compile(optimizer="sgd")
    weighted = tf.data.Dataset.from_tensor_slices((x, y, np.ones(40, "float32"))).batch(8)
    with pytest.warns(UserWarning, match="does not say how it was sampled"), \
            pytest.raises(ValueError, match="sample_weight and class_weight are not supported"):
        dp.fit(weighted, verbose=0)
    with pytest.raises(ValueError, match="kg.DPModel.fit: class_weight"):
        dp.fit(x, y, class_weight={0: 1.0, 1: 2.0, 2: 1.0}, verbose=0)
    with pytest.raises(ValueError, match="secure_mode refuses a fixed noise seed"):
        kg.DPModel(model, loss=_loss(), seed=1, secure_mode=True)
    with pytest.raises(ValueError, match="kg.DPModel: noise_multiplier must be"):
        kg.DPModel(model, loss=_loss(), noise_multiplier=-1.0)
    with pytest.raises(ValueError, match="the sampler is unknown"):
        kg.DPModel(model, loss=_loss()).epsilon()


def test_a_keras_file_keeps_the_model_the_sampler_and_the_count(tmp_path):
    model, x, y = _small(5)
    dp = kg.DPModel(model, loss=_loss(), l2_norm_clip=1.0, noise_multiplier=1.0, delta=1e-4)
    dp.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"])
    dp.fit(x, y, batch_size=20, epochs=1, verbose=0)
    dp.save(str(tmp_path / "dp.keras"))
    back = keras.saving.load_model(str(tmp_path / "dp.keras"))
    assert isinstance(back, kg.DPModel) and back.sampling == dp.sampling
    assert int(back.optimizer.iterations) == 2
    assert back.epsilon() == dp.epsilon()
    for a, b in zip(back.model.weights, model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_strategies_other_than_mirrored_ones_are_refused_in_one_line():
    """``compile`` refuses a strategy the step is not built for (here
    CentralStorageStrategy; TPUStrategy alike), naming it; MirroredStrategy
    and MultiWorkerMirroredStrategy train (test_distributed_keras.py,
    test_distributed_multiworker.py)."""
    strategy = tf.distribute.experimental.CentralStorageStrategy()
    with strategy.scope():
        model, _, _ = _small()
        dp = kg.DPModel(model, loss=_loss(), l2_norm_clip=1.0, noise_multiplier=1.0)
        with pytest.raises(ValueError, match="not under CentralStorageStrategy") as error:
            dp.compile(optimizer=keras.optimizers.SGD(0.1))
    assert "\n" not in str(error.value)
