"""Where the examples meet (`passes/coupling.py`).

A contrastive loss (`a @ b^T` over the batch, labels `range(B)`), a pairwise
distance (`x[:, None] - x[None]`) and batch normalisation in training mode
make one example's loss read other examples. The registration lists those
ops (`reg.coupling`) and warns; `kg.DPSGD` and `kg.dp_gradients` refuse the
loss in one line (clipping an example's share bounds nothing); per-example
gradients are still each example's share and sum to the batch gradient;
`kg.verify` marks the one-example comparison `couples examples`.
Attention (examples meet only themselves) and batch normalisation in
inference mode couple nothing, and DP-SGD runs. A statistic of the data
alone over the batch (a masked mean's ``sum(mask)``) couples no
per-example gradient (it is a weight, constant for the batch), but DP-SGD
refuses it too: removing one example changes the others' terms.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg

B = 6


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return rng, tf.constant(rng.normal(size=(B, 4)))


def _contrastive():
    rng, x = _data()
    w1 = tf.Variable(rng.normal(size=(4, 3)), name="image_projection")
    w2 = tf.Variable(rng.normal(size=(5, 3)), name="text_projection")

    @kg.auto_register
    def loss_fn(x, t):
        a = tf.math.l2_normalize(x @ w1, axis=1)
        b = tf.math.l2_normalize(t @ w2, axis=1)
        logits = 10.0 * a @ tf.transpose(b)
        labels = tf.range(tf.shape(x)[0])
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
    return loss_fn, (x, tf.constant(rng.normal(size=(B, 5))))


def _pairwise():
    rng, x = _data(1)
    w = tf.Variable(rng.normal(size=(4, 3)), name="embedding")

    @kg.auto_register
    def loss_fn(x, y):
        e = x @ w
        distances = tf.reduce_sum(tf.square(e[:, None, :] - e[None, :, :]), axis=-1)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, -distances))
    return loss_fn, (x, tf.constant([0, 1, 2, 3, 4, 5]))


def _keras(training, body):
    keras.utils.set_random_seed(0)
    rng, x = _data(2)
    model = keras.Sequential([keras.Input((4,), dtype="float64"), *body(),
                              keras.layers.Dense(3, dtype="float64")])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, model(x, training=training)))
    return loss_fn, (x, tf.constant(rng.integers(0, 3, B)))


def _batch_norm(training):
    return _keras(training, lambda: [keras.layers.Dense(5, dtype="float64"),
                                     keras.layers.BatchNormalization(dtype="float64")])


def _graph_network(form):
    """Node classification: the examples are a graph's nodes, and a layer
    sums each node's neighbours' features (the adjacency as a dense or a
    sparse product, or messages along an edge list summed per node), so
    one node's loss reads other nodes' activations."""
    rng, x = _data(4)
    w = tf.Variable(rng.normal(size=(4, 3)), name="node_projection")
    adjacency = (rng.uniform(size=(B, B)) > 0.5) + np.eye(B)
    src, dst = (tf.constant(i) for i in np.nonzero(adjacency))

    @kg.auto_register
    def loss_fn(x, y):
        h = tf.tanh(x @ w)
        if form == "dense":
            h = tf.constant(adjacency / adjacency.sum(1, keepdims=True)) @ h
        elif form == "sparse":
            h = tf.sparse.sparse_dense_matmul(tf.sparse.from_dense(adjacency), h)
        elif form == "edges":
            h = tf.math.unsorted_segment_mean(tf.gather(h, src), dst, B)
        else:  # a Gram matrix of one tensor: every node against every other
            h = tf.matmul(h, h, transpose_b=True)[:, :3]
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h))
    return loss_fn, (x, tf.constant(rng.integers(0, 3, B)))


def _resized_batch_norm(upsample):
    """Batch normalisation in training mode after an upsampling or a resize
    (DeepLabV3's and SegFormer's decoders), a dilated convolution, or a Keras
    Dense on a sequence (``[B T, d] -> [B, T, d]``): the rows were lost there
    (a ``Tile`` and ``Reshape`` for nearest, ``ResizeBilinear``, the
    Reshape back to batch-leading), so the moments were not seen as a
    reduction over the examples and DP-SGD ran on a loss whose examples meet."""
    rng, x = _data(8)
    keras.config.set_floatx("float64")  # (conftest restores them)
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    layers = keras.layers
    conv = layers.Conv2D(3, 3, padding="same", dilation_rate=2 if upsample == "dilated" else 1)
    before = {"nearest": [conv, layers.UpSampling2D(2)],
              "bilinear": [conv, layers.UpSampling2D(2, interpolation="bilinear")],
              "resizing": [conv, layers.Resizing(6, 6, interpolation="nearest")],
              "dilated": [conv],  # SpaceToBatchND: the rows are interleaved
              "dense": [layers.Reshape((16, 2)), layers.Dense(3)]}[upsample]  # [B T, d] rows
    pool = (layers.GlobalAveragePooling1D() if upsample == "dense"
            else layers.GlobalAveragePooling2D())
    model = keras.Sequential([keras.Input((4, 4, 2)), *before, layers.BatchNormalization(), pool,
                              layers.Dense(3)])

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, model(x, training=True)))
    x = tf.constant(rng.normal(size=(B, 4, 4, 2)))
    return loss_fn, (x, tf.constant(rng.integers(0, 3, B)))


@pytest.mark.parametrize("build, op", [
    (_contrastive, "matmul"), (_pairwise, "sub"), (lambda: _batch_norm(True), "moments"),
    (lambda: _resized_batch_norm("nearest"), "moments"),
    (lambda: _resized_batch_norm("resizing"), "moments"),
    (lambda: _resized_batch_norm("dense"), "moments"),
    (lambda: _graph_network("dense"), "matmul"),
    (lambda: _graph_network("sparse"), "sparsetensordensematmul"),
    (lambda: _graph_network("edges"), "gather"), (lambda: _graph_network("gram"), "matmul")])
def test_coupling_is_listed_and_dp_refuses_it(build, op):
    loss_fn, args = build()
    reg = loss_fn.registration(*args)
    assert reg.coupling and op in reg.coupling[0].lower(), reg.coupling
    for run in (lambda: kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0,
                                 noise_multiplier=1.0).step(*args),
                lambda: kg.dp_gradients(loss_fn, *args, l2_norm_clip=1.0, noise_multiplier=1.0)):
        with pytest.raises(kg.KfacGraphError, match=r"couples the examples at op .* no "
                                                     r"differential privacy"):
            run()
    grads = kg.per_example_gradients(loss_fn, *args)  # each example's share
    with tf.GradientTape() as tape:
        loss = loss_fn(*args)
    for g, w in zip(grads, tape.gradient(loss, reg.variables)):
        np.testing.assert_allclose(np.mean(g, 0), w, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("before", ["bilinear", "dilated"])
def test_batch_norm_after_a_bilinear_resize_or_a_dilated_conv_is_refused(before):
    """ResizeBilinear computes in float32 (the shares' sum is the batch
    gradient to float32's rounding only, so the test above leaves it out);
    a dilated convolution's SpaceToBatchND interleaves the examples' rows,
    which the tracker does not follow: DP-SGD refuses from the batch
    normalisation layer the pass matched (``normaliser_coupling``)."""
    loss_fn, args = _resized_batch_norm(before)
    coupling = loss_fn.registration(*args).coupling
    assert (before == "dilated" or "moments" in coupling[0]), coupling
    with pytest.raises(kg.KfacGraphError, match="couples the examples"):
        kg.dp_gradients(loss_fn, *args, l2_norm_clip=1.0, noise_multiplier=1.0)


def test_a_layer_that_meets_no_example_is_generic_and_exact():
    """Keras's graph-network recipe: the examples are node ids, and every
    layer runs on the whole graph's features (a constant), the same for
    every example, before each example gathers its node. Such a layer is no
    dense layer of the examples: with as many ids as nodes, the dense rule
    read the nodes as the examples (a wrong gradient, silently); now it is
    generic and each example's gradient is its own."""
    rng = np.random.default_rng(5)
    features = tf.constant(rng.normal(size=(B, 4)))
    src, dst = tf.constant(rng.integers(0, B, 10)), tf.constant(rng.integers(0, B, 10))
    keras.utils.set_random_seed(0)
    encode, classify = keras.layers.Dense(5, dtype="float64"), keras.layers.Dense(3, dtype="float64")

    @kg.auto_register
    def loss_fn(ids, y):
        h = tf.nn.relu(encode(features))
        h = h + tf.math.unsorted_segment_mean(tf.gather(h, src), dst, B)
        logits = tf.gather(classify(h), ids)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    ids, y = tf.constant([5, 0, 3, 3, 1, 2]), tf.constant(rng.integers(0, 3, B))
    reg = loss_fn.registration(ids, y)
    assert {layer.kind for layer in reg.layers} == {"generic"}, reg.summary()
    assert "it meets no example there" in reg.layers[0].reason
    grads = kg.per_example_gradients(loss_fn, ids, y)
    for i in range(B):
        with tf.GradientTape() as tape:
            loss = loss_fn(ids[i:i + 1], y[i:i + 1])
        for g, w in zip(grads, tape.gradient(loss, reg.variables)):
            np.testing.assert_allclose(g[i], w, rtol=1e-10, atol=1e-12)


def test_verify_marks_a_contrastive_loss():
    loss_fn, args = _contrastive()
    report = kg.verify(loss_fn, *args)
    assert "couples examples" in report.table()
    assert any("the loss at op" in n and "couples the examples" in n for n in report.notes)
    assert not any("batch normalisation" in n for n in report.notes), report.notes


def _attention():
    mha = keras.layers.MultiHeadAttention(2, 4, dtype="float64")
    head = keras.layers.Dense(3, dtype="float64")
    rng = np.random.default_rng(3)

    @kg.auto_register
    def loss_fn(x, mask, y):
        h = mha(x, x, attention_mask=mask[:, None, :] * mask[:, :, None])
        terms = tf.nn.sparse_softmax_cross_entropy_with_logits(y, head(h))
        mask = tf.cast(mask, terms.dtype)  # each example's own masked mean
        return tf.reduce_mean(tf.reduce_sum(terms * mask, 1) / tf.reduce_sum(mask, 1))
    mask = np.ones((B, 5), "int32")
    mask[0, 3:] = 0
    return loss_fn, (tf.constant(rng.normal(size=(B, 5, 4))), tf.constant(mask),
                     tf.constant(rng.integers(0, 3, (B, 5))))


def _siamese_dot():
    """Keras's ``Dot(axes=1, normalize=True)``: each pair's cosine, a batched
    ``[B, 1, d] @ [B, d, 1]`` whose unit axes the pass sees through. Read
    as ``[B, d] @ [B, d]``, it was taken for a product over the examples:
    DP-SGD refused the loss and ``kg.verify`` skipped its one-example check."""
    keras.utils.set_random_seed(0)
    rng, x = _data(6)
    a, b = keras.Input((4,), dtype="float64"), keras.Input((4,), dtype="float64")
    embed = keras.layers.Dense(3, dtype="float64")
    cosine = keras.layers.Dot(axes=1, normalize=True, dtype="float64")([embed(a), embed(b)])
    model = keras.Model([a, b], keras.layers.Dense(2, dtype="float64")(cosine))

    @kg.auto_register
    def loss_fn(x1, x2, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model([x1, x2])))
    return loss_fn, (x, tf.constant(rng.normal(size=(B, 4))), tf.constant(rng.integers(0, 2, B)))


def _first_tokens(ids_of):
    """Gemma3's (and T5Gemma2's) image interleaving reads each example's first
    token from the flattened sequence, ``take(flat, arange(B) * T)`` (Keras's
    ``take`` wraps negative ids with a ``where``): ids known when tracing,
    each in its own example's rows. It was read as a gather across the
    examples, and DP-SGD refused the loss. Ids that pick another example's
    row still couple."""
    rng = np.random.default_rng(9)
    keras.utils.set_random_seed(0)
    embed = keras.layers.Embedding(20, 4, dtype="float64")
    image, head = keras.layers.Dense(4, dtype="float64"), keras.layers.Dense(3, dtype="float64")

    @kg.auto_register
    def loss_fn(ids, x, y):
        text = embed(ids)
        flat = keras.ops.reshape(text, (B * 5, 4))
        first = keras.ops.take(flat, ids_of(keras.ops.arange(B, dtype="int32") * 5), axis=0)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, head(first + image(x))))
    return loss_fn, (tf.constant(rng.integers(0, 20, (B, 5))), tf.constant(rng.normal(size=(B, 2))),
                     tf.constant(rng.integers(0, 3, B)))


def _stacked_streams():
    """Gemma3n's AltUp: streams stacked ahead of the batch, ``[N, B, ..]``,
    mixed per example, then repeated (a Tile) ahead of it again. With as many
    streams as examples the stacked tensor read as batch-leading, and its
    products with per-example coefficients as products across the examples
    (DP-SGD refused the loss); the tracker now follows the stack and the tile."""
    rng = np.random.default_rng(10)
    keras.utils.set_random_seed(0)
    embed, router = keras.layers.Dense(4, dtype="float64"), keras.layers.Dense(B, dtype="float64")
    head = keras.layers.Dense(3, dtype="float64")

    @kg.auto_register
    def loss_fn(x, y):
        h = embed(x)
        streams = tf.stack([h * (k + 1.0) for k in range(B)], axis=0)  # [N = B, B, 4]
        mixed = tf.reduce_sum(streams * tf.transpose(router(x))[:, :, None], axis=0)
        again = keras.ops.repeat(mixed[None], B, axis=0)  # [N, B, 4]
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            y, head(tf.reduce_mean(again * streams, axis=0))))
    return loss_fn, (tf.constant(rng.normal(size=(B, 4))), tf.constant(rng.integers(0, 3, B)))


def test_a_gather_of_other_examples_rows_by_constant_ids_couples():
    loss_fn, args = _first_tokens(lambda own: own[::-1])
    assert "GatherV2" in loss_fn.registration(*args).coupling[0]


@pytest.mark.parametrize("build", [_attention, lambda: _batch_norm(False), _siamese_dot,
                                   lambda: _first_tokens(lambda own: own), _stacked_streams])
def test_no_coupling_where_examples_meet_only_themselves(build):
    loss_fn, args = build()
    assert loss_fn.registration(*args).coupling == ()
    dp = kg.DPSGD(loss_fn, learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0)
    assert np.isfinite(float(dp.step(*args)))
    report = kg.verify(loss_fn, *args, examples=2, directions=1)
    assert report.passed and "couples examples" not in report.table(), report.table()


def _token_loss(form):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(7)
    model = keras.Sequential([keras.layers.Embedding(7, 3, dtype="float64"),
                              keras.layers.Dense(7, dtype="float64")])
    mask = np.ones((B, 5))
    mask[0, 2:], mask[3, 1:] = 0, 0

    @kg.auto_register
    def loss_fn(ids, y, w):
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(ids))
        if form == "batch_mean":  # the batch's count of tokens
            return tf.reduce_sum(ce * w) / tf.reduce_sum(w)
        if form == "keras_ignore_class":  # the same count, by Keras
            return keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, ignore_class=0)(y * tf.cast(w, y.dtype), model(ids))
        if form == "class_balanced":  # each class weighed by its count in the batch
            counts = tf.reduce_sum(tf.one_hot(y, 7, dtype=ce.dtype), axis=[0, 1])
            return tf.reduce_mean(ce * tf.gather(1.0 / (counts + 1.0), y))
        if form == "own_mean":
            return tf.reduce_mean(tf.reduce_sum(ce * w, 1) / tf.reduce_sum(w, 1))
        return tf.reduce_sum(ce * w) / 12.0  # a constant divisor
    ids, y = (tf.constant(rng.integers(1, 7, (B, 5))) for _ in range(2))
    return loss_fn, (ids, y, tf.constant(mask))


@pytest.mark.parametrize("form, op", [("batch_mean", "sum"), ("keras_ignore_class", "sum"),
                                      ("class_balanced", "sum"), ("own_mean", None),
                                      ("constant", None)])
def test_a_statistic_of_the_batch_data_is_refused_by_dp(form, op):
    """Per-example gradients under a masked mean over the batch's tokens are
    each example's share, the count a constant for the batch; but drop one
    example and every other's clipped gradient changes with the count, so
    the clipped sum moves by more than the clip norm: DP-SGD's sensitivity
    fails. DP-SGD refuses such a loss in one line; each example's own mean
    or a constant divisor is fine."""
    loss_fn, args = _token_loss(form)
    reg = loss_fn.registration(*args)
    assert reg.coupling == ()
    if op is None:
        assert reg.batch_statistics == ()
        kg.dp_gradients(loss_fn, *args, l2_norm_clip=1.0, noise_multiplier=1.0)
        return
    assert reg.batch_statistics and op in reg.batch_statistics[0].lower(), reg.batch_statistics
    assert "statistics of the batch's data: " in reg.summary()
    with pytest.raises(kg.KfacGraphError, match=r"statistic of the whole batch's data at op"):
        kg.dp_gradients(loss_fn, *args, l2_norm_clip=1.0, noise_multiplier=1.0)
    if form != "batch_mean":
        return
    # no clip reached: the sum of the clipped gradients is the batch's; without
    # the last example it is not the rest of that sum, as every other term moved
    def summed(ids, y, w):
        grads = kg.per_example_gradients(loss_fn, ids, y, w)
        flat = np.concatenate([np.reshape(g, (len(ids), -1)) for g in grads], axis=1)
        return np.sum(flat, axis=0), flat[-1]
    whole, last = summed(*args)
    rest, _ = summed(*(a[:-1] for a in args))
    assert np.linalg.norm(whole - rest - last) > 0.1 * np.linalg.norm(last)
