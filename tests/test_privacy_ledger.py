"""Privacy over phases: ``DPModel.fit`` again at another batch size (or a new
noise multiplier, also ``kg.DPSGD``'s) runs its
later steps at another sampling rate (``kfac_graph/privacy/ledger.py``).

Before, the model charged every step so far at the last fit's rate: 10
steps at q = 0.5 then 10 at q = 0.1 read as 20 at q = 0.1, and epsilon
went down after more training (11.5, then 4.2). Now epsilon composes the
phases, as dp_accounting composes their events, through a save and load;
a switch between Poisson and fixed-size sampling is refused."""
import dp_accounting as dpa
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg

N = 130


def _dp(sampling="poisson"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    dp = kg.DPModel(model, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    l2_norm_clip=1.0, noise_multiplier=1.0, seed=0, sampling=sampling)
    dp.compile(optimizer=keras.optimizers.SGD(0.1))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 4)).astype("float32")
    return dp, x, (x[:, 0] > 0).astype("int32")


def _composed(phases, accountant):
    acc = dpa.rdp.RdpAccountant() if accountant == "rdp" else dpa.pld.PLDAccountant()
    for rate, steps in phases:
        acc.compose(dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(rate, dpa.GaussianDpEvent(1.0)), steps))
    return acc.get_epsilon(1e-5)


@pytest.mark.slow
def test_epsilon_composes_the_phases_of_two_fits(tmp_path):
    dp, x, y = _dp()
    dp.fit(x, y, batch_size=65, epochs=5, verbose=0)  # 2 steps an epoch at q = 0.5
    first = dp.epsilon()
    assert int(dp.optimizer.iterations) == 10
    assert first == pytest.approx(_composed([(0.5, 10)], "rdp"), rel=1e-9)
    dp.fit(x, y, batch_size=13, epochs=1, verbose=0)  # 10 steps at q = 0.1
    assert int(dp.optimizer.iterations) == 20
    for accountant in ("rdp", "pld"):
        assert dp.epsilon(accountant=accountant) == pytest.approx(
            _composed([(0.5, 10), (0.1, 10)], accountant), rel=1e-6)
    assert dp.epsilon() > first
    statement = dp.privacy_statement()
    assert "2 phases, 20 steps" in statement and "q = 0.5" in statement, statement
    assert "q = 0.1" in statement and f"{dp.epsilon():.3f}" in statement, statement
    dp.fit(x, y, batch_size=13, epochs=1, verbose=0)  # the same sampler: the same phase
    assert len(dp._ledger.phases) == 1
    assert dp.epsilon() == pytest.approx(_composed([(0.5, 10), (0.1, 20)], "rdp"), rel=1e-9)
    dp.save(tmp_path / "dp.keras")
    loaded = keras.models.load_model(tmp_path / "dp.keras")
    assert loaded.epsilon() == pytest.approx(dp.epsilon(), rel=1e-12)


def test_a_switch_between_poisson_and_fixed_sampling_is_refused():
    dp, x, y = _dp("fixed")
    dp.fit(x, y, batch_size=13, epochs=1, verbose=0)
    dp.sampler_kind = "poisson"
    with pytest.raises(ValueError, match=r"kg.DPModel.fit: the steps so far were drawn by "
                                         r"fixed sampling .* no one guarantee composes them"):
        dp.fit(x, y, batch_size=13, epochs=1, verbose=0)
    assert int(dp.optimizer.iterations) == 10
    assert dp.epsilon() == pytest.approx(kg.privacy.epsilon(
        1.0, 1e-5, steps=10, num_examples=N, batch_size=13, sampling="fixed"), rel=1e-9)


def test_a_new_noise_multiplier_ends_a_phase_and_reaches_the_step():
    """The compiled step read the noise multiplier and the clip when traced:
    set later, the step kept the old ones while epsilon was computed at the
    new noise. Setting either traces the step anew; the noise ends a phase."""
    dp, x, y = _dp()
    dp.fit(x, y, batch_size=13, epochs=1, verbose=0)  # 10 steps at q = 0.1, sigma 1
    dp.noise_multiplier = 2.0
    dp.fit(x, y, batch_size=13, epochs=1, verbose=0)
    acc = dpa.rdp.RdpAccountant()
    for sigma in (1.0, 2.0):
        acc.compose(dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(sigma)), 10))
    assert dp.epsilon() == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    dp.noise_multiplier, dp.l2_norm_clip = 0.0, 1e9  # the step is then plain SGD's
    model = dp.model
    with tf.GradientTape() as tape:
        loss = dp._keras_loss(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    before = [v.numpy() for v in model.trainable_variables]
    dp.sampler_kind = "fixed"  # (noise 0: no guarantee to compose, so no refusal)
    dp.fit(kg.privacy.fixed_size_batches((x, y), N, steps=1, seed=0), epochs=1, verbose=0)
    for v, b, g in zip(model.trainable_variables, before, grads):
        np.testing.assert_allclose(b - v.numpy(), 0.1 * g.numpy(), rtol=1e-4, atol=1e-7)
    assert dp.epsilon() == float("inf")


def test_dpsgd_options_set_later_reach_the_step():
    """kg.DPSGD's compiled step read its learning rate, clip and noise when
    traced: set later, they changed nothing. Setting one traces the step
    anew, and a new noise multiplier ends a phase of its ledger."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((8, 4)), tf.float32)
    y = tf.constant(rng.integers(0, 2, 8))

    def loss(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    dp = kg.DPSGD(loss, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0,
                  sample_rate=0.1)
    for _ in range(3):
        dp.step(x, y)
    dp.noise_multiplier = 2.0
    for _ in range(2):
        dp.step(x, y)
    acc = dpa.rdp.RdpAccountant()
    for sigma, steps in ((1.0, 3), (2.0, 2)):
        acc.compose(dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(sigma)), steps))
    assert dp.epsilon(1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    assert "2 phases, 5 steps" in dp.privacy_statement(1e-5)
    before = [v.numpy() for v in model.trainable_variables]
    dp.learning_rate = 0.0
    dp.step(x, y)
    assert all(np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables))
