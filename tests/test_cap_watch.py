"""The quadratic model's cap watch (``kfac_graph/optimizer/cap_watch.py``):
steps the cap shortened are counted, and a window mostly capped warns once."""
import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits

import kfac_graph as kg
from kfac_graph.optimizer import cap_watch, qmodel


def _run_watch(verdicts, window=4, share=0.75, losses=None):
    """Feeds ``verdicts`` (one per applied step) and the steps' ``losses``
    (falling by default) through a compiled count-then-check, as the step
    does; returns the watch and, per step, whether it had warned by then."""
    watch = cap_watch.CapWatch(window, share)
    steps = tf.Variable(tf.zeros([], tf.int64))
    losses = [2.0 ** -k for k in range(len(verdicts))] if losses is None else losses

    @tf.function
    def step(capped, loss):
        watch.count(capped, loss)
        steps.assign_add(1)
        watch.check(steps)

    warned = []
    for capped, loss in zip(verdicts, losses):
        step(tf.constant(capped), tf.constant(loss))
        warned.append(bool(watch.warned))
    return watch, warned


def test_a_window_mostly_capped_warns_once_at_its_end():
    # windows of 4: 2 capped (under 3/4), 3 capped (warns at step 8), 4 capped (already warned)
    verdicts = [True, False, True, False] + [True, True, False, True] + [True] * 4
    watch, warned = _run_watch(verdicts)
    assert warned == [False] * 7 + [True] * 5
    assert int(watch.capped_steps) == 9
    assert int(watch.capped_before_window) == 9


def test_capped_steps_spread_over_two_windows_do_not_warn():
    # 2 capped in each full window of 4 (under 3/4), 2 more in the third, still open
    verdicts = [False, True, False, True] + [True, False, True, False] + [True, True]
    watch, warned = _run_watch(verdicts)
    assert not any(warned)
    assert int(watch.capped_steps) == 6
    assert int(watch.capped_before_window) == 4  # the third window is still open


def test_a_window_whose_loss_did_not_fall_warns_once_at_its_end():
    """No step capped, but the second window's mean loss (1.0) is above 0.95
    of the first's (1.02): the steps made no progress since the start, the
    regime the cap misses at batch 8 on keras.applications' CNNs."""
    losses = [1.1, 1.0, 1.0, 0.98] + [1.0, 1.02, 0.97, 1.01] + [0.5] * 4
    watch, warned = _run_watch([False] * 12, losses=losses)
    assert warned == [False] * 7 + [True] * 5
    assert bool(watch.stalled) and int(watch.capped_steps) == 0
    assert float(watch.first_window_loss) == pytest.approx(1.02)


def test_a_loss_that_fell_below_the_bound_does_not_warn():
    # the second window at 0.9 of the first (under 0.95), the third far below
    losses = [1.0] * 4 + [0.9] * 4 + [0.3] * 4
    watch, warned = _run_watch([False] * 12, losses=losses)
    assert not any(warned) and not bool(watch.stalled)


def _digits_mlp(batch, steps, **options):
    data = load_digits()
    x, y = (data.data / 16).astype("float32"), data.target.astype("int32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="tanh"),
                              keras.layers.Dense(10)])

    @kg.auto_register
    def loss(xb, yb):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(yb, model(xb)))

    opt = kg.KFAC(loss, jit_compile=False, **options)
    rng = np.random.default_rng(0)
    first = None
    for _ in range(steps):
        index = rng.choice(len(x), batch, replace=False)
        value = float(opt.step(tf.constant(x[index]), tf.constant(y[index])))
        first = value if first is None else first
    return opt, first, float(loss(tf.constant(x), tf.constant(y)))


def test_a_model_that_steers_its_steps_is_not_warned():
    """The digits at batch 64: the quadratic model trains, and its cap shortens
    few steps (no window reaches 3/4)."""
    opt, first, last = _digits_mlp(64, 40)
    assert last < 0.5 * first
    assert int(opt.cap_watch.capped_steps) <= 10
    assert not bool(opt.cap_watch.warned)
    assert int(opt.iterations) == 40


def test_every_step_the_cap_shortens_is_counted_and_warned(monkeypatch):
    """The wiring through ``kg.KFAC``: with the cap made to shorten every
    update (to half) and ``qmodel_fallback=False``, all 25 steps count, the
    first window of 20 warns, and the quadratic model stays."""
    monkeypatch.setattr(qmodel, "cap", lambda quadratic, linear, objective:
                        0.5 * tf.ones_like(linear))
    opt, _, _ = _digits_mlp(64, 25, qmodel_fallback=False)
    assert int(opt.cap_watch.capped_steps) == 25
    assert bool(opt.cap_watch.warned)
    assert int(opt.cap_watch.capped_before_window) == 20
    assert opt.momentum_type == "qmodel"


def test_a_warned_quadratic_model_hands_over_to_regular_momentum(monkeypatch):
    """With the default ``qmodel_fallback``, the 20th call hands over: the next
    update is regular momentum's first, ``-lr clip(P g)`` from zero velocity
    with the initial learning rate (0.1) and norm constraint (1e-3), and the
    damping is held."""
    monkeypatch.setattr(qmodel, "cap", lambda quadratic, linear, objective:
                        0.5 * tf.ones_like(linear))
    # periods past the run: the preconditioner is the one read here
    opt, _, _ = _digits_mlp(64, 20, cov_update_period=1000, inverse_update_period=1000)
    assert opt.momentum_type == "regular" and int(opt.cap_watch.capped_steps) == 20
    assert not opt.adapt_damping
    assert float(opt.learning_rate) == pytest.approx(0.1)
    assert all(not np.any(v.numpy()) for v in opt.velocities)
    data = load_digits()
    x = tf.constant((data.data[:64] / 16).astype("float32"))
    y = tf.constant(data.target[:64].astype("int32"))
    variables = list(opt.registration.variables)
    before = [v.numpy().astype(np.float64) for v in variables]
    with tf.GradientTape() as tape:
        loss = opt.fn.python_function(x, y)
    grads = tape.gradient(loss, variables)
    p = opt.precondition(grads)
    pg = sum(float(tf.reduce_sum(a * b)) for a, b in zip(p, grads))
    coeff = min(1.0, np.sqrt(1e-3 / (0.1 ** 2 * pg)))
    opt.step(x, y)
    for v, old, pv in zip(variables, before, p):
        np.testing.assert_allclose(v.numpy() - old, -0.1 * coeff * pv.numpy(),
                                   rtol=1e-3, atol=1e-7)
    assert int(opt.cap_watch.capped_steps) == 20  # regular momentum has no cap


def test_steps_that_make_no_progress_hand_over(monkeypatch):
    """The wiring of the loss's watch through ``kg.KFAC``: with the quadratic
    model made to pick no step, the loss stays at its start, the second
    window stalls, and the 40th call hands over to regular momentum."""
    monkeypatch.setattr(qmodel, "solve", lambda m11, m12, m22, c1, c2: (
        tf.zeros_like(m11), tf.zeros_like(m11)))
    opt, first, last = _digits_mlp(64, 40)
    assert bool(opt.cap_watch.stalled) and int(opt.cap_watch.capped_steps) == 0
    assert opt.momentum_type == "regular"
    assert last == pytest.approx(first, rel=0.2)  # no step was taken


@pytest.mark.parametrize("run_eagerly", [pytest.param(False, marks=pytest.mark.slow), True])
def test_kfac_model_fit_hands_over_with_the_learning_rate_it_was_given(monkeypatch,
                                                                       run_eagerly):
    """``kg.KFACModel.fit`` (its step traced, or eager): the hand-over happens
    after the 20th batch, and the learning rate regular momentum then takes
    is the one given (0.05), not the quadratic model's last step size that
    the logs showed until then."""
    monkeypatch.setattr(qmodel, "cap", lambda quadratic, linear, objective:
                        0.5 * tf.ones_like(linear))
    data = load_digits()
    x, y = (data.data / 16).astype("float32"), data.target.astype("int32")
    keras.utils.set_random_seed(0)
    inner = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    model = kg.KFACModel(inner, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), learning_rate=0.05, jit_compile=False)
    model.compile(run_eagerly=run_eagerly)
    model.fit(x[:64 * 25], y[:64 * 25], batch_size=64, epochs=1, shuffle=False, verbose=0)
    kfac = model.kfac
    assert kfac.momentum_type == "regular"
    assert int(kfac.cap_watch.capped_steps) == 20 and int(kfac.iterations) == 25
    assert float(kfac.learning_rate) == pytest.approx(0.05)
    assert float(model.optimizer.learning_rate) == pytest.approx(0.05)


def test_other_momentum_types_have_no_cap_to_count():
    opt, _, _ = _digits_mlp(64, 5, momentum_type="regular")
    assert int(opt.cap_watch.capped_steps) == 0 and not bool(opt.cap_watch.warned)


@pytest.mark.slow
def test_mobilenet_at_batch_8_stalls_and_hands_over_to_regular_momentum():
    """``keras.applications.MobileNetV3Small`` at batch 8, four batches in
    turn: the quadratic model's steps each fit their own batch without
    reaching the cap, and the loss over the 32 examples rose (1.609 to 1.820
    in 30 steps); the second window stalls, the 40th step hands over, and
    regular momentum brings the loss below its start (1.56 after 80)."""
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    x = rng.randn(32, 32, 32, 3).astype("float32")
    pooled = x.reshape(32, 4, 8, 4, 8, 3).mean((2, 4)).reshape(32, -1)
    y = (pooled @ rng.randn(pooled.shape[1], 5).astype("float32")).argmax(1).astype("int32")
    batches = [(tf.constant(x[i:i + 8]), tf.constant(y[i:i + 8])) for i in range(0, 32, 8)]
    model = keras.applications.MobileNetV3Small(
        weights=None, input_shape=(32, 32, 3), classes=5, classifier_activation=None,
        include_preprocessing=False)

    @kg.auto_register
    def loss(xb, yb):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            yb, model(xb, training=False)))

    def pooled_loss():
        return np.mean([float(loss(*b)) for b in batches])

    start, opt = pooled_loss(), kg.KFAC(loss)
    for k in range(80):
        opt.step(*batches[k % 4])
        if k == 38:
            assert opt.momentum_type == "qmodel"
    assert bool(opt.cap_watch.stalled) and opt.momentum_type == "regular"
    assert pooled_loss() < start - 0.03


@pytest.mark.slow
def test_resnet50_at_batch_32_is_capped_and_handed_over_to_regular_momentum():
    """``keras.applications.ResNet50`` on the digits (32x32) at batch 32, the
    defaults: the regime the watch is for (README, "Cold start and scale");
    the 20th call hands over, and regular momentum's steps follow."""
    data = load_digits()
    images = np.repeat(np.kron((data.data / 16).astype("float32").reshape(-1, 8, 8),
                               np.ones((4, 4), "float32"))[..., None], 3, axis=-1)
    labels = data.target.astype("int32")
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(input_shape=(32, 32, 3), weights=None, classes=10,
                                        classifier_activation=None)

    @kg.auto_register
    def loss(xb, yb):
        logits = model(xb, training=True)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(yb, logits))

    opt = kg.KFAC(loss, cov_update_period=5, inverse_update_period=20)
    rng = np.random.default_rng(0)
    for _ in range(25):
        index = rng.choice(len(labels), 32, replace=False)
        opt.step(tf.constant(images[index]), tf.constant(labels[index]))
    assert int(opt.cap_watch.capped_steps) >= 15
    assert bool(opt.cap_watch.warned)
    assert opt.momentum_type == "regular"
    assert int(opt.iterations) == 25 and int(opt.skipped_steps) == 0
