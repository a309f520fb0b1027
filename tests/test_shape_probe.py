"""Functions whose batch is known only at run time (``passes/shape_probe.py``).

A SavedModel's functions, and any ``tf.function`` with an input signature,
leave the batch ``None``. TensorFlow then cannot fold the shape arithmetic
of Keras's Dense on ``[B, T, d]`` (a Tensordot), and the rows
``reshape(h, [-1, d])`` have no size to follow. Before, such a model's
K-FAC step stopped at its first layer on sequences, and ``kfac-rewrite``
of a Keras transformer at save. Checked in float64 against one-example
tapes, against the same function traced with a static batch, and through
the rewritten SavedModel."""
import json

import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph import emit
from passes import frontends, shape_probe
from per_example_reference import assert_matches_loop

B, T, D, V = 3, 4, 6, 7
SIGNATURE = [tf.TensorSpec([None, T], tf.int32), tf.TensorSpec([None, T], tf.int32)]


def _tokens(seed=0):
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.integers(0, V, (B, T)), tf.int32),
            tf.constant(rng.integers(0, V, (B, T)), tf.int32))


def _any_length(loss):
    """``loss`` registered under the signature ``([None, None, D], [None])``:
    float64 sequences of any batch and length, integer labels."""
    return kg.auto_register(tf.function(loss, input_signature=[
        tf.TensorSpec([None, None, D], tf.float64), tf.TensorSpec([None], tf.int32)]))


def _matches_at_lengths(signed, rng, lengths):
    """``(registration, args)`` of the last length, after checking the
    per-example gradients against one-example tapes at each length."""
    for length in lengths:
        args = (tf.constant(rng.normal(size=(B, length, D))), tf.constant([0, 1, 1]))
        reg = assert_matches_loop(signed, args)
    return reg, args


def _float64_keras(seed):
    """Keras computing in float64 (conftest restores the dtypes), seeded."""
    keras = pytest.importorskip("keras")
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(seed)
    return keras


def _assert_fisher_as_static(signed, loss, args):
    """The exact Fisher's blocks of ``signed`` (``loss`` under an input
    signature) equal those of ``loss`` traced with a static batch, each times
    its loss's scale (the curvature ``c F``). A plain mean over positions
    known at run time only (``LossSpec.size_scaled``) reads its ``1/T`` as a
    factor of ``c`` at run time, as the static scale holds it: the blocks
    themselves are equal."""
    a, b = (kg.FisherEstimator(f, estimation_mode="exact")
            for f in (signed, kg.auto_register(loss)))
    a.update(*args)
    b.update(*args)
    scales = [e.registration.loss.scale for e in (a, b)]
    if a.registration.loss.size_scaled:
        scales = [1.0, 1.0]
    for x, y in zip(a.blocks, b.blocks):
        np.testing.assert_allclose(scales[0] * x.full_matrix(), scales[1] * y.full_matrix(),
                                   rtol=1e-10)


def _sequence_model():
    keras = _float64_keras(0)
    ids = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(V, D)(ids)
    h = h + keras.layers.Embedding(T, D)(tf.range(T))
    h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(2, 3)(h, h))
    h = keras.layers.Dense(8, activation="tanh")(h)
    return keras.Model(ids, keras.layers.Dense(V)(h))


def _per_token_loss(model, masked=False):
    def loss(x, y):
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x))
        if not masked:
            return tf.reduce_mean(ce)
        mask = tf.cast(tf.not_equal(y, 0), ce.dtype)  # class 0 pads
        return tf.reduce_sum(ce * mask) / tf.reduce_sum(mask)
    return loss


@pytest.mark.slow  # the same model through kfac-rewrite's signature: the test below
def test_keras_sequence_model_under_an_input_signature():
    """Keras Dense layers on sequences are dense layers on ``[B, T, d]``, and
    the per-token logits keep their class count: per-example gradients equal
    one-example tapes, and K-FAC steps as on the static trace."""
    model = _sequence_model()
    plain = _per_token_loss(model)
    signed = kg.auto_register(tf.function(plain, input_signature=SIGNATURE))
    args = _tokens()
    reg = signed.registration(*args)
    assert not [layer for layer in reg.layers if layer.kind == "generic"], reg.summary()
    heads = [layer for layer in reg.layers if layer.kind == "dense"
             and layer.variables[0].shape[0] in (6, 8) and len(layer.variables[0].shape) == 2]
    assert [layer.use_attrs[0]["input_shape"] for layer in heads] == [(None, T, D), (None, T, 8)]
    assert_matches_loop(signed, args)
    static = kg.auto_register(plain)
    start = [v.numpy() for v in model.trainable_variables]
    stepped = []
    for f in (signed, static):  # the same step from the same start
        for v, value in zip(model.trainable_variables, start):
            v.assign(value)
        kg.KFAC(f, estimation_mode="exact").step(*args)
        stepped.append([v.numpy() for v in model.trainable_variables])
    for a, b, s in zip(*stepped, start):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-12)
    assert any(not np.allclose(a, s) for a, s in zip(stepped[0], start))


def _router_loss():
    """A mixture of experts' router on ``reshape(x, [-1, d])`` rows, never
    unflattened before the next layer (``tests/test_flattened_rows.py``)."""
    rng = np.random.RandomState(0)
    w = tf.Variable(rng.normal(size=(D, 5)), name="router")
    head = tf.Variable(rng.normal(size=(D, 2)), name="head")

    def loss(x, y):
        rows = tf.reshape(x, [-1, D])
        mixed = rows * tf.reduce_sum(tf.nn.softmax(rows @ w), axis=-1, keepdims=True)
        pooled = tf.reduce_mean(tf.reshape(mixed, tf.shape(x)), axis=1)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, pooled @ head))
    x = tf.constant(rng.normal(size=(B, T, D)))
    return loss, (x, tf.constant([0, 1, 1])), [tf.TensorSpec([None, T, D], tf.float64),
                                                 tf.TensorSpec([None], tf.int32)]


@pytest.mark.parametrize("length", ["static", "run time"])
def test_rows_are_followed_under_an_unknown_batch(length):
    """The router's rows ``[T B, D]``: read ``[B, T, D]``; with the length
    known at run time only too, ``[B, k, D]`` with ``k`` from the rows'
    size and the batch when the step runs."""
    loss, args, signature = _router_loss()
    if length == "run time":
        signature = [tf.TensorSpec([None, None, D], tf.float64), signature[1]]
    signed = kg.auto_register(tf.function(loss, input_signature=signature))
    reg = signed.registration(*args)
    attrs = reg.layers[0].use_attrs[0]
    assert (attrs["input_shape"], attrs.get("run_time_rows")) == (
        ((None, T, D), None) if length == "static" else ((None, None, D), 0)), reg.summary()
    assert_matches_loop(signed, args)
    _assert_fisher_as_static(signed, loss, args)


def _windows(keras):
    """Windows ``[B T / 2, 2, D]`` through a Keras Dense (a Tensordot whose
    permutation is computed in the graph), then back to ``[B, T, D]``."""
    dense, head = keras.layers.Dense(D, activation="tanh"), keras.layers.Dense(2)
    return lambda x: head(tf.reduce_mean(tf.reshape(dense(tf.reshape(x, [-1, 2, D])),
                                                    [-1, T, D]), axis=1))


def _recurrent(keras):
    """A GRU's sequence (stacked from a list whose element shape was traced
    with the batch unknown) under a Dense per step, averaged."""
    gru, head = keras.layers.GRU(5, return_sequences=True), keras.layers.Dense(2)
    return lambda x: tf.reduce_mean(head(gru(x)), axis=1)


@pytest.mark.parametrize("build", [_windows, _recurrent])
def test_rows_and_sequences_under_an_input_signature(build):
    keras = _float64_keras(1)
    logits = build(keras)
    x = tf.constant(np.random.default_rng(2).normal(size=(B, T, D)))
    args = (x, tf.constant([0, 1, 1]))

    def loss(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits(x)))
    loss(*args)  # builds the layers
    signed = kg.auto_register(tf.function(loss, input_signature=[
        tf.TensorSpec([None, T, D], tf.float64), tf.TensorSpec([None], tf.int32)]))
    reg = assert_matches_loop(signed, args)
    assert not [layer for layer in reg.layers if layer.kind == "generic"], reg.summary()


def test_experts_on_tokens_of_any_length():
    """A mixture of experts' layers on ``reshape(x, [-1, d])`` tokens of
    sequences of any length: every expert's input kernel (a dense layer
    whose output lays the experts first, ``"td,edm->etm"``) and output
    kernel (a grouped dense layer, ``"etm,emd->etd"``), a norm on the rows;
    the input kernels' bias ``b[:, None, :]`` (GPT-OSS's) is their layer's;
    each reads its rows ``[B, k, ..]`` with ``k`` known when the step runs.
    Per-example gradients equal one-example tapes at two lengths, and the
    exact Fisher's blocks equal the static trace's."""
    rng = np.random.RandomState(4)
    w_in = tf.Variable(rng.normal(size=(3, D, 4)), name="w_in")
    b_in = tf.Variable(rng.normal(size=(3, 4)), name="b_in")
    w_out = tf.Variable(rng.normal(size=(3, 4, D)), name="w_out")
    scale = tf.Variable(1.0 + rng.normal(size=(D,)) * 0.1, name="scale")
    head = tf.Variable(rng.normal(size=(D, 2)), name="head")

    def loss(x, y):
        rows = tf.reshape(x, [-1, D])
        hidden = tf.tanh(tf.einsum("td,edm->etm", rows, w_in) + b_in[:, None, :])
        experts = tf.einsum("etm,emd->etd", hidden, w_out)
        mixed = tf.reduce_sum(experts, axis=0) * tf.math.rsqrt(
            tf.reduce_mean(tf.square(rows), axis=-1, keepdims=True) + 1e-3) * scale
        pooled = tf.reduce_mean(tf.reshape(mixed, tf.shape(x)), axis=1)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, pooled @ head))
    signed = _any_length(loss)
    reg, args = _matches_at_lengths(signed, rng, (T, T + 3))
    kinds = {v.name.split(":")[0]: (layer.kind, layer.use_attrs[0].get("run_time_rows"))
             for layer in reg.layers for v in layer.variables}
    assert kinds == {"w_in": ("dense", 0), "b_in": ("dense", 0), "w_out": ("grouped_dense", 1),
                     "scale": ("scale_and_shift", 0), "head": ("dense", None)}, reg.summary()
    _assert_fisher_as_static(signed, loss, args)


def test_a_position_table_sliced_to_a_run_time_length():
    """keras-hub's PositionEmbedding on token embeddings of sequences of any
    length: ``Slice(table, [0, 0], [T, D])`` broadcast over the batch is a
    lookup of ids ``range(0, T)``, ``T`` read when the step runs (it was
    generic). Per-example gradients equal one-example tapes at two lengths;
    the exact Fisher's blocks equal the static trace's."""
    keras = _float64_keras(3)
    keras_hub = pytest.importorskip("keras_hub")
    tokens, positions = keras.layers.Embedding(V, D), keras_hub.layers.PositionEmbedding(8)
    head = keras.layers.Dense(V)

    def loss(x, y):
        h = tokens(x)
        logits = head(tf.tanh(h + positions(h)))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
    signed = kg.auto_register(tf.function(loss, input_signature=[
        tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None, None], tf.int32)]))
    rng = np.random.default_rng(4)
    for length in (T, T + 3):
        args = tuple(tf.constant(rng.integers(0, V, (B, length)), tf.int32) for _ in range(2))
        reg = assert_matches_loop(signed, args)
    layer = next(layer for layer in reg.layers if layer.variables[0] is positions.weights[0].value)
    assert (layer.kind, layer.use_attrs[0]["row_range"]) == ("embedding", (0, None))
    assert not [layer for layer in reg.layers if layer.kind == "generic"], reg.summary()
    _assert_fisher_as_static(signed, loss, args)


@pytest.mark.parametrize("form", ["tile", "broadcast", "tile over the length"])
def test_a_token_copied_over_a_run_time_batch(form):
    """A class token tiled or broadcast over a batch known at run time only
    (a ViT's, GPT-OSS's attention sinks) is a shift of zeros on its copies,
    as with a static batch: the probes find the axis that holds the batch
    (``batch_axes``). One tiled over the sequence's length instead is no
    such shift, though its size is unknown too."""
    rng = np.random.RandomState(5)
    token = tf.Variable(rng.normal(size=(1, 1, D)), name="token")
    head = tf.Variable(rng.normal(size=(D, 2)), name="head")

    def loss(x, y):
        n, length = tf.shape(x)[0], tf.shape(x)[1]
        copies = {"tile": lambda: tf.tile(token, [n, 1, 1]),
                  "broadcast": lambda: tf.broadcast_to(token, [n, 1, D]),
                  "tile over the length": lambda: tf.tile(token[0], [length, 1])[None]}[form]()
        h = tf.tanh(tf.concat([copies, x], axis=1) if form != "tile over the length" else
                    x + copies)
        logits = tf.reduce_mean(h, axis=1) @ head
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
    signed = _any_length(loss)
    args = (tf.constant(rng.normal(size=(B, T, D))), tf.constant([0, 1, 1]))
    reg = assert_matches_loop(signed, args)
    kind = next(layer.kind for layer in reg.layers if layer.variables[0] is token)
    assert kind == ("generic" if form == "tile over the length" else "scale_and_shift"), \
        reg.summary()


def test_a_relative_position_table_under_a_run_time_length():
    """T5's relative-position bias on sequences of any length: ids from
    ``range(T)`` (read from ``tf.shape``, so computed from the data's sizes
    alone), looked up, transposed and expanded, added to every example's
    scores. A lookup added over the batch (it was taken for one whose ids
    lead with the examples, and stopped at its first step)."""
    rng = np.random.RandomState(6)
    table = tf.Variable(rng.normal(size=(2 * 8 - 1, 2)), name="table")
    head = tf.Variable(rng.normal(size=(2, 2)), name="head")

    def loss(x, y):
        positions = tf.range(tf.shape(x)[1])
        ids = positions[None, :] - positions[:, None] + 7  # [q, k]
        bias = tf.expand_dims(tf.transpose(tf.gather(table, ids), [2, 0, 1]), 0)
        scores = tf.einsum("bqd,bkd->bqk", x, x)[:, None] + bias  # [B, 2, q, k]
        pooled = tf.reduce_mean(tf.nn.softmax(scores, axis=-1), axis=[2, 3])
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, pooled @ head))
    signed = _any_length(loss)
    reg, args = _matches_at_lengths(signed, rng, (T, T + 2))
    layer = next(layer for layer in reg.layers if layer.variables[0] is table)
    assert (layer.kind, layer.use_attrs[0].get("ids_broadcast")) == ("embedding", True), \
        reg.summary()


def _traced(fn, signature):
    return frontends.trace(tf.function(fn, input_signature=signature), [])


def _shape(traced, name):
    graph = frontends.import_graph(traced)[0]
    return graph.get_tensor_by_name(name).shape.as_list()


def _rows(x, name):
    shape = tf.shape(x)  # as Tensordot computes it: products TensorFlow does not fold
    return tf.reshape(x, tf.stack([tf.reduce_prod(shape[:-1]), tf.reduce_prod(shape[-1:])]),
                      name=name)


def test_only_sizes_that_do_not_depend_on_the_batch_are_restored():
    def fn(x):
        halves = tf.reshape(x, tf.stack([tf.shape(x)[0] // 2, -1]), name="halves")
        return tf.reduce_sum(_rows(x, "rows")) + tf.reduce_sum(halves)
    traced = _traced(fn, [tf.TensorSpec([None, 4, 6])])
    assert _shape(traced, "rows:0") == [None, None]
    restored = shape_probe.restore_shapes(traced)
    assert _shape(restored, "rows:0") == [None, 6]  # 4 B rows: the batch's multiple stays unknown
    # B // 2, and 24 B / (B // 2): 48 for an even batch, not for an odd one
    assert _shape(restored, "halves:0") == [None, None]


def test_probes_the_graph_rejects_are_left_out():
    def halved(x):  # an odd batch cannot be split in halves
        first, second = tf.split(x, 2)
        return tf.reduce_sum(_rows(first, "rows") * _rows(second, "rows_2"))
    restored = shape_probe.restore_shapes(_traced(halved, [tf.TensorSpec([None, 4, 6])]))
    assert _shape(restored, "rows:0") == [None, 6]

    def fixed(x):  # a batch fixed by a constant reshape: no probe fits
        return tf.reduce_sum(tf.reshape(x, [2, 3]) * _rows(x, "rows"))
    traced = _traced(fixed, [tf.TensorSpec([None, 3])])
    assert _shape(traced, "rows:0") == [None, None]
    # without probes, the rows' target is still read element by element
    assert _shape(shape_probe.restore_shapes(traced), "rows:0") == [None, 3]
    static = _traced(fixed, [tf.TensorSpec([2, 3])])
    assert shape_probe.restore_shapes(static) is static  # nothing unknown: nothing to probe


def test_a_function_a_tape_has_differentiated_registers():
    """Once a tape differentiates a ``tf.function``, its graph also outputs
    the intermediates the gradient reads; the loss is still what it returns."""
    loss, args, signature = _router_loss()
    fn = tf.function(loss, input_signature=signature)
    with tf.GradientTape() as tape:
        value = fn(*args)
    assert tape.gradient(value, tape.watched_variables())[0] is not None
    assert len(fn.get_concrete_function().graph.outputs) > 1
    assert_matches_loop(kg.auto_register(fn), args)


class _Saved(tf.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss = tf.function(_per_token_loss(model, masked=True), input_signature=SIGNATURE)


@pytest.mark.slow
def test_kfac_rewrite_of_a_keras_sequence_model(tmp_path):
    """A per-token loss with a padding mask: the rewritten SavedModel's
    per-example gradients equal those of the function traced in process with
    a static batch, and its K-FAC steps lower the loss."""
    model = _sequence_model()
    tf.saved_model.save(_Saved(model), str(tmp_path / "input"))
    emit.rewrite_saved_model(str(tmp_path / "input"), "loss", str(tmp_path / "out"))
    loaded = tf.saved_model.load(str(tmp_path / "out"))
    args = _tokens(1)
    static = kg.auto_register(_per_token_loss(model, masked=True))
    want = {v.name.split(":")[0]: g for v, g in zip(static.registration(*args).variables,
                                                    kg.per_example_gradients(static, *args))}
    report = json.loads((tmp_path / "out" / emit.REPORT_PATH).read_text())
    got = dict(zip(report["variables"], loaded.per_example_gradients(*args)))
    assert sorted(got) == sorted(want)
    for name, g in got.items():
        np.testing.assert_allclose(g, want[name], rtol=1e-8, atol=1e-14, err_msg=name)
    losses = [float(loaded.kfac_step(*args)) for _ in range(4)]
    assert losses[-1] < losses[0], losses
