"""The damping rule's run of the loss at the new parameters starts from the
state the step's pass started from and leaves the state that pass left
(``kfac_graph/optimizer/loss_state.py``): a loss with dropout compares its
two losses under one draw, and batch normalisation's moving statistics and
the seed generators move once a step, as with the rule off. Before, the
rule's run drew a new mask (``rho`` compared two masks) and updated the
moving statistics a second time on every adaptation step."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg

L = keras.layers


def _problem():
    keras.utils.set_random_seed(0)
    # batch normalisation of the input: its batch statistics do not depend on
    # the parameters, so its moving mean counts the updates
    model = keras.Sequential([keras.Input((6,)), L.BatchNormalization(momentum=0.5),
                              L.Dense(8, activation="tanh"), L.Dropout(0.5), L.Dense(3)])
    x = tf.random.stateless_normal([8, 6], seed=[1, 2], dtype=tf.float64) + 3.0
    y = tf.constant([0, 1, 2, 0, 1, 2, 0, 1])
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    loss_fn = kg.auto_register(lambda x, y: ce(y, model(x, training=True)))
    return model, loss_fn, x, y


def _state(model):
    moving = [v for v in model.non_trainable_variables if "moving_mean" in v.path]
    seeds = [v for v in model.non_trainable_variables if "seed_generator" in v.path]
    return moving[0].numpy().copy(), seeds[0].numpy().copy()


def _steps(adapt, steps=3, **options):
    model, loss_fn, x, y = _problem()
    opt = kg.KFAC(loss_fn, momentum_type="regular", adapt_damping=adapt,
                  damping_adaptation_interval=1, **options)
    rhos = []
    for _ in range(steps):
        opt.step(x, y)
        rhos.append(float(opt.rho.numpy()))
    assert int(opt.skipped_steps.numpy()) == 0
    return _state(model), rhos


def test_moving_statistics_and_seeds_move_once_a_step(keras_float64):
    (moving_on, seeds_on), _ = _steps(adapt=True)
    (moving_off, seeds_off), _ = _steps(adapt=False)
    np.testing.assert_allclose(moving_on, moving_off, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(seeds_on, seeds_off)
    # (three updates of momentum 0.5 from 0 reach 7/8 of the batch mean)
    _, _, x, _ = _problem()
    np.testing.assert_allclose(moving_on, 0.875 * np.mean(x.numpy(), 0), rtol=1e-10)


def test_rho_compares_the_losses_of_one_draw(keras_float64):
    """A step of learning rate 1e-6 changes the loss by its linear term, so
    rho is 1 to first order; two dropout masks would put it far off."""
    _, rhos = _steps(adapt=True, learning_rate=1e-6)
    np.testing.assert_allclose(rhos, 1.0, atol=1e-3)


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    """The npz ``damping_rule_mirrored.py`` writes, in a fresh process."""
    out = tmp_path_factory.mktemp("mirrored") / "mirrored.npz"
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "damping_rule_mirrored.py")
    proc = subprocess.run([sys.executable, script, "--out", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return np.load(out)


def test_under_mirrored_strategy_each_replica_restores_its_own_state(mirrored):
    """Each replica's run of the rule starts from its own state and puts it
    back, and is the registered graph's loss: a Keras loss traced in
    ``strategy.run`` divides itself by the replicas, so the rule had
    compared the loss with half of it (``rho`` 4.5e5 at this learning rate,
    the damping then lowered at every adaptation). Replica 0 also moved its
    statistics twice a step."""
    r = mirrored
    assert int(r["skipped"]) == 0
    np.testing.assert_allclose(r["rhos"], 1.0, atol=1e-3)
    # each replica normalises its half of the batch: three updates of
    # momentum 0.5 from 0 reach 7/8 of that half's mean, and drew 3 masks
    halves = np.split(r["x"], 2)
    for replica, half in enumerate(halves):
        np.testing.assert_allclose(r["moving"][replica], 0.875 * half.mean(0), rtol=1e-10)
    np.testing.assert_array_equal(r["seeds"][:, 1], [3, 3])


def test_synchronized_batch_statistics_are_refused_under_two_replicas(mirrored):
    """``BatchNormalization(synchronized=True)`` all-reduces its moments across
    the replicas; each replica's K-FAC step runs the registered loss, one
    device's, with its own share's statistics: the model trained exactly as
    with ``synchronized=False`` (parameters 0.0998 from one device's after 3
    steps on 2 replicas, equal to the unsynchronized run's to the last
    digit). Now one line, naming where the loss reads across replicas, and
    the model's variables untouched."""
    refusal = str(mirrored["refusal"])
    assert "reads across replicas at " in refusal and "/synced_norm" in refusal, refusal
    assert "\n" not in refusal
    assert bool(mirrored["unchanged"])
