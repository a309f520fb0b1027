"""Privacy accounting: dp-accounting's numbers, calibration, statements."""
import math

import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg

MNIST = dict(num_examples=60000, batch_size=256, epochs=60)


def test_the_standard_mnist_setting_matches_dp_accounting():
    # Abadi et al.'s MNIST setting as TensorFlow Privacy's tutorial states it
    rdp = kg.privacy.epsilon(1.1, 1e-5, **MNIST)
    pld = kg.privacy.epsilon(1.1, 1e-5, accountant="pld", **MNIST)
    assert round(rdp, 2) == 2.60
    assert round(pld, 2) == 2.38
    assert kg.privacy.Sampling.make(num_examples=60000, batch_size=256).steps_for_epochs(60) \
        == math.ceil(60 * 60000 / 256)


def test_fixed_size_batches_are_accounted_without_replacement():
    poisson = kg.privacy.epsilon(1.1, 1e-5, **MNIST)
    fixed = kg.privacy.epsilon(1.1, 1e-5, sampling="fixed", **MNIST)
    assert fixed > poisson  # replace-one adjacency: about twice the sensitivity
    with pytest.raises(ValueError, match="PLD accountant does not support fixed-size"):
        kg.privacy.epsilon(1.1, 1e-5, sampling="fixed", accountant="pld", **MNIST)


@pytest.mark.parametrize("target", [1.0, 3.0, 8.0])
def test_noise_for_epsilon_inverts_epsilon(target):
    setting = dict(epochs=20, num_examples=1437, batch_size=64)
    sigma = kg.privacy.noise_for_epsilon(target, 1e-5, **setting)
    got = kg.privacy.epsilon(sigma, 1e-5, **setting)
    assert got <= target
    assert got > target * 0.99  # the least noise that meets it, to rtol 1e-3
    assert kg.privacy.epsilon(sigma * (1 - 2e-3), 1e-5, **setting) > target


def test_noise_for_epsilon_by_pld():
    setting = dict(steps=200, sample_rate=0.01)
    sigma = kg.privacy.noise_for_epsilon(1.0, 1e-5, rtol=1e-2, accountant="pld", **setting)
    got = kg.privacy.epsilon(sigma, 1e-5, accountant="pld", **setting)
    assert 0.95 < got <= 1.0
    assert sigma < kg.privacy.noise_for_epsilon(1.0, 1e-5, **setting)  # PLD is tighter


def test_step_accountant_matches_epsilon_at_every_step_count():
    s = kg.privacy.Sampling.make(sample_rate=0.01)
    acc = kg.privacy.StepAccountant(0.9, s)
    for steps in (0, 1, 37, 1000):
        want = kg.privacy.epsilon(0.9, 1e-6, steps=steps, sample_rate=0.01)
        assert acc.epsilon(steps, 1e-6) == pytest.approx(want, rel=1e-12)
    assert acc.epsilon(10, 1e-6, accountant="pld") < acc.epsilon(10, 1e-6)
    assert kg.privacy.StepAccountant(0.0, s).epsilon(1, 1e-6) == math.inf


def test_statement_names_the_sampler_the_rate_the_steps_and_epsilon():
    text = kg.privacy.statement(1.1, 1e-5, **MNIST)
    assert "Poisson sampling" in text and "q = 0.00426667" in text
    assert "14063 steps" in text and "noise multiplier 1.1" in text
    assert "delta = 1e-05" in text
    assert "epsilon by RDP accounting: 2.597" in text
    assert "epsilon by PLD accounting: 2.382" in text
    fixed = kg.privacy.statement(1.1, 1e-5, sampling="fixed", **MNIST)
    assert "without replacement" in fixed and "PLD" not in fixed


@pytest.mark.parametrize("kwargs, message", [
    (dict(sample_rate=1.5, steps=1), "sampling rate must be in"),
    (dict(steps=1), "give sample_rate, or num_examples and batch_size"),
    (dict(sample_rate=0.1), "exactly one of steps and epochs"),
    (dict(sample_rate=0.1, steps=1, sampling="shuffle"), "sampling must be one of"),
    (dict(sample_rate=0.1, steps=1, accountant="gdp"), "accountant must be one of"),
    (dict(sample_rate=0.1, steps=1, sampling="fixed"), "fixed-size sampling is accounted"),
])
def test_bad_settings_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        kg.privacy.epsilon(1.0, 1e-5, **kwargs)
    assert "\n" not in str(info.value)


def test_dpsgd_epsilon_counts_its_steps():
    x = tf.random.stateless_normal([8, 3], [0, 1])
    y = tf.constant([0, 1] * 4)
    w = tf.Variable(tf.random.stateless_normal([3, 2], [0, 2]))

    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, x @ w))

    opt = kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.2,
                   num_examples=80, batch_size=8)
    assert opt.epsilon(1e-5) == 0.0
    for _ in range(3):
        opt.step(x, y)
    want = kg.privacy.epsilon(1.2, 1e-5, steps=3, sample_rate=0.1)
    assert opt.epsilon(1e-5) == pytest.approx(want, rel=1e-12)
    assert "3 steps" in opt.privacy_statement(1e-5)
    with pytest.raises(ValueError, match="DPSGD.epsilon needs the sampler"):
        kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0,
                 noise_multiplier=1.0).epsilon(1e-5)
    assert np.isfinite(opt.epsilon(1e-5, accountant="pld"))
