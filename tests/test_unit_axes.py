"""Unit axes the IR sees through (``passes.canonicalize`` drops reshapes,
``x[:, None]`` and ``expand_dims`` that only add or drop size-1 axes, and
rewires their readers): an op's constant axes, permutations and slice
bounds index its input as the op reads it, not the rank-reduced tensor the
IR rewired it to. Each form against the same model written without the
unit axis, and a loop of one-example tapes (float64)."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from passes.errors import KfacGraphError
from per_example_reference import one_example_loop

L = keras.layers
B, T, D, C = 4, 3, 2, 3


@pytest.fixture
def float64():
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)


def _data(seed=0, positions=False):
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=(B, T, D) if positions else (B, D)))
    return x, tf.constant(rng.integers(0, C, B))


def _signature(x, y):
    return [tf.TensorSpec([None, *x.shape[1:]], x.dtype), tf.TensorSpec([None], y.dtype)]


def _matches_loop(fn, loss, args, rtol=1e-9):
    reg = fn.registration(*args)
    got = kg.per_example_gradients(fn, *args)
    for v, g, w in zip(reg.variables, got, one_example_loop(loss, args, reg.variables)):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-12, err_msg=v.name)
    return reg


def _kfac_losses(fn, args, variables, start, steps=3):
    for v, s in zip(variables, start):
        v.assign(s)
    opt = kg.KFAC(fn, estimation_mode="exact", momentum_type="regular",
                  learning_rate=0.5, damping=1e-3)
    losses = [float(opt.step(*args)) for _ in range(steps)]
    assert int(opt.skipped_steps) == 0
    return losses


def test_a_sum_over_positions_behind_a_unit_axis_is_no_per_position_head(float64):
    """``log cosh(sum(reshape(z, [B, 1, T, C]), axis=2, keepdims=True) - y)``:
    the Sum's axis 2 was read on the ``[B, T, C]`` tensor the IR rewired it
    to, as its last axis, the classes', so the head looked per position of
    ``z`` and the Gauss-Newton output was ``z``, its Hessian formed per
    position (T times the diagonal blocks, the blocks across positions
    dropped): K-FAC took another trajectory than the same loss written
    without the unit axis (loss 0.56 against 0.48 after four steps)."""
    x, _ = _data(positions=True)
    y = tf.constant(np.random.default_rng(1).normal(size=(B, 1, 1, C)))
    hidden, out = L.Dense(C, activation="tanh"), L.Dense(C)

    def make(unit):
        def loss(x, y):
            z = out(hidden(x))
            p = (tf.reduce_sum(tf.reshape(z, [-1, 1, T, C]), axis=2, keepdims=True) if unit
                 else tf.reduce_sum(z, axis=1, keepdims=True)[:, None])
            return tf.reduce_mean(tf.math.log(tf.cosh(p - y)))
        return loss

    plain, unit = (kg.auto_register(make(u)) for u in (False, True))
    want, got = plain.registration(x, y), unit.registration(x, y)
    assert got.loss.kind == "ggn" and got.loss.output == want.loss.output
    start = [v.numpy() for v in want.variables]
    np.testing.assert_allclose(_kfac_losses(unit, (x, y), want.variables, start),
                               _kfac_losses(plain, (x, y), want.variables, start), rtol=1e-10)


def test_a_log_sum_exp_over_a_unit_axis_under_an_unknown_batch(float64):
    """``logsumexp(z[:, None], axis=2) - picked``: the reduction's rows were
    dropped wherever its input was seen through a unit axis, so with the
    batch known at run time only no tensor held the examples and the loss
    was refused ("cannot read a loss through op 'sub'"); traced with the
    batch static it registered through a joined output."""
    x, y = _data()
    hidden, out = L.Dense(4, activation="tanh"), L.Dense(C)

    def loss(x, y):
        z = tf.expand_dims(out(hidden(x)), 1)
        picked = tf.reduce_sum(z * tf.one_hot(y, C, dtype=z.dtype)[:, None], axis=2)
        return tf.reduce_mean(tf.reduce_logsumexp(z, axis=2) - picked)

    for traced in (loss, tf.function(loss, input_signature=_signature(x, y))):
        fn = kg.auto_register(traced)
        reg = _matches_loop(fn, loss, (x, y))
        assert reg.loss.kind == "ggn" and "joined" not in reg.loss.output  # (per position)
        assert [layer.kind for layer in reg.layers] == ["dense", "dense"]


@pytest.mark.parametrize("form", ["gather_negative_axis", "roll_unit", "reverse_unit"])
def test_the_batch_reordered_along_a_negative_axis_couples_the_examples(float64, form):
    """``gather(h, perm, axis=-2)`` on ``[B, d]`` and ``roll`` or ``reverse``
    of ``h[:, None]`` along axis -3: the batch's axis, named from the end
    (the gather's was compared to the rows' axis unreduced, the roll's taken
    modulo the rank of the ``[B, d]`` tensor the IR rewired it to). The
    coupling went unseen and DP-SGD clipped a mixed-up batch's gradients
    (no privacy); as ``axis=0`` it is refused."""
    x, y = _data()
    hidden, out = L.Dense(4, activation="tanh"), L.Dense(C)

    def loss(x, y):
        h = hidden(x)
        if form == "gather_negative_axis":
            h = h + 0.5 * tf.gather(h, tf.constant([1, 2, 3, 0]), axis=-2)
        else:
            u = h[:, None, :]
            moved = tf.roll(u, 1, axis=-3) if form == "roll_unit" else tf.reverse(u, [-3])
            h = (u + 0.5 * moved)[:, 0]
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, out(h)))

    fn = kg.auto_register(loss)
    assert fn.registration(x, y).coupling
    with pytest.raises(KfacGraphError, match="couples the examples"):
        kg.dp_gradients(fn, x, y, l2_norm_clip=1.0, noise_multiplier=0.0)


def test_a_dense_layer_on_positions_behind_a_unit_axis_keeps_its_bias(float64):
    """Keras's Dense on ``[B, 1, T, d]`` (a Tensordot: reshape to ``[B T,
    d]``, matmul, reshape back): the Tensordot check compared its output's
    rank with the ``[B, T, d]`` input the IR rewired it to, so with the
    batch static the matmul registered alone and its bias as a separate
    scale-and-shift layer (another K-FAC block than the same model without
    the unit axis)."""
    x, y = _data(positions=True)
    hidden, out = L.Dense(4, activation="tanh"), L.Dense(C)

    def make(unit):
        def loss(x, y):
            h = tf.reshape(x, [-1, 1, T, D]) if unit else x
            z = tf.reshape(out(hidden(h)), [-1, T, C])
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                tf.stack([y, (y + 1) % C, y], 1), z))
        return loss

    plain = kg.auto_register(make(False))
    want = plain.registration(x, y)
    start = [v.numpy() for v in want.variables]
    losses = _kfac_losses(plain, (x, y), want.variables, start)
    signature = [tf.TensorSpec([None, T, D], tf.float64), tf.TensorSpec([None], y.dtype)]
    for traced in (make(True), tf.function(make(True), input_signature=signature)):
        fn = kg.auto_register(traced)
        reg = _matches_loop(fn, make(True), (x, y))
        assert [(layer.kind, len(layer.variables)) for layer in reg.layers] == [
            (layer.kind, len(layer.variables)) for layer in want.layers]
        np.testing.assert_allclose(_kfac_losses(fn, (x, y), want.variables, start), losses,
                                   rtol=1e-10)


@pytest.mark.parametrize("layout", ["flattened_rows",
                                    pytest.param("time_major", marks=pytest.mark.slow)])
def test_a_dense_layer_on_rows_behind_a_unit_axis(float64, layout):
    """A Dense on ``reshape(h, [-1, d])[:, None]`` (``[B T, 1, d]`` rows) or
    on a time-major ``[T, 1, B, d]``: the layer's input is the tensor as it
    reads it, one canonicalize removed, whose rows were looked up by its
    own name (none: a crash, KeyError, on the rows; the time-major one's
    variables generic), and on the axis of the tensor the IR rewired it to
    (the examples' axis 1 of ``[T, B, d]`` is axis 2 of what the layer
    reads)."""
    x, y = _data(positions=True)
    y = tf.stack([y, (y + 1) % C, y], 1)
    hidden, out = L.Dense(4, activation="tanh"), L.Dense(C)

    def make(unit):
        def loss(x, y):
            h = hidden(x)
            if layout == "flattened_rows":
                h = tf.reshape(h, [-1, 4])
                z = tf.reshape(out(h[:, None, :] if unit else h), [-1, T, C])
            else:
                h = tf.transpose(h, [1, 0, 2])
                h = tf.reshape(h, [T, 1, -1, 4]) if unit else h
                z = tf.transpose(tf.reshape(out(h), [T, -1, C]), [1, 0, 2])
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, z))
        return loss

    plain = kg.auto_register(make(False))
    want = plain.registration(x, y)
    start = [v.numpy() for v in want.variables]
    losses = _kfac_losses(plain, (x, y), want.variables, start)
    signature = [tf.TensorSpec([None, T, D], tf.float64), tf.TensorSpec([None, T], y.dtype)]
    for traced in (make(True), tf.function(make(True), input_signature=signature)):
        fn = kg.auto_register(traced)
        reg = _matches_loop(fn, make(True), (x, y))
        assert [(layer.kind, len(layer.variables)) for layer in reg.layers] == [
            ("dense", 2), ("dense", 2)]
        np.testing.assert_allclose(_kfac_losses(fn, (x, y), want.variables, start), losses,
                                   rtol=1e-10)


@pytest.mark.parametrize("signature", ["static", "dynamic"])
def test_a_sum_divided_by_the_batch_named_from_the_end(float64, signature):
    """``sum(ce) / shape(ce)[-1]`` on the ``[B]`` terms is a mean over the
    batch: the slice's bound -1 was read as axis -1, not the first, so the
    size was taken for one that does not count the batch and the loss for a
    sum, every per-example gradient of the generic variable B times too
    small (DP-SGD clipped a B-th of each)."""
    x, y = _data()
    hidden, out = L.Dense(4, activation="tanh"), L.Dense(C)
    t = tf.Variable(np.linspace(0.5, 1.5, C), name="t")  # sin(t): a generic variable

    def loss(x, y):
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(y, out(hidden(x)) * tf.sin(t))
        return tf.reduce_sum(ce) / tf.cast(tf.shape(ce)[-1], ce.dtype)

    traced = loss if signature == "static" else tf.function(
        loss, input_signature=_signature(x, y))
    reg = _matches_loop(kg.auto_register(traced), loss, (x, y))
    assert reg.loss.reduction == "mean" and "generic" in [layer.kind for layer in reg.layers]


PER_TOKEN_FORMS = {  # ce [B, T] -> the loss
    # ce[:, None] with B and T unknown: the slice was not seen through (two unknown
    # sizes), and the loss pass refused it ("cannot read a loss through op 'strided_slice'")
    "mean_of_a_new_axis": lambda c: tf.reduce_mean(tf.reduce_mean(c[:, None, :], axis=-1)),
    "sum_over_positions": lambda c: tf.reduce_mean(tf.reduce_sum(c[:, None, :], axis=2)),
    # prod(shape(c)[1:]) is T, no batch: a product of a sliced shape was not followed
    # and read as counting the batch, every per-example gradient B times too large
    "sum_over_prod_of_shape": lambda c: tf.reduce_sum(c) / tf.cast(
        tf.reduce_prod(tf.shape(c)[1:]), c.dtype),
}


@pytest.mark.parametrize("form", sorted(PER_TOKEN_FORMS))
def test_per_token_forms_with_the_batch_and_positions_unknown(float64, form):
    """Traced with ``input_signature=[None, None]``: per-example gradients
    (a generic variable's too) equal a loop of one-example tapes."""
    x, y = _data(positions=True)
    y = tf.stack([y, (y + 1) % C, y], 1)
    hidden, out = L.Dense(4, activation="tanh"), L.Dense(C)
    t = tf.Variable(np.linspace(0.5, 1.5, C), name="t")

    def loss(x, y):
        z = out(hidden(x)) * tf.sin(t)
        return PER_TOKEN_FORMS[form](tf.nn.sparse_softmax_cross_entropy_with_logits(y, z))

    spec = [tf.TensorSpec([None, None, D], tf.float64), tf.TensorSpec([None, None], y.dtype)]
    reg = _matches_loop(kg.auto_register(tf.function(loss, input_signature=spec)), loss, (x, y))
    assert "generic" in [layer.kind for layer in reg.layers]



@pytest.mark.parametrize("form", ["leading", "trailing",
                                  pytest.param("terms_expanded", marks=pytest.mark.slow)])
def test_class_weights_on_terms_with_a_unit_axis_are_no_token_weights(float64, form):
    """``-sum(w * y[:, None] * log_softmax(z)[:, None])`` with per-class
    weights ``w`` (``[C]``, or ``[C, 1]`` against ``[B, C, 1]`` terms; or the
    terms ``y * log_softmax(z)`` expanded before ``w`` weighs them): no
    log-likelihood, as without the unit axis (kind "ggn"). The check
    compared the ``[B, 1, C]`` terms' rank with ``z``'s and the weights'
    shape as the IR rewired them (``[C]``, not ``[C, 1]``), so it passed
    them as token weights of a categorical loss, and K-FAC's first step
    crashed (ValueError: cannot reshape 12 elements to [4])."""
    x, y = _data()
    hidden, out = L.Dense(4, activation="tanh"), L.Dense(C)
    w = tf.constant([1.0, 2.0, 3.0], tf.float64)

    def make(unit):
        def loss(x, y):
            z = out(hidden(x))
            y, log_p = tf.one_hot(y, C, dtype=z.dtype), tf.nn.log_softmax(z)
            if not unit:
                return -tf.reduce_mean(tf.reduce_sum(w * (y * log_p), -1))
            if form == "leading":
                terms = y[:, None, :] * log_p[:, None, :]
                return -tf.reduce_mean(tf.reduce_sum(w * terms, [1, 2]))
            if form == "trailing":
                terms = y[:, :, None] * log_p[:, :, None]
                return -tf.reduce_mean(tf.reduce_sum(w[:, None] * terms, [1, 2]))
            return -tf.reduce_mean(tf.reduce_sum(w * (y * log_p)[:, None, :], [1, 2]))
        return loss

    plain = kg.auto_register(make(False))
    want = plain.registration(x, y)
    start = [v.numpy() for v in want.variables]
    losses = _kfac_losses(plain, (x, y), want.variables, start)
    fn = kg.auto_register(make(True))
    reg = _matches_loop(fn, make(True), (x, y))
    assert want.loss.kind == reg.loss.kind == "ggn"
    np.testing.assert_allclose(_kfac_losses(fn, (x, y), want.variables, start), losses,
                               rtol=1e-10)
