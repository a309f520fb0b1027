"""Full precision in float64: the exact Fisher's full blocks of convolutions
(Conv2D, Conv1D, DepthwiseConv2D) equal a brute-force Fisher from Jacobians
to rtol 1e-12, and kg.verify passes at rtol 1e-12, when the model computes
in float64 throughout.

Where a float64 model computes in float32 somewhere (a Keras layer without
``dtype=`` takes the float32 policy and casts its input down), every
cotangent through that op is rounded to float32; rounding is not linear, so
the block (columns of the Fisher square root pulled back) and any reference
(rows of the Jacobian, double-backward JVPs) differ by ~float32 epsilon.
``passes.precision`` marks such ops, and kg.verify then names the op and
takes float32's tolerances."""
import hypothesis
from hypothesis import strategies as st
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
import passes
from passes.precision import mark_narrowing
from fisher_reference import brute_fisher

F64 = "float64"
B = 3
SETTINGS = hypothesis.settings(max_examples=2, deadline=None, derandomize=True, database=None,
                               suppress_health_check=list(hypothesis.HealthCheck))


def _softmax_fisher(z):
    p = tf.nn.softmax(z)
    return tf.linalg.diag(p) - p[:, :, None] * p[:, None, :]


def _model(body, shape, flatten_dtype=F64):
    keras.utils.set_random_seed(0)
    flatten = keras.layers.Flatten(**({"dtype": flatten_dtype} if flatten_dtype else {}))
    model = keras.Sequential([keras.Input(shape, dtype=F64), *body, flatten,
                              keras.layers.Dense(3, dtype=F64)])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    x = tf.random.stateless_normal([B, *shape], [1, 2], dtype=tf.float64)
    return model, loss_fn, (x, tf.constant([0, 1, 2]))


def _assert_full_blocks_exact(model, loss_fn, args):
    reg = loss_fn.registration(*args)
    est = kg.FisherEstimator(loss_fn, estimation_mode="exact",
                             approximations={layer.name: "full" for layer in reg.layers})
    est.update(*args)
    for layer, block in zip(reg.layers, est.blocks):
        want = brute_fisher(lambda p, x: model(x), list(layer.variables), args[0],
                            _softmax_fisher)
        np.testing.assert_allclose(block.full_matrix().numpy(), want, rtol=1e-12,
                                   atol=1e-12 * np.abs(want).max(), err_msg=layer.name)
    report = kg.verify(loss_fn, *args, estimation_mode="exact", rtol=1e-12)
    assert report.passed and report.dtype == F64 and not report.notes, report.table()


@hypothesis.given(padding=st.sampled_from(["same", "valid"]), strides=st.sampled_from([1, 2]),
                  kernel=st.sampled_from([1, 2, 3]))
@SETTINGS
def test_float64_conv2d_and_depthwise_blocks_are_exact(padding, strides, kernel):
    body = [keras.layers.Conv2D(2, kernel, strides=strides, padding=padding, activation="tanh",
                                dtype=F64),
            keras.layers.DepthwiseConv2D(2, padding=padding, activation="tanh", dtype=F64)]
    model, loss_fn, args = _model(body, (5, 6, 2))
    assert [layer.kind for layer in loss_fn.registration(*args).layers] == [
        "conv2d", "depthwise_conv2d", "dense"]
    _assert_full_blocks_exact(model, loss_fn, args)


def test_float64_conv1d_block_is_exact():
    body = [keras.layers.Conv1D(3, 3, padding="causal", activation="tanh", dtype=F64)]
    model, loss_fn, args = _model(body, (7, 2))
    _assert_full_blocks_exact(model, loss_fn, args)


def test_a_float32_layer_in_a_float64_model_is_named_and_sets_the_tolerance():
    """The reported ~1e-8: a Flatten without dtype= rounds to float32."""
    body = [keras.layers.Conv2D(2, 2, activation="tanh", dtype=F64)]
    _, loss_fn, args = _model(body, (4, 5, 2), flatten_dtype=None)
    narrowing = loss_fn.registration(*args).ir.graph["narrowing"]
    assert [(wide, narrow) for _, wide, narrow in narrowing] == [(F64, "float32")]
    report = kg.verify(loss_fn, *args, estimation_mode="exact")
    assert report.passed and report.dtype == "float32" and report.rtol == 1e-3, report.table()
    assert any(f"float32 at {narrowing[0][0]}" in note for note in report.notes), report.notes
    # the rounding is real: the conv layer's block and the reference part at ~1e-8
    assert report.rows[0].check("fisher").error > 1e-10


def _narrowing(fn, *args):
    return mark_narrowing(passes.to_ir(passes.trace(fn, args))).graph["narrowing"]


def test_narrowing_pass_finds_only_casts_between_data_and_loss():
    w = tf.Variable(tf.ones([3, 2], tf.float64))
    x = tf.ones([4, 3], tf.float64)

    def round_trip(x):  # Cast -> Cast: canonicalize removes both; the pass sees them first
        h = tf.cast(tf.cast(tf.matmul(x, w), tf.float32), tf.float64)
        return tf.reduce_mean(tf.square(h))

    def counts_in_float32(x):  # int -> float32 -> float64, and a cast the loss never reads
        n = tf.cast(tf.cast(tf.shape(x)[0], tf.float32), tf.float64)
        tf.cast(w, tf.float16)
        return tf.reduce_sum(tf.square(tf.matmul(x, w))) / n

    assert [(wide, narrow) for _, wide, narrow in _narrowing(round_trip, x)] == [
        (F64, "float32")]
    assert _narrowing(counts_in_float32, x) == ()


@pytest.mark.parametrize("policy", ["float32", "float64"])
def test_one_dtype_models_have_no_narrowing(policy):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,), dtype=policy),
                              keras.layers.Dense(3, activation="tanh", dtype=policy),
                              keras.layers.Dense(2, dtype=policy)])
    x = tf.ones([2, 4], policy)
    assert _narrowing(lambda x: tf.reduce_sum(model(x)), x) == ()


def test_float32_model_fed_float64_data_is_not_noted():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                              keras.layers.Dense(2)])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))

    args = (tf.ones([2, 4], tf.float64), tf.constant([0, 1]))
    assert loss_fn.registration(*args).ir.graph["narrowing"]  # the input, cast to float32
    report = kg.verify(loss_fn, *args)
    assert report.passed and report.dtype == "float32" and not report.notes, report.table()


def test_a_mean_over_tokens_scales_per_example_gradients_in_full_precision():
    """A mean over 4 x 5 outputs per example gives each example's terms the
    coefficient 0.05. ``tf.cast(0.05, tf.float64)`` rounds it through
    float32 (1.5e-8 off), and every generic variable's per-example gradient
    (the Jacobian of the scaled terms) was off by that much
    (``layers.scalars.as_dtype``); now they equal one-example tapes to 1e-13."""
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(4, 2)))  # sin(w) @ x[b]: no layer pattern, generic

    @kg.auto_register
    def loss_fn(x):
        return tf.reduce_mean(tf.square(tf.matmul(tf.sin(w), x) - 1.0))

    x = tf.constant(rng.normal(size=(3, 2, 5)))
    assert loss_fn.registration(x).layers[0].kind == "generic"
    grads = kg.per_example_gradients(loss_fn, x)[0]
    for i in range(3):
        with tf.GradientTape() as tape:
            loss = loss_fn(x[i:i + 1])
        np.testing.assert_allclose(grads[i], tape.gradient(loss, w), rtol=1e-13, atol=0)
