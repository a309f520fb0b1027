"""Scales read through a function of the variable: `x * exp(v)`, `x * -exp(v)`
and `x * -v` (Keras's PReLU).

Qwen3.5's gated delta net decays by `-exp(A_log) * softplus(a + dt_bias)`;
a learned temperature multiplies by `exp(t)`. The derivative by `v` is `x`
times the factor itself, so the variable is a scale-and-shift layer whose
`xhat` is `x * s` (`passes/patterns_scale_shift.py`, normalizer "exp").
Before, `v` was generic ("no layer pattern matches its use by Exp").
Float64, against a loop of one-example gradients and the brute-force
Fisher; `kg.KFAC` with its defaults trains it. PReLU computes `relu(x) -
alpha * relu(-x)`: `alpha` is a scale of `relu(-x)` through a negation, `xhat =
-relu(-x)` (it was generic, "no layer pattern matches its use by Neg").
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from fisher_checks import block_matrix
from fisher_reference import brute_fisher, softmax_fisher
from per_example_reference import assert_matches_loop

B, D, H, C = 5, 4, 3, 2


def _model(form):
    rng = np.random.default_rng(0)
    a_log = tf.Variable(rng.normal(size=(H,)) * 0.3, name="A_log")
    w = tf.Variable(rng.normal(size=(D, H)), name="w")
    head = tf.Variable(rng.normal(size=(H, C)), name="head")

    def logits(params, x):
        a_log, w = params
        h = x @ w
        gate = (-tf.exp(a_log) * tf.nn.softplus(h) if form == "negated"
                else tf.math.log1p(tf.square(h)) * tf.exp(a_log))
        return tf.tanh(gate) @ head

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, logits([a_log, w], x)))

    args = (tf.constant(rng.normal(size=(B, D))), tf.constant([0, 1, 1, 0, 1]))
    return loss_fn, logits, [a_log, w], args


@pytest.mark.parametrize("form", ["plain", "negated"])
def test_exp_scale_matches_loop_and_brute_force(form):
    loss_fn, logits, params, args = _model(form)
    reg = assert_matches_loop(loss_fn, args)
    (layer,) = [layer for layer in reg.layers if layer.variables[0] is params[0]]
    assert layer.kind == "scale_and_shift" and layer.use_attrs[0]["normalizer"] == "exp"
    want = brute_fisher(lambda p, x: logits([p[0], params[1]], x), [params[0]], args[0],
                        softmax_fisher)
    np.testing.assert_allclose(block_matrix(loss_fn, args, layer, "scale_and_shift", "full"),
                               want, rtol=1e-8, atol=1e-12)


def test_kfac_trains_an_exp_scale():
    loss_fn, _, _, args = _model("negated")
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(8)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses


@pytest.mark.parametrize("shared_axes", [None, [1, 2]])
def test_prelu_alpha_is_a_scale(shared_axes):
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((5, 5, 2)), keras.layers.Conv2D(3, 3),
        keras.layers.PReLU(alpha_initializer=keras.initializers.Constant(0.3),
                           shared_axes=shared_axes),
        keras.layers.Flatten(), keras.layers.Dense(2)])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    rng = np.random.default_rng(0)
    args = (tf.constant(rng.normal(size=(4, 5, 5, 2))), tf.constant([0, 1, 1, 0]))
    reg = assert_matches_loop(loss_fn, args)
    assert [layer.kind for layer in reg.layers] == ["conv2d", "scale_and_shift", "dense"]
    assert reg.layers[1].use_attrs[0]["normalizer"] == "negated"


def test_a_vector_scaled_by_a_mask_of_ids():
    """T5Gemma2's end-of-image embedding, ``m * v + (1 - m) * embed(ids)``
    with ``m = cast(ids == k)``: the vector is a scale of the mask, which
    the pass reads through the cast as the comparison's bools, and the rule
    stopped on ``reduce_sum`` of a bool tensor (per-example gradients,
    ``kg.verify`` and DP-SGD; K-FAC's statistics cast). Now the mask is
    cast to the gradient's dtype first."""
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    embed, head = keras.layers.Embedding(9, 4), keras.layers.Dense(3)
    special = tf.Variable(np.random.default_rng(1).normal(size=(4,)), name="special")

    @kg.auto_register
    def loss_fn(ids, y):
        mask = tf.cast(tf.equal(ids, 8)[..., None], tf.float64)
        h = mask * special + (1.0 - mask) * embed(ids)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, head(tf.reduce_mean(h, axis=1))))

    args = (tf.constant([[1, 8, 3, 4], [8, 2, 2, 8], [5, 6, 7, 1]]), tf.constant([0, 1, 2]))
    reg = assert_matches_loop(loss_fn, args)
    assert [layer.kind for layer in reg.layers] == ["scale_and_shift", "embedding", "dense"]
    assert kg.verify(loss_fn, *args, estimation_mode="exact", examples=2, directions=1).passed
    assert np.isfinite(float(kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0,
                                      noise_multiplier=1.0).step(*args)))
