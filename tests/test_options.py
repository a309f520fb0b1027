"""Options are checked where they are given: one line naming the owner, the
option, the value and what it may be (``kfac_graph/options.py``), before any
work (the loss is never called, no variable made or changed)."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import options


class CountedLoss:
    """A loss that counts its calls (traces included)."""

    def __init__(self):
        self.calls = 0
        self.w = tf.Variable(tf.ones([4, 3]))
        self.__name__ = "counted_loss"

    def __call__(self, x, y):
        self.calls += 1
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, x @ self.w))


def _raises(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value) == message
    assert "\n" not in str(info.value)


KFAC_CASES = [
    (dict(damping=-1.0), "kg.KFAC: damping must be a finite number >= 0, got -1.0"),
    (dict(damping=True), "kg.KFAC: damping must be a finite number >= 0, got True"),
    (dict(damping=float("nan")), "kg.KFAC: damping must be a finite number >= 0, got nan"),
    (dict(damping="0.1"), "kg.KFAC: damping must be a finite number >= 0, got '0.1'"),
    (dict(learning_rate="abc"), "kg.KFAC: learning_rate must be a finite number > 0, got 'abc'"),
    (dict(learning_rate=0.0), "kg.KFAC: learning_rate must be a finite number > 0, got 0.0"),
    (dict(learning_rate=float("inf")),
     "kg.KFAC: learning_rate must be a finite number > 0, got inf"),
    (dict(momentum=1.0), "kg.KFAC: momentum must be a finite number in [0, 1), got 1.0"),
    (dict(momentum=-0.1), "kg.KFAC: momentum must be a finite number in [0, 1), got -0.1"),
    (dict(momentum_type="nesterov"),
     "kg.KFAC: momentum_type must be one of 'regular', 'adam', 'qmodel', got 'nesterov'"),
    (dict(l2_reg=-1e-4), "kg.KFAC: l2_reg must be a finite number >= 0, got -0.0001"),
    (dict(norm_constraint=0.0),
     "kg.KFAC: norm_constraint must be a finite number > 0, or None, got 0.0"),
    (dict(cov_update_period=0), "kg.KFAC: cov_update_period must be an integer >= 1, or None, got 0"),
    (dict(inverse_update_period=2.5),
     "kg.KFAC: inverse_update_period must be an integer >= 1, or None, got 2.5"),
    (dict(inverse_update_period=True),
     "kg.KFAC: inverse_update_period must be an integer >= 1, or None, got True"),
    (dict(overhead_budget=1.0),
     "kg.KFAC: overhead_budget must be a finite number > 1, or None, got 1.0"),
    (dict(stagger_inverses="yes"), "kg.KFAC: stagger_inverses must be True or False, got 'yes'"),
    (dict(cov_ema_decay=1.0), "kg.KFAC: cov_ema_decay must be a finite number in [0, 1), got 1.0"),
    (dict(num_burnin_steps=-1), "kg.KFAC: num_burnin_steps must be an integer >= 0, got -1"),
    (dict(estimation_mode="fast"),
     "kg.KFAC: estimation_mode must be one of 'sampled', 'empirical', 'exact', got 'fast'"),
    (dict(num_samples=0), "kg.KFAC: num_samples must be an integer >= 1, got 0"),
    (dict(adapt_damping="false"), "kg.KFAC: adapt_damping must be True or False, got 'false'"),
    (dict(damping_adaptation_interval=0),
     "kg.KFAC: damping_adaptation_interval must be an integer >= 1, got 0"),
    (dict(damping_adaptation_decay=0.0),
     "kg.KFAC: damping_adaptation_decay must be a finite number in (0, 1], got 0.0"),
    (dict(damping_adaptation_decay=1.5),
     "kg.KFAC: damping_adaptation_decay must be a finite number in (0, 1], got 1.5"),
    (dict(min_damping=-1.0), "kg.KFAC: min_damping must be a finite number >= 0, or None, "
     "got -1.0"),
    (dict(damping=1e-3, min_damping=1e-2),
     "kg.KFAC: min_damping must be at most damping (0.001), got 0.01"),
    (dict(min_damping=0.5), "kg.KFAC: min_damping must be at most damping (0.1), got 0.5"),
    (dict(qmodel_curvature="full"),
     "kg.KFAC: qmodel_curvature must be one of 'exact', 'kfac', got 'full'"),
    (dict(seed=1.5), "kg.KFAC: seed must be an integer, got 1.5"),
    (dict(seed="0"), "kg.KFAC: seed must be an integer, got '0'"),
    (dict(jit_compile=1), "kg.KFAC: jit_compile must be one of True, False, 'auto', got 1"),
    (dict(summary_period=0), "kg.KFAC: summary_period must be an integer >= 1, got 0"),
    (dict(sync_statistics="sometimes"),
     "kg.KFAC: sync_statistics must be one of 'lazy', 'eager', got 'sometimes'"),
]


@pytest.mark.parametrize("kwargs,message", KFAC_CASES, ids=[str(c[0]) for c in KFAC_CASES])
def test_kfac_options(kwargs, message):
    loss = CountedLoss()
    before = loss.w.numpy().copy()
    _raises(lambda: kg.KFAC(loss, **kwargs), message)
    assert loss.calls == 0
    np.testing.assert_array_equal(loss.w.numpy(), before)


def test_kfac_accepts_edges_and_keeps_meanings():
    loss = CountedLoss()
    opt = kg.KFAC(loss, damping=0, momentum=0.0, momentum_type="regular", norm_constraint=None,
                  cov_ema_decay=0.0, damping_adaptation_decay=1.0, inverse_update_period=10.0,
                  seed=np.int64(3), learning_rate=np.float32(0.5), adapt_damping=np.bool_(True),
                  min_damping=0.0)
    assert opt.min_damping == 0.0 and opt.inverse_update_period == 10 and opt.estimator.seed == 3
    assert kg.KFAC(loss, damping=1e-3).min_damping == pytest.approx(1e-7)  # the default floor
    assert loss.calls == 0


ESTIMATOR_CASES = [
    (dict(damping=-1), "kg.FisherEstimator: damping must be a finite number >= 0, got -1"),
    (dict(damping=False), "kg.FisherEstimator: damping must be a finite number >= 0, got False"),
    (dict(cov_ema_decay=1.0),
     "kg.FisherEstimator: cov_ema_decay must be a finite number in [0, 1), got 1.0"),
    (dict(num_samples=0), "kg.FisherEstimator: num_samples must be an integer >= 1, got 0"),
    (dict(num_samples="2"), "kg.FisherEstimator: num_samples must be an integer >= 1, got '2'"),
    (dict(estimation_mode="fast"), "kg.FisherEstimator: estimation_mode must be one of "
     "'sampled', 'empirical', 'exact', got 'fast'"),
    (dict(seed=None), "kg.FisherEstimator: seed must be an integer, got None"),
]


@pytest.mark.parametrize("kwargs,message", ESTIMATOR_CASES,
                         ids=[str(c[0]) for c in ESTIMATOR_CASES])
def test_estimator_options(kwargs, message):
    loss = CountedLoss()
    _raises(lambda: kg.FisherEstimator(loss, **kwargs), message)
    assert loss.calls == 0


def test_estimator_takes_variables_and_callables_as_damping():
    loss = CountedLoss()
    variable = tf.Variable(0.1)
    assert kg.FisherEstimator(loss, damping=variable).damping is variable
    assert callable(kg.FisherEstimator(loss, damping=lambda: 0.1).damping)
    kg.FisherEstimator(loss, cov_ema_decay=tf.Variable(0.5))


DP_CASES = [
    (dict(learning_rate=0.0), "kg.DPSGD: learning_rate must be a finite number > 0, got 0.0"),
    (dict(learning_rate="abc"), "kg.DPSGD: learning_rate must be a finite number > 0, got 'abc'"),
    (dict(l2_norm_clip=0.0), "kg.DPSGD: l2_norm_clip must be a finite number > 0, got 0.0"),
    (dict(l2_norm_clip=True), "kg.DPSGD: l2_norm_clip must be a finite number > 0, got True"),
    (dict(noise_multiplier=-1.0),
     "kg.DPSGD: noise_multiplier must be a finite number >= 0, got -1.0"),
    (dict(method="fast"),
     "kg.DPSGD: method must be one of 'auto', 'reweight', 'materialize', got 'fast'"),
    (dict(seed=0.5), "kg.DPSGD: seed must be an integer, got 0.5"),
]


@pytest.mark.parametrize("kwargs,message", DP_CASES, ids=[str(c[0]) for c in DP_CASES])
def test_dpsgd_options(kwargs, message):
    loss = CountedLoss()
    good = dict(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0)
    _raises(lambda: kg.DPSGD(loss, **{**good, **kwargs}), message)
    assert loss.calls == 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(l2_norm_clip=-1.0), "kg.dp_gradients: l2_norm_clip must be a finite number > 0, "
     "got -1.0"),
    (dict(noise_multiplier=float("nan")),
     "kg.dp_gradients: noise_multiplier must be a finite number >= 0, got nan"),
    (dict(method="exact"),
     "kg.dp_gradients: method must be one of 'auto', 'reweight', 'materialize', got 'exact'"),
])
def test_dp_gradients_options(kwargs, message):
    loss = CountedLoss()
    x, y = tf.ones([2, 4]), tf.constant([0, 1])
    good = dict(l2_norm_clip=1.0, noise_multiplier=0.0)
    _raises(lambda: kg.dp_gradients(loss, x, y, **{**good, **kwargs}), message)
    assert loss.calls == 0


def test_dp_gradients_take_tensors_in_a_tf_function():
    loss = kg.auto_register(CountedLoss())
    x, y = tf.ones([2, 4]), tf.constant([0, 1])
    run = tf.function(lambda clip: kg.dp_gradients(loss, x, y, l2_norm_clip=clip,
                                                   noise_multiplier=tf.constant(0.0)),
                      autograph=False)
    assert run(tf.constant(1.0))[0].shape == (4, 3)


def _inner():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])


@pytest.mark.parametrize("kwargs,message", [
    (dict(damping=-1.0), "kg.KFACModel: damping must be a finite number >= 0, got -1.0"),
    (dict(learning_rate="abc"),
     "kg.KFACModel: learning_rate must be a finite number > 0, got 'abc'"),
    (dict(momentum_type="regular", momentum=1.5),
     "kg.KFACModel: momentum must be a finite number in [0, 1), got 1.5"),
    (dict(min_damping=1.0), "kg.KFACModel: min_damping must be at most damping (0.1), got 1.0"),
])
@pytest.mark.parametrize("loss", [None, "sparse_categorical_crossentropy"])
def test_kfac_model_options(kwargs, message, loss):
    inner = _inner()
    before = [w.numpy().copy() for w in inner.weights]
    _raises(lambda: kg.KFACModel(inner, loss=loss, **kwargs), message)
    for w, b in zip(inner.weights, before):
        np.testing.assert_array_equal(w.numpy(), b)


def test_kfac_model_unknown_option_is_one_line():
    with pytest.raises(TypeError) as info:
        kg.KFACModel(_inner(), loss="sparse_categorical_crossentropy", dampnig=1e-3)
    assert str(info.value).startswith("kg.KFACModel: unknown K-FAC option 'dampnig'; "
                                      "kg.KFAC takes learning_rate, damping, momentum, ")
    assert "\n" not in str(info.value)


def test_keras_optimizer_learning_rate():
    _raises(lambda: kg.KFACKerasOptimizer(learning_rate=-0.1),
            "kg.KFACKerasOptimizer: learning_rate must be a finite number > 0, got -0.1")
    _raises(lambda: kg.KFACKerasOptimizer(learning_rate="abc"),
            "kg.KFACKerasOptimizer: learning_rate must be a finite number > 0, got 'abc'")
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    kg.KFACKerasOptimizer(learning_rate=schedule)


def test_validators():
    assert options.Real(0.0, 1.0, high_open=True).requirement() == "a finite number in [0, 1)"
    assert options.Real(0.0, low_open=True, none=True).requirement() == (
        "a finite number > 0, or None")
    assert options.Real(high=2.5).requirement() == "a finite number <= 2.5"
    assert options.check(None, "--x", np.float32(0.5), options.Real(0.0)) == 0.5
    assert options.check("o", "n", tf.constant(2.0), options.Real(0.0)) == 2.0
    assert options.check("o", "n", np.int64(4), options.Integer(1)) == 4
    assert options.check("o", "n", 4.0, options.Integer(1)) == 4
    assert options.check("o", "n", "auto", options.OneOf((True, False, "auto"))) == "auto"
    assert options.check("o", "n", np.bool_(False), options.Boolean()) is False
    _raises(lambda: options.check(None, "--x", np.array([1.0, 2.0]), options.Real()),
            "--x must be a finite number, got [1. 2.]")
    _raises(lambda: options.check("o", "n", "x" * 100, options.OneOf(("a",))),
            "o: n must be one of 'a', got '" + "x" * 56 + "...")
    assert options.check_all("o", {"a": options.Integer(0)}, {"a": 1, "b": "as is"}) == {
        "a": 1, "b": "as is"}
