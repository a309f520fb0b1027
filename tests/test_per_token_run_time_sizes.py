"""Per-token losses traced with sizes known at run time only
(``input_signature`` ``[None, None]``: a SavedModel's, ``kfac-rewrite``'s,
a relaxed step's): the divisors that are sizes, read from shapes at run
time (``LossSpec.sizes``, ``passes/loss_sizes.py``), give the per-example
gradients, blocks and K-FAC steps of the same loss traced at known sizes,
on an embedding and a dense head with a generic variable between them;
float64. ``tests/test_loss_forms_at_unknown_sizes.py`` runs every form of
the per-token table at each signature.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from per_example_reference import one_example_loop


def _tokens_with_a_generic_variable(steps, seed):
    """``(variables, logits_of(ids), (ids, targets))``: an embedding and a
    dense head, with ``odd`` (a generic variable) between them; float64,
    batch 3, vocabulary 9 (the tests take ``keras_float64``)."""
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
def test_a_mean_over_positions_known_at_run_time_only(keras_float64, reduce):
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
def test_a_mean_at_a_run_time_length_has_the_static_blocks(keras_float64, form):
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
def test_a_mean_of_flattened_logits_reads_its_rows_at_unknown_sizes(keras_float64, spec):
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
def test_sizes_read_from_shapes_count_the_batch_or_not(keras_float64, form, signature):
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
