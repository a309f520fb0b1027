"""Per-token (sequence) losses read from the graph, on a token model
(Embedding -> Dense -> Dense) and an LSTM language model (the slower LSTM
cases under -m slow): targets [B, T], logits [B, T, V], each form a user
writes (tf.nn, Keras losses and ops, flattened
to [B*T, V], one-hot, Bernoulli, squared error), each reduction (mean over
tokens, sum, mean over tokens then batch, a padding-masked mean, Keras
sample_weight and ignore_class).

The references are written by hand here: example i's own loss, with any
batch statistic the loss divides by (sum(w), Keras's count of valid tokens)
taken from the whole batch, differentiated one example at a time; float64.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from passes import ir
from per_example_reference import one_example_loop

B, T, V, D = 3, 4, 5, 6
RTOL = 1e-6


def _float64():
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")


def _token_model(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.layers.Embedding(V, D, name="tokens"),
                              keras.layers.Dense(D, activation="tanh", name="hidden"),
                              keras.layers.Dense(V, name="logits")])
    model.build((None, T))
    return model


def _lstm_lm(seed=0):
    """An LSTM language model (unroll=False: the pass unrolls the loop)."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.layers.Embedding(V, D, name="tokens"),
                              keras.layers.LSTM(3, return_sequences=True, name="lstm"),
                              keras.layers.Dense(V, name="logits")])
    model.build((None, T))
    return model


MODELS = {"token": (_token_model, ["embedding", "dense", "dense"]),
          "lstm": (_lstm_lm, ["embedding", "dense", "dense"])}
LSTM_FAST = ("masked_mean_flattened", "keras_sample_weight", "keras_ignore_class", "bernoulli")


def _data(seed=0):
    rng = np.random.default_rng(seed)
    ids = tf.constant(rng.integers(0, V, (B, T)), tf.int32)
    y = tf.constant(rng.integers(0, V, (B, T)), tf.int32)
    y = tf.tensor_scatter_nd_update(y, [[0, 0], [1, 1]], [0, 0])  # ignore_class 0 occurs
    y = tf.tensor_scatter_nd_update(y, [[0, 1], [2, 2]], [1, 2])  # and so do others
    w = tf.constant([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 1]], tf.float64)
    return ids, y, w


def _ce(y, logits):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)


def _one_hot(y):
    return tf.one_hot(y, V, dtype=tf.float64)


# name: (loss(logits, y, w), (kind, reduction, scale, weighted),
#        example_loss(logits_i, y_i, w_i, y, w) with the batch's statistics)
FORMS = {
    "mean": (lambda z, y, w: tf.reduce_mean(_ce(y, z)),
             ("categorical", "mean", 1 / T, False),
             lambda z, y, w, Y, W: tf.reduce_mean(_ce(y, z))),
    "sum": (lambda z, y, w: tf.reduce_sum(_ce(y, z)),
            ("categorical", "sum", 1.0, False),
            lambda z, y, w, Y, W: tf.reduce_sum(_ce(y, z))),
    "mean_tokens_then_batch": (lambda z, y, w: tf.reduce_mean(tf.reduce_mean(_ce(y, z), axis=1)),
                               ("categorical", "mean", 1 / T, False),
                               lambda z, y, w, Y, W: tf.reduce_mean(_ce(y, z))),
    "flattened": (lambda z, y, w: tf.reduce_mean(_ce(tf.reshape(y, [-1]), tf.reshape(z, [-1, V]))),
                  ("categorical", "mean", 1 / T, False),
                  lambda z, y, w, Y, W: tf.reduce_mean(_ce(y, z))),
    "masked_mean": (lambda z, y, w: tf.reduce_sum(_ce(y, z) * w) / tf.reduce_sum(w),
                    ("categorical", "sum", 1.0, True),
                    lambda z, y, w, Y, W: tf.reduce_sum(_ce(y, z) * w) / tf.reduce_sum(W)),
    "masked_mean_flattened": (
        lambda z, y, w: tf.reduce_sum(_ce(tf.reshape(y, [-1]), tf.reshape(z, [-1, V]))
                                      * tf.reshape(w, [-1])) / tf.reduce_sum(w),
        ("categorical", "sum", 1.0, True),
        lambda z, y, w, Y, W: tf.reduce_sum(_ce(y, z) * w) / tf.reduce_sum(W)),
    # a divisor per position, a statistic of the whole batch: not a scalar
    "per_position_mean": (
        lambda z, y, w: tf.reduce_sum(_ce(y, z) * w / tf.reduce_sum(w, axis=0)),
        ("categorical", "sum", 1.0, True),
        lambda z, y, w, Y, W: tf.reduce_sum(_ce(y, z) * w / tf.reduce_sum(W, axis=0))),
    "keras": (lambda z, y, w: keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, z),
              ("categorical", "mean", 1 / T, False),
              lambda z, y, w, Y, W: tf.reduce_mean(_ce(y, z))),
    "keras_sample_weight": (
        lambda z, y, w: keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
            y, z, sample_weight=w),
        ("categorical", "mean", 1 / T, True),
        lambda z, y, w, Y, W: tf.reduce_sum(_ce(y, z) * w) / T),
    "keras_ignore_class": (
        lambda z, y, w: keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=0)(y, z),
        ("categorical", "mean", 1 / T, True),
        lambda z, y, w, Y, W: B * tf.reduce_sum(
            tf.where(tf.equal(y, 0), tf.zeros_like(_ce(y, z)), _ce(y, z)))
        / tf.reduce_sum(tf.cast(tf.not_equal(Y, 0), tf.float64))),
    "keras_ops": (lambda z, y, w: keras.ops.mean(
        keras.ops.sparse_categorical_crossentropy(y, z, from_logits=True)),
        ("categorical", "mean", 1 / T, False),
        lambda z, y, w, Y, W: tf.reduce_mean(_ce(y, z))),
    "one_hot": (lambda z, y, w: tf.reduce_mean(
        tf.nn.softmax_cross_entropy_with_logits(_one_hot(y), z)),
        ("categorical", "mean", 1 / T, False),
        lambda z, y, w, Y, W: tf.reduce_mean(_ce(y, z))),
    "keras_one_hot": (lambda z, y, w: keras.losses.CategoricalCrossentropy(from_logits=True)(
        _one_hot(y), z),
        ("categorical", "mean", 1 / T, False),
        lambda z, y, w, Y, W: tf.reduce_mean(_ce(y, z))),
    "keras_binary_sample_weight": (
        lambda z, y, w: keras.losses.BinaryCrossentropy(from_logits=True)(
            _one_hot(y), z, sample_weight=w),
        ("bernoulli", "mean", 1 / (T * V), True),
        lambda z, y, w, Y, W: tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(
            _one_hot(y), z) * w[..., None]) / (T * V)),
    "keras_squared_error_sample_weight": (
        lambda z, y, w: keras.losses.MeanSquaredError()(_one_hot(y), z, sample_weight=w),
        ("normal", "mean", 1 / (T * V), True),
        lambda z, y, w, Y, W: tf.reduce_sum(tf.square(z - _one_hot(y)) * w[..., None])
        / (T * V)),
    "bernoulli": (lambda z, y, w: tf.reduce_mean(
        tf.nn.sigmoid_cross_entropy_with_logits(_one_hot(y), z)),
        ("bernoulli", "mean", 1 / (T * V), False),
        lambda z, y, w, Y, W: tf.reduce_mean(
            tf.nn.sigmoid_cross_entropy_with_logits(_one_hot(y), z))),
    "bernoulli_masked": (lambda z, y, w: tf.reduce_sum(tf.reduce_sum(
        tf.nn.sigmoid_cross_entropy_with_logits(_one_hot(y), z), -1) * w) / tf.reduce_sum(w),
        ("bernoulli", "sum", 1.0, True),
        lambda z, y, w, Y, W: tf.reduce_sum(tf.reduce_sum(
            tf.nn.sigmoid_cross_entropy_with_logits(_one_hot(y), z), -1) * w)
        / tf.reduce_sum(W)),
    "squared_error": (lambda z, y, w: tf.reduce_mean(tf.square(z - _one_hot(y))),
                      ("normal", "mean", 1 / (T * V), False),
                      lambda z, y, w, Y, W: tf.reduce_mean(tf.square(z - _one_hot(y)))),
    "squared_error_masked": (
        lambda z, y, w: tf.reduce_sum(tf.square(z - _one_hot(y)) * w[..., None])
        / tf.reduce_sum(w),
        ("normal", "sum", 1.0, True),
        lambda z, y, w, Y, W: tf.reduce_sum(tf.square(z - _one_hot(y)) * w[..., None])
        / tf.reduce_sum(W)),
}


def _registered(model, form):
    loss, _, _ = FORMS[form]

    def loss_fn(ids, y, w):
        return loss(model(ids), y, w)

    return kg.auto_register(loss_fn)


def loop_gradients(model, form, args):
    """Per variable [B, *shape]: the gradient of example i's own loss (the
    batch's statistics held), one GradientTape per example."""
    _, _, example_loss = FORMS[form]
    ids, y, w = args
    variables = model.trainable_variables
    out = []
    for i in range(B):
        with tf.GradientTape() as tape:
            loss = example_loss(model(ids[i:i + 1]), y[i:i + 1], w[i:i + 1], y, w)
        out.append([tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)])
    return [np.stack([o[k].numpy() for o in out]) for k in range(len(variables))]


@pytest.mark.parametrize("model_kind, form", [("token", f) for f in sorted(FORMS)] + [
    pytest.param("lstm", f, marks=() if f in LSTM_FAST else pytest.mark.slow)
    for f in sorted(FORMS)])
def test_per_token_form_registers_and_equals_the_loop(model_kind, form):
    _float64()
    make, kinds = MODELS[model_kind]
    model = make()
    args = _data()
    fn = _registered(model, form)
    reg = fn.registration(*args)
    kind, reduction, scale, weighted = FORMS[form][1]
    assert [layer.kind for layer in reg.layers] == kinds, reg.summary()
    assert (reg.loss.kind, reg.loss.reduction, reg.loss.weighted) == (kind, reduction, weighted)
    assert reg.loss.scale == pytest.approx(scale)
    # the logits [B, T, V], seen through any reshape to [B*T, V] or mask
    assert reg.loss.output == reg.layers[-1].outputs[0]
    assert tuple(ir.shape_of(reg.ir, reg.loss.output)) == (B, T, V)
    if form == "masked_mean":
        assert reg.loss.weights == ("w:0",) and len(reg.loss.divisors) == 1
    if form == "keras_sample_weight":
        assert reg.loss.weights == ("w:0",) and reg.loss.divisors == ()

    got = kg.per_example_gradients(fn, *args)
    want = loop_gradients(model, form, args)
    assert [tuple(g.shape) for g in got] == [(B, *v.shape) for v in model.trainable_variables]
    for g, r in zip(got, want):
        np.testing.assert_allclose(g.numpy(), r, rtol=RTOL, atol=1e-12)
    norms = kg.per_example_gradient_norms(fn, *args).numpy()
    flat = np.concatenate([np.reshape(r, (B, -1)) for r in want], axis=1)
    np.testing.assert_allclose(norms, np.linalg.norm(flat, axis=1), rtol=RTOL)
    # the per-example gradients add up to the batch gradient exactly
    with tf.GradientTape() as tape:
        loss = fn(*args)
    batch = tape.gradient(loss, model.trainable_variables)
    for g, b in zip(got, batch):
        total = tf.reduce_sum(g, 0) if reduction == "sum" else tf.reduce_mean(g, 0)
        np.testing.assert_allclose(total.numpy(), tf.convert_to_tensor(b).numpy(),
                                   rtol=RTOL, atol=1e-12)


@pytest.mark.parametrize("form", ["masked_mean", "keras_ignore_class", "flattened"] + [
    pytest.param(f, marks=pytest.mark.slow) for f in ("keras_sample_weight", "bernoulli_masked")])
def test_verify_passes_on_per_token_forms(form):
    _float64()
    model = _token_model()
    args = _data()
    report = kg.verify(_registered(model, form), *args, examples=B)
    assert report.passed, report.table()
    statuses = {c.name: c.status for row in report.rows for c in row.checks}
    assert statuses["one-example"] == "pass"


def test_verify_says_why_when_token_weights_are_no_multiple_of_the_batch_of_ones():
    """A divisor per position (sum over the batch of w[:, t]) weighs an
    example's tokens by different ratios in the batch and on its own."""
    _float64()
    model = _token_model()
    report = kg.verify(_registered(model, "per_position_mean"), *_data(), examples=B)
    statuses = {c.name: c.status for row in report.rows for c in row.checks}
    assert statuses["one-example"] == "skipped" and report.passed, report.table()
    assert any("token weights in the batch are not a multiple of its own" in note
               for note in report.notes), report.notes


def _tokens_with_a_generic_variable(steps, seed):
    """``(variables, logits_of(ids), (ids, targets))``: an embedding and a
    dense head, with ``odd`` (a generic variable) between them; float64,
    batch 3, vocabulary 9."""
    _float64()
    keras.utils.set_random_seed(0)
    vocab, width = 9, 4
    embed, head = keras.layers.Embedding(vocab, width), keras.layers.Dense(vocab)
    odd = tf.Variable(tf.random.stateless_normal([width], [0, seed + 1], dtype=tf.float64),
                      name="odd")
    rng = np.random.default_rng(seed)
    x, y = (tf.constant(rng.integers(0, vocab, (3, steps)), tf.int32) for _ in range(2))
    embed.build((None, steps))
    head.build((None, steps, width))
    return ([embed.embeddings, head.kernel, head.bias, odd],
            lambda ids: head(embed(ids) * tf.math.cos(odd)), (x, y))


@pytest.mark.parametrize("reduce", ["reduce_mean"] + [  # the others: -m slow
    pytest.param(r, marks=pytest.mark.slow)
    for r in ("keras", "sum_over_T", "flat_mean", "ignore_class")])
def test_a_mean_over_positions_known_at_run_time_only(reduce):
    """Under ``input_signature=[None, None]`` (a SavedModel's, ``kfac-rewrite``)
    the positions' count T is known at run time only: ``reduce_mean`` over it
    (or a Keras loss's division by the size ``B T``) was read as a mean over
    the batch alone, so example i's term was T times too large (a generic
    variable's per-example gradients and every norm, hence DP-SGD's clipping)
    and K-FAC's curvature scale T times too large (another trajectory than
    the same loss traced with T known). The size is now a divisor, held by
    the weights the runtime reads as the loss's derivative. So is a sum
    divided by ``shape(z)[1]`` (T alone, no batch: it was read as a batch
    mean, every per-example gradient B times too large) and a mean of the
    flattened ``[B T]`` terms; Keras's ``ignore_class``, which reshapes its
    mask to the logits' shape, was refused ("multiplies two tensors that
    depend on the variables"). Per-example gradients equal the static
    trace's (and a loop of one-example tapes where no batch statistic
    divides)."""
    variables, logits_of, (x, y) = _tokens_with_a_generic_variable(steps=5, seed=0)

    def loss(x, y):
        logits = logits_of(x)
        if reduce in ("keras", "ignore_class"):
            return keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, ignore_class=0 if reduce == "ignore_class" else None)(y, logits)
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
        if reduce == "sum_over_T":
            return tf.reduce_sum(ce) / tf.cast(tf.shape(logits)[1], ce.dtype)
        return tf.reduce_mean(tf.reshape(ce, [-1]) if reduce == "flat_mean" else ce)

    spec = [tf.TensorSpec([None, None], tf.int32)] * 2
    static, dynamic = kg.auto_register(loss), kg.auto_register(
        tf.function(loss, input_signature=spec))
    reg = dynamic.registration(x, y)
    assert "generic" in [layer.kind for layer in reg.layers] and reg.loss.weighted
    got = kg.per_example_gradients(dynamic, x, y)
    wants = [kg.per_example_gradients(static, x, y)]
    if reduce != "ignore_class":  # (a masked mean's count is a statistic of the batch)
        wants.append(one_example_loop(loss, (x, y), reg.variables))
    for want in wants:
        for v, g, w in zip(reg.variables, got, want):
            np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12, err_msg=v.name)
    start = [v.numpy() for v in variables]
    losses = []
    for fn in (static, dynamic):
        for v, s in zip(variables, start):
            v.assign(s)
        opt = kg.KFAC(fn, estimation_mode="exact", momentum_type="regular",
                      learning_rate=0.1, damping=1e-2)
        losses.append([float(opt.step(x, y)) for _ in range(4)])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-10)


RUN_TIME_MEANS = {  # (ce [B, T], weights [B, T]) -> a mean over the tokens
    "plain": lambda ce, w: tf.reduce_mean(ce),
    "weighted": lambda ce, w: tf.reduce_mean(ce * w),
    "keras_sample_weight": None,  # sum(ce * w) / size(ce): sum_over_batch_size
}


@pytest.mark.parametrize("form", list(RUN_TIME_MEANS))
def test_a_mean_at_a_run_time_length_has_the_static_blocks(form):
    """A mean over positions traced with T unknown divides by T at run time
    (``LossSpec.size_scaled``): ``1/T`` is read from the sizes as a factor of
    the curvature's scale, as the constant ``scale`` holds it at known
    sizes, and the tokens keep their data's weights, so the estimator's
    blocks (which leave the scale out) are the static trace's. Before, the
    tokens were weighted by ``1/T``: the plain mean's blocks were T times
    smaller than at a known length."""
    _, logits_of, (x, y) = _tokens_with_a_generic_variable(steps=5, seed=1)

    def loss(x, y):
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits_of(x))
        w = tf.cast(y > 2, ce.dtype)
        if RUN_TIME_MEANS[form] is None:
            return keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
                y, logits_of(x), sample_weight=w)
        return RUN_TIME_MEANS[form](ce, w)

    spec = [tf.TensorSpec([None, None], tf.int32)] * 2
    static, dynamic = kg.auto_register(loss), kg.auto_register(
        tf.function(loss, input_signature=spec))
    assert dynamic.registration(x, y).loss.size_scaled
    assert not static.registration(x, y).loss.sizes
    assert static.registration(x, y).loss.weighted == (form != "plain")
    blocks = []
    for fn in (static, dynamic):
        est = kg.FisherEstimator(fn, estimation_mode="exact")
        est.update(x, y)
        blocks.append([b.full_matrix().numpy() for b in est.blocks])
    for a, b in zip(*blocks):
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-14)
    assert kg.verify(dynamic, x, y, estimation_mode="exact").passed


@pytest.mark.parametrize("spec", [[None, 5], [3, None], [None, None]],
                         ids=["batch", "length", "both"])
def test_a_mean_of_flattened_logits_reads_its_rows_at_unknown_sizes(spec):
    """``reduce_mean(ce(reshape(y, [-1]), reshape(logits, [-1, V])))``: the
    mean over the ``[B T]`` rows counts ``T`` rows per example. With a size
    left unknown the rows were not followed through the cross-entropy op
    (nor through a reshape of a length left unknown), so the mean read as
    one over the batch alone: scale 1 where the static trace reads
    ``1/T``, and K-FAC's steps took another trajectory (the per-example
    gradients, read through the loss's derivative, were right). Now the
    rows are followed (``passes.row_axes``; probed where a length is
    unknown, ``passes.shape_probe``) and ``T`` is a size read at run time:
    the steps equal the static trace's."""
    variables, logits_of, (x, y) = _tokens_with_a_generic_variable(steps=5, seed=2)

    def loss(x, y):
        logits = logits_of(x)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            tf.reshape(y, [-1]), tf.reshape(logits, [-1, logits.shape[-1]])))

    start = [v.numpy() for v in variables]
    runs = []
    for fn in (kg.auto_register(loss), kg.auto_register(tf.function(
            loss, input_signature=[tf.TensorSpec(spec, tf.int32)] * 2))):
        for v, s in zip(variables, start):
            v.assign(s)
        opt = kg.KFAC(fn, estimation_mode="exact", momentum_type="regular",
                      learning_rate=0.1, damping=1e-2)
        losses = [float(opt.step(x, y)) for _ in range(3)]
        runs.append((losses, float(opt.curvature_scale), [v.numpy() for v in variables]))
    (static, c_static, w_static), (dynamic, c_dynamic, w_dynamic) = runs
    assert c_static == pytest.approx(1 / 5) and c_dynamic == pytest.approx(c_static)
    np.testing.assert_allclose(dynamic, static, rtol=1e-10)
    for a, b in zip(w_dynamic, w_static):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


# loss(ce [B, T], logits) -> scalar: divisors and means whose reading depends on
# whether they count the batch (T = 6 is a multiple of B = 3: a size's value
# alone cannot tell)
SIZE_FORMS = {
    "sum_over_shape_B": lambda ce, z: tf.reduce_sum(ce) / tf.cast(tf.shape(z)[0], ce.dtype),
    "sum_over_shape_BT": lambda ce, z: tf.reduce_sum(ce) / tf.cast(
        tf.shape(z)[0] * tf.shape(z)[1], ce.dtype),
    "sum_over_shape_T": lambda ce, z: tf.reduce_sum(ce) / tf.cast(tf.shape(z)[1], ce.dtype),
    "mean_of_batch_mean": lambda ce, z: tf.reduce_mean(tf.reduce_mean(ce, 0)),
    "mean_of_batch_sum": lambda ce, z: tf.reduce_mean(tf.reduce_sum(ce, 0)),
    "sum_of_batch_mean": lambda ce, z: tf.reduce_sum(tf.reduce_mean(ce, 0)),
}


@pytest.mark.parametrize("signature", ["static", "dynamic"])
@pytest.mark.parametrize("form", sorted(SIZE_FORMS))
def test_sizes_read_from_shapes_count_the_batch_or_not(form, signature):
    """A sum divided by ``tf.shape(z)[0]`` is a mean over the batch: traced
    with the batch static, TensorFlow folds the shape to a constant, which
    was read as a data divisor of a summed loss, every per-example gradient
    B times too small (DP-SGD clipped a B-th of each gradient). A mean over
    the first axis of a tensor a reduction over the batch made (``[T]``
    after ``reduce_mean(ce, 0)``) averages over positions, not examples: it
    was read as the batch's mean, per-example gradients T (or B) times off.
    Both traces now equal a loop of one-example tapes."""
    _, logits_of, (x, y) = _tokens_with_a_generic_variable(steps=6, seed=1)

    def loss(x, y):
        logits = logits_of(x)
        return SIZE_FORMS[form](tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits), logits)

    if signature == "dynamic":
        loss = tf.function(loss, input_signature=[tf.TensorSpec([None, None], tf.int32)] * 2)
    fn = kg.auto_register(loss)
    reg = fn.registration(x, y)
    got = kg.per_example_gradients(fn, x, y)
    want = one_example_loop(loss, (x, y), reg.variables)
    for v, g, w in zip(reg.variables, got, want):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12, err_msg=v.name)
