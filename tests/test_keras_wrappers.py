"""``kg.KFACModel`` and ``kg.DPModel`` used as a Keras user uses ``fit``:

- a two-output model logs each output's loss (``label_loss``,
  ``value_loss``) as Keras does; before, those logs were 0, or what the
  last ``evaluate`` left;
- ``export`` serves the wrapped model (before: "the model provided has
  never called");
- DPModel on a Sequential without an ``Input`` (before: "Unknown
  variable", the optimizer built before the model);
- DPModel refuses a dataset whose third element is not a 0/1 padding mask
  (before, sample weights of 10 were read as the mask and scaled each
  clipped gradient to 10 times the clip norm), and a batch larger than the
  data, in one line;
- DPModel applies its gradient past a `LossScaleOptimizer` (mixed_float16);
- KFACModel warns that a learning-rate callback does nothing under
  ``momentum_type="qmodel"``.
"""
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg

N = 32


def _two_outputs():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh")(inputs)
    model = keras.Model(inputs, {"label": keras.layers.Dense(3, name="label")(h),
                                 "value": keras.layers.Dense(2, name="value")(h)})
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 4)).astype("float32")
    y = {"label": rng.integers(0, 3, N), "value": rng.standard_normal((N, 2)).astype("float32")}
    losses = {"label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              "value": keras.losses.MeanSquaredError()}
    return model, x, y, losses


@pytest.mark.parametrize("wrapper", [pytest.param("kfac", marks=pytest.mark.slow), "dp"])
def test_each_outputs_loss_is_logged(wrapper):
    model, x, y, losses = _two_outputs()
    if wrapper == "kfac":
        fitted = kg.KFACModel(model, loss=losses)
        fitted.compile(loss_weights={"label": 1.0, "value": 0.5})
    else:
        fitted = kg.DPModel(model, loss=losses, l2_norm_clip=1e9, noise_multiplier=0.0,
                            sampling="fixed")
        fitted.compile(optimizer=keras.optimizers.SGD(0.1),
                       loss_weights={"label": 1.0, "value": 0.5})
    before = fitted.evaluate(x, y, batch_size=N, verbose=0, return_dict=True)
    if wrapper == "kfac":
        history = fitted.fit(x, y, batch_size=N, epochs=1, shuffle=False, verbose=0)
    else:  # one step on every example (fixed-size batches of N)
        history = fitted.fit(kg.privacy.fixed_size_batches((x, y), N, steps=1, seed=0),
                             epochs=1, verbose=0)
    logs = {k: v[0] for k, v in history.history.items()}
    for name in ("label_loss", "value_loss"):  # one step, at the weights evaluate saw
        assert logs[name] == pytest.approx(before[name], rel=1e-5), (logs, before)
    assert logs["loss"] == pytest.approx(logs["label_loss"] + 0.5 * logs["value_loss"],
                                         rel=1e-5)


@pytest.mark.parametrize("wrapper", ["kfac", "dp"])
def test_export_serves_the_wrapped_model(wrapper, tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    fitted = (kg.KFACModel(model, loss=loss) if wrapper == "kfac"
              else kg.DPModel(model, loss=loss, noise_multiplier=0.5))
    fitted.compile(**({} if wrapper == "kfac" else {"optimizer": "sgd"}))
    x = np.random.default_rng(0).standard_normal((N, 4)).astype("float32")
    fitted.fit(x, np.zeros(N, "int32"), batch_size=8, epochs=1, verbose=0)
    fitted.export(str(tmp_path / "served"), verbose=False)
    served = tf.saved_model.load(str(tmp_path / "served"))
    np.testing.assert_allclose(served.serve(x), model.predict(x, verbose=0), rtol=1e-6)


def test_dp_model_on_a_sequential_without_an_input():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
    dp = kg.DPModel(model, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    noise_multiplier=0.5, seed=0)
    dp.compile(optimizer=keras.optimizers.SGD(0.1))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((N, 4)).astype("float32"), rng.integers(0, 3, N)
    history = dp.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0]) and int(dp.optimizer.iterations) == 4
    assert len(dp.optimizer.variables) > 1  # built with the model's variables


def test_dp_model_refuses_weights_read_as_the_padding_mask_and_a_batch_beyond_the_data():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((N, 4)).astype("float32"), rng.integers(0, 3, N)
    dp = kg.DPModel(model, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    noise_multiplier=0.5, seed=0, sample_rate=0.25, num_examples=N)
    dp.compile(optimizer=keras.optimizers.SGD(0.1))
    before = [v.numpy() for v in model.trainable_variables]
    for weight, ok in ((10.0, False), (1.0, True)):
        data = tf.data.Dataset.from_tensor_slices(
            (x, y, np.full(N, weight, "float32"))).batch(8)
        if ok:
            dp.fit(data, epochs=1, verbose=0)
            continue
        with pytest.raises(ValueError, match=r"third element is read as the padding mask .* "
                                             r"sample_weight=w"):
            dp.fit(data, epochs=1, verbose=0)
        assert all(np.array_equal(b, v.numpy()) for b, v in zip(before,
                                                                model.trainable_variables))
    with pytest.raises(ValueError, match=rf"batch_size 40 is more than the {N} examples"):
        dp.fit(x, y, batch_size=40, epochs=1, verbose=0)


def test_kfac_model_warns_that_qmodel_reads_no_learning_rate_callback():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    x = np.random.default_rng(0).standard_normal((N, 4)).astype("float32")
    for momentum, warns in (("qmodel", True), ("regular", False)):
        fitted = kg.KFACModel(model, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), momentum_type=momentum)
        fitted.compile()
        callback = keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # fit warns before its first step: 0 epochs
            fitted.fit(x, np.zeros(N, "int32"), batch_size=8, epochs=0, verbose=0,
                       callbacks=[callback])
        said = [str(w.message) for w in caught if "qmodel" in str(w.message)]
        assert bool(said) == warns, said


def test_dp_model_under_mixed_float16_steps_by_the_unscaled_gradient():
    """Under the ``mixed_float16`` policy Keras's ``compile`` wraps the optimizer
    in a ``LossScaleOptimizer``, which divides what it is given by its scale
    (32768): DPModel's private gradient, of the unscaled loss, moved the
    weights 32768 times too little. It is applied by the inner optimizer."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3, dtype="float32")])
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 4)).astype("float32"), rng.integers(0, 3, 16)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        value = loss(y, model(x, training=True))
    grads = tape.gradient(value, model.trainable_variables)
    before = [v.numpy() for v in model.trainable_variables]
    dp = kg.DPModel(model, loss=loss, l2_norm_clip=1e9, noise_multiplier=0.0, sampling="fixed")
    dp.compile(optimizer=keras.optimizers.SGD(0.1))
    assert type(dp.optimizer).__name__ == "LossScaleOptimizer"
    dp.fit(kg.privacy.fixed_size_batches((x, y), 16, steps=1, seed=0), epochs=1, verbose=0)
    for v, b, g in zip(model.trainable_variables, before, grads):
        np.testing.assert_allclose(b - v.numpy(), 0.1 * g.numpy(), rtol=1e-2, atol=1e-4,
                                   err_msg=v.name)
