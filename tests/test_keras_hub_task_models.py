"""keras-hub task models trained with their own losses, beyond
``test_keras_hub_tasks.py``'s CausalLM and TextClassifier: a ``MaskedLM``
(the logits gathered at ``mask_positions``, the masked slots weighted), a
``Seq2SeqLM`` with decoder padding, an ``ImageClassifier`` with label
smoothing, a ``DeepLabV3ImageSegmenter``'s per-pixel loss, and a
``RetinaNetObjectDetector``'s compiled loss (focal and Huber over anchors,
ignored anchors weighted out, both divided by the batch's count of
positive anchors).

Tiny configs, random weights, no preprocessor. The detector's normaliser is
a statistic of the batch's data read from labels its label encoder makes
(``BroadcastTo``, a gather by flattened ids), where the row tracker loses
the examples: before, the pass missed it, so ``kg.verify`` failed every
layer's one-example check (each per-example gradient is the example's share
under the batch's count, rightly) and DP-SGD ran on it. Also: ``DPModel``
fed a dataset whose third element is a per-token ``[B, T]`` mask failed
deep in the step with a shape error; it is refused in one line.
"""
import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import kfac_graph as kg
from per_example_reference import assert_matches_loop
from retinanet_reference import images_and_boxes, tiny_retinanet

B = 3
M = keras_hub.models


def _ids(n, t, v, seed=0):
    rng = np.random.default_rng(seed)
    pad = np.ones((n, t), "int32")
    pad[0, -2:] = 0
    return rng.integers(1, v, (n, t)).astype("int32"), pad


def test_masked_lm_at_mask_positions_with_weights(keras_float64):
    keras.utils.set_random_seed(0)
    backbone = M.BertBackbone(vocabulary_size=30, num_layers=1, num_heads=2, hidden_dim=8,
                              intermediate_dim=16, max_sequence_length=8, dropout=0.0)
    task = M.BertMaskedLM(backbone, preprocessor=None)
    ids, pad = _ids(B, 8, 30)
    rng = np.random.default_rng(1)
    positions = np.stack([rng.choice(6, 3, replace=False) for _ in range(B)]).astype("int32")
    weights = np.ones((B, 3))
    weights[1, -1] = 0.0  # a mask slot the preprocessor padded
    x = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": pad,
         "mask_positions": positions}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @kg.auto_register
    def loss_fn(x, y, w):
        return loss(y, task(x), sample_weight=w)

    args = (tf.nest.map_structure(tf.constant, x),
            tf.constant(np.take_along_axis(ids, positions, 1)), tf.constant(weights))
    reg = assert_matches_loop(loss_fn, args, rtol=1e-9, atol=1e-14)
    assert reg.loss.kind == "categorical" and reg.loss.weighted, reg.loss
    assert "tied_embedding" in {layer.kind for layer in reg.layers}, reg.summary()


def test_seq2seq_lm_with_encoder_and_decoder_padding(keras_float64):
    keras.utils.set_random_seed(0)
    backbone = M.BartBackbone(vocabulary_size=30, num_layers=1, num_heads=2, hidden_dim=8,
                              intermediate_dim=16, max_sequence_length=6, dropout=0.0)
    task = M.BartSeq2SeqLM(backbone, preprocessor=None)
    (enc, enc_pad), (dec, dec_pad) = _ids(B, 6, 30, 0), _ids(B, 6, 30, 1)
    enc_pad[1, -3:] = 0
    x = {"encoder_token_ids": enc, "encoder_padding_mask": enc_pad,
         "decoder_token_ids": dec, "decoder_padding_mask": dec_pad}
    weights = dec_pad.astype("float64")
    weights[:, -1] = 0.0  # no next token after the last
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @kg.auto_register
    def loss_fn(x, y, w):
        return loss(y, task(x), sample_weight=w)

    args = (tf.nest.map_structure(tf.constant, x), tf.constant(np.roll(dec, -1, 1)),
            tf.constant(weights))
    reg = assert_matches_loop(loss_fn, args, rtol=1e-9, atol=1e-14)
    assert reg.loss.weighted and "generic" not in {layer.kind for layer in reg.layers}


def test_a_normaliser_read_from_labels_the_rows_lose(keras_float64):
    """A detector's loss in small: focal terms weighted by ``(label != -2) /
    count(label > -1)`` over the batch, the labels passed through a
    ``BroadcastTo`` the row tracker does not follow."""
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(2)
    x = tf.constant(np.random.default_rng(0).normal(size=(B, 5, 4)))
    labels = tf.constant([[0., 1, -1, -2, -1], [-1, -1, 1, -1, -2], [1, -1, -1, -1, -1]])
    focal = keras.losses.BinaryFocalCrossentropy(from_logits=True, reduction="sum")

    def terms(x, labels, pick):
        labels = tf.broadcast_to(labels, tf.shape(labels))  # (RetinaNet's label encoder)
        y = tf.one_hot(tf.cast(labels, tf.int32), 2, dtype=tf.float64)
        count = tf.maximum(tf.reduce_sum(tf.cast(labels > -1.0, tf.float64)), 1.0)
        w = tf.cast(labels != -2.0, tf.float64) / count
        return focal(y, dense(x), sample_weight=w * pick[:, None])

    loss_fn = kg.auto_register(lambda x, labels: terms(x, labels, tf.ones(B, tf.float64)))
    reg = loss_fn.registration(x, labels)
    assert reg.batch_statistics, "the count of positive anchors is the batch's"
    got = kg.per_example_gradients(loss_fn, x, labels)
    for i in range(B):  # example i's share: its own terms over the batch's count
        with tf.GradientTape() as tape:
            share = terms(x, labels, tf.one_hot(i, B, dtype=tf.float64))
        for g, w in zip(got, tape.gradient(share, reg.variables)):
            np.testing.assert_allclose(g[i], w, rtol=1e-12, atol=1e-15)
    report = kg.verify(loss_fn, x, labels)
    assert report.passed, report.table()
    assert "skipped: batch statistics" in report.table()
    with pytest.raises(kg.KfacGraphError, match="statistic of the whole batch's data"):
        kg.dp_gradients(loss_fn, x, labels, l2_norm_clip=1.0, noise_multiplier=1.0)


def test_dp_model_refuses_per_token_weights_from_a_dataset():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(20, 4),
                              keras.layers.Dense(20)])
    ids, pad = _ids(8, 6, 20)
    data = tf.data.Dataset.from_tensor_slices((ids, np.roll(ids, -1, 1), pad.astype("float32")))
    dp = kg.DPModel(model, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    l2_norm_clip=1.0, noise_multiplier=1.0, num_examples=8, batch_size=4)
    dp.compile(optimizer=keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match=r"third element .* holds shape \[4, 6\], not \[batch\]"):
        dp.fit(data.batch(4), epochs=1, verbose=0)


def _retinanet():
    task = tiny_retinanet()
    task.compile()  # its defaults: Huber and BinaryFocalCrossentropy, both summed
    images, y = images_and_boxes(B)
    return task, tuple(tf.constant(a) for a in (images, y["boxes"], y["labels"]))


@pytest.mark.slow  # a detector's first trace and K-FAC steps, about 85 s
def test_retinanet_compiled_loss(keras_float64):
    task, args = _retinanet()

    @kg.auto_register
    def loss_fn(x, boxes, labels):
        y_pred = task(x, training=False)
        return task.compute_loss(x=x, y={"boxes": boxes, "labels": labels}, y_pred=y_pred,
                                 sample_weight=None)

    huber = keras.losses.Huber(reduction="sum")
    focal = keras.losses.BinaryFocalCrossentropy(from_logits=True, reduction="sum")

    def share(i):  # example i's terms over the batch's count of positive anchors
        y_pred = task(args[0], training=False)
        box, label = task.label_encoder(images=args[0], gt_boxes=args[1], gt_classes=args[2])
        positive = ops.cast(label > -1.0, "float32")
        count, pick = ops.maximum(ops.sum(positive), 1.0), tf.one_hot([i], B)[0][:, None]
        return (huber(box, y_pred["bbox_regression"], sample_weight=positive / count * pick)
                + focal(ops.one_hot(ops.cast(label, "int32"), 3), y_pred["cls_logits"],
                        sample_weight=ops.cast(label != -2.0, "float32") / count * pick))

    reg = loss_fn.registration(*args)
    assert reg.batch_statistics and reg.loss.reduction == "sum", reg.summary()
    got = kg.per_example_gradients(loss_fn, *args)
    for i in range(B):
        with tf.GradientTape() as tape:
            mine = share(i)
        want = tape.gradient(mine, reg.variables)
        scale = np.sqrt(sum(np.sum(np.square(w)) for w in want))
        for v, g, w in zip(reg.variables, got, want):
            np.testing.assert_allclose(g[i], w, atol=1e-12 * scale, err_msg=v.name)
    assert kg.verify(loss_fn, *args, examples=2).passed
    with pytest.raises(kg.KfacGraphError, match="statistic of the whole batch's data"):
        kg.dp_gradients(loss_fn, *args, l2_norm_clip=1.0, noise_multiplier=1.0)
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(3)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses


@pytest.mark.slow  # two fits of a ResNet and a ViT, about 85 s
def test_image_classifiers_fit_with_label_smoothing():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 16, 16, 3)).astype("float32"), np.eye(4)[rng.integers(0, 4, 8)]
    loss = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1)
    keras.utils.set_random_seed(0)
    resnet = M.ResNetImageClassifier(M.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 8],
        stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block",
        image_shape=(16, 16, 3)), num_classes=4, preprocessor=None)
    km = kg.KFACModel(resnet, loss=loss)  # batch norm in training mode
    km.compile()
    history = km.fit(x, y, batch_size=4, epochs=2, verbose=0).history["loss"]
    assert history[-1] < history[0] and int(km.optimizer.kfac.skipped_steps) == 0, history
    vit = M.ViTImageClassifier(M.ViTBackbone(image_shape=(16, 16, 3), patch_size=8, num_layers=1,
                                             num_heads=2, hidden_dim=8, mlp_dim=16),
                               num_classes=4, preprocessor=None)

    @kg.auto_register
    def loss_fn(x, y):
        return loss(y, vit(x))

    assert_matches_loop(loss_fn, (tf.constant(x[:B]), tf.constant(y[:B])), rtol=1e-4,
                        atol=1e-6)
    dp = kg.DPModel(vit, loss=loss, l2_norm_clip=1.0, noise_multiplier=0.5)
    dp.compile(optimizer=keras.optimizers.SGD(0.1))
    assert np.isfinite(dp.fit(x, y, batch_size=4, epochs=1, verbose=0).history["loss"]).all()


@pytest.mark.slow  # a segmenter's trace and K-FAC steps, about 30 s
def test_deeplab_per_pixel_loss_with_ignored_pixels(keras_float64):
    keras.utils.set_random_seed(0)
    encoder = M.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 8],
        stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block",
        image_shape=(16, 16, 3))
    task = M.DeepLabV3ImageSegmenter(M.DeepLabV3Backbone(
        image_encoder=encoder, spatial_pyramid_pooling_key="P3", upsampling_size=2,
        dilation_rates=[1, 2], low_level_feature_key="P2", projection_filters=8,
        image_shape=(16, 16, 3)), num_classes=3, preprocessor=None)
    rng = np.random.default_rng(0)
    args = (tf.constant(rng.normal(size=(B, 16, 16, 3))),
            tf.constant(rng.integers(0, 3, (B, 16, 16))),
            tf.constant((rng.uniform(size=(B, 16, 16)) > 0.2).astype("float64")))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @kg.auto_register
    def loss_fn(x, y, w):
        return loss(y, task(x, training=False), sample_weight=w)

    reg = assert_matches_loop(loss_fn, args, rtol=1e-9, atol=1e-14)
    assert reg.loss.weighted and {layer.kind for layer in reg.layers} == {
        "conv2d", "scale_and_shift"}, reg.summary()
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(3)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses
