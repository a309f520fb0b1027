"""Convolutions whose input's spatial size is known at run time only: a
SavedModel's ``[B, None, None, C]``, ``kfac-rewrite``'s step, a Conv1D on
sequences of any length, a step traced with ``input_signature``.

A 2-D convolution (Conv1D lowered to it, strided, grouped, depthwise,
separable, channels-first) registers as at a static size. Where the step is
traced with the size unknown, its per-example gradients contract the patches
``tf.image.extract_patches`` gives at any size with the output gradient over
the positions (``conv_family.run_time_grads``); the factors' rows come from
the same patches. Per-example gradients equal one-example tapes at two
sizes, and K-FAC steps traced with the size unknown equal the steps at the
static size (a Conv1D's ``Squeeze`` of its unit axis is seen through at any
length, so its bias is its layer's, as at a static length). A dilated one
(a temporal network's causal Conv1D) is written by TensorFlow as
``SpaceToBatchND -> conv -> BatchToSpaceND`` with paddings and crops
computed from the size; their difference, the convolution's own padding,
is the same under every probe (``passes.shape_probe``). A transposed one
contracts the patches of its output gradient with its input (the forward
convolution's roles swapped). A 3-D one (plain, grouped, transposed) takes
its patches as depth slabs of 2-D patches, which XLA compiles. float64."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from per_example_reference import one_example_loop

L = keras.layers
# name: (layers, spatial rank, channels, the kinds registered)
CASES = {
    "conv1d": (lambda: [L.Conv1D(4, 3, activation="tanh"), L.Conv1D(4, 1, strides=2),
                        L.GlobalAveragePooling1D()], 1, 3, ["conv2d", "conv2d", "dense"]),
    "depthwise_conv1d": (lambda: [L.DepthwiseConv1D(3, activation="tanh"),
                                  L.GlobalAveragePooling1D()], 1, 3,
                         ["depthwise_conv2d", "dense"]),
    "strided": (lambda: [L.Conv2D(4, 3, strides=2, padding="same", activation="tanh"),
                         L.Conv2D(4, 1), L.GlobalAveragePooling2D()], 2, 3,
                ["conv2d", "conv2d", "dense"]),
    "depthwise": (lambda: [L.DepthwiseConv2D(3, depth_multiplier=2, padding="same",
                                             activation="tanh"), L.GlobalAveragePooling2D()],
                  2, 3, ["depthwise_conv2d", "dense"]),
    "separable": (lambda: [L.SeparableConv2D(4, 3, activation="tanh"),
                           L.GlobalAveragePooling2D()], 2, 3,
                  ["depthwise_conv2d", "conv2d", "dense"]),
    "grouped": (lambda: [L.Conv2D(4, 3, groups=2, activation="tanh"),
                         L.GlobalAveragePooling2D()], 2, 4, ["conv2d", "dense"]),
    "dilated": (lambda: [L.Conv2D(4, 3, dilation_rate=2, activation="tanh"),
                         L.DepthwiseConv2D(3, dilation_rate=(2, 1), padding="same"),
                         L.GlobalAveragePooling2D()], 2, 3,
                ["conv2d", "depthwise_conv2d", "dense"]),
    "temporal": (lambda: [L.Conv1D(4, 2, dilation_rate=2, padding="causal", activation="tanh"),
                          L.Conv1D(4, 2, dilation_rate=4, padding="causal"),
                          L.GlobalAveragePooling1D()], 1, 3, ["conv2d", "conv2d", "dense"]),
    "transposed": (lambda: [L.Conv2DTranspose(3, 3, strides=2, activation="tanh"),
                            L.Conv2DTranspose(2, 3, strides=2, padding="same", output_padding=1,
                                              dilation_rate=1), L.Conv2D(2, 1),
                            L.GlobalAveragePooling2D()], 2, 3,
                   ["conv2d_transpose", "conv2d_transpose", "conv2d", "dense"]),
    "conv3d": (lambda: [L.Conv3D(4, 2, activation="tanh"),
                        L.Conv3D(4, (2, 3, 2), strides=(1, 2, 2), padding="same", groups=2),
                        L.Conv3DTranspose(2, 2, strides=2, padding="same"),
                        L.GlobalAveragePooling3D()], 3, 3,
               ["conv3d", "conv3d", "conv3d_transpose", "dense"]),
    "batch_norm": (lambda: [L.Conv2D(4, 3, activation="tanh"), L.BatchNormalization(),
                            L.GlobalAveragePooling2D()], 2, 3,
                   ["conv2d", "scale_and_shift", "dense"]),
}


def _problem(layers, rank, channels):
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((None,) * rank + (channels,)), *layers(),
                              L.Dense(2)])

    def loss(x, y):
        logits = model(x, training=False)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
    spec = [tf.TensorSpec([None] * (rank + 1) + [channels], tf.float64),
            tf.TensorSpec([None], tf.int32)]
    return model, loss, spec


def _images(rank, channels, sizes, seed):
    x = np.random.default_rng(seed).normal(size=(3, *sizes[:rank], channels))
    return tf.constant(x), tf.constant([0, 1, 1])


FAST = ("conv1d", "dilated", "temporal", "grouped")  # the others under -m slow


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow)
                                  for n in sorted(CASES)])
def test_a_convolution_of_any_size_registers_and_equals_the_loop(name):
    layers, rank, channels, kinds = CASES[name]
    model, loss, spec = _problem(layers, rank, channels)
    fn = kg.auto_register(tf.function(loss, input_signature=spec))
    unknown = tf.function(lambda *a: kg.per_example_gradients(fn, *a), input_signature=spec)
    norms = tf.function(lambda *a: kg.per_example_gradient_norms(fn, *a),
                        input_signature=spec)
    for seed, sizes in enumerate(([6, 6, 5], [9, 7, 6])):
        args = _images(rank, channels, sizes, seed)
        reg = fn.registration(*args)
        assert "generic" not in [layer.kind for layer in reg.layers], reg.summary()
        assert [layer.kind for layer in reg.layers] == kinds
        want = one_example_loop(loss, args, reg.variables)
        for got in (unknown(*args), kg.per_example_gradients(fn, *args)):
            for v, g, w in zip(reg.variables, got, want):
                np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12, err_msg=v.name)
        flat = np.concatenate([np.reshape(w, (3, -1)) for w in want], axis=1)
        np.testing.assert_allclose(norms(*args), np.linalg.norm(flat, axis=1), rtol=1e-9)


@pytest.mark.parametrize("name", ["conv1d"] + [  # (3-D: the compiled test)
    pytest.param(n, marks=pytest.mark.slow)
    for n in ("dilated", "conv3d", "strided", "depthwise", "grouped", "transposed")])
def test_kfac_steps_traced_at_any_size_equal_the_static_ones(name):
    layers, rank, channels, _ = CASES[name]
    model, loss, spec = _problem(layers, rank, channels)
    args = _images(rank, channels, [7, 6, 5], 3)
    start = [v.numpy() for v in model.trainable_variables]
    losses = []
    for fn, signature in ((kg.auto_register(loss), None),
                          (kg.auto_register(tf.function(loss, input_signature=spec)), spec)):
        for v, s in zip(model.trainable_variables, start):
            v.assign(s)
        opt = kg.KFAC(fn, learning_rate=0.05, damping=1e-2, estimation_mode="exact",
                      momentum_type="regular")
        step = opt.step if signature is None else tf.function(
            lambda *a: opt.step(*a), input_signature=signature)
        losses.append([float(step(*args)) for _ in range(3)])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-10)
    assert losses[0][1] < losses[0][0]  # the first step, no momentum yet, goes down


@pytest.mark.slow  # at any size: test_kfac_steps_traced_at_any_size_equal_the_static_ones
def test_a_3d_step_of_any_size_compiles_with_xla():
    """3-D patches at a size known at run time only are depth slabs of 2-D
    patches (``layers/run_time_patches``), which XLA compiles
    (``tf.extract_volume_patches`` has no XLA kernel)."""
    layers, rank, channels, _ = CASES["conv3d"]
    model, loss, spec = _problem(layers, rank, channels)
    fn = kg.auto_register(tf.function(loss, input_signature=spec))
    compiled = tf.function(lambda *a: kg.per_example_gradients(fn, *a), input_signature=spec,
                           jit_compile=True)
    for seed, sizes in enumerate(([5, 4, 6], [7, 5, 4])):
        args = _images(rank, channels, sizes, seed)
        for v, g, w in zip(model.trainable_variables, compiled(*args),
                           one_example_loop(loss, args, model.trainable_variables)):
            np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12, err_msg=v.name)


@pytest.mark.slow  # at any size: test_kfac_steps_traced_at_any_size_equal_the_static_ones
def test_kfac_rewrite_of_images_of_any_size(tmp_path):
    """``kfac-rewrite`` traces its steps with the SavedModel's signature,
    ``[None, None, None, 3]``: the rewritten model's per-example gradients
    equal one-example tapes at two image sizes, and its K-FAC step trains.
    An encoder-decoder: a strided convolution down, a transposed one up."""
    from tools import kfac_rewrite
    model, loss, spec = _problem(lambda: [
        L.Conv2D(4, 3, strides=2, padding="same", activation="tanh"),
        L.Conv2DTranspose(3, 3, strides=2, padding="same"), L.GlobalAveragePooling2D()], 2, 3)

    class Images(tf.Module):
        def __init__(self):
            self.model = model

        @tf.function(input_signature=spec)
        def loss(self, x, y):
            return loss(x, y)

    tf.saved_model.save(Images(), str(tmp_path / "input"))
    assert kfac_rewrite.main(["kfac-rewrite", "--input", str(tmp_path / "input"),
                              "--function", "loss", "--output", str(tmp_path / "out")]) == 0
    report = (tmp_path / "out" / "assets.extra" / "kfac_registration.json").read_text()
    assert '"conv2d_transpose"' in report and '"generic"' not in report
    loaded = tf.saved_model.load(str(tmp_path / "out"))
    for seed, sizes in enumerate(([6, 6], [9, 7])):
        args = _images(2, 3, sizes, seed)
        want = one_example_loop(loss, args, model.trainable_variables)
        got = loaded.per_example_gradients(*args)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)
    losses = [float(loaded.kfac_step(*args)) for _ in range(3)]
    assert losses[-1] < losses[0], losses


def test_an_input_smaller_than_the_kernel_is_refused_naming_the_layer():
    """A VALID 3x3 convolution fed a 2x5 image: TensorFlow's forward returns
    no convolution's output there; the per-example rule and the factors'
    patches stop on one line naming the layer (before: an einsum's shape
    error), and at a size the kernel fits the same functions run."""
    model, loss, spec = _problem(lambda: [L.Conv2D(4, 3, name="too_wide"),
                                          L.GlobalAveragePooling2D()], 2, 3)
    fn = kg.auto_register(tf.function(loss, input_signature=spec))
    opt = kg.KFAC(fn, learning_rate=0.05, damping=1e-2)
    step = tf.function(lambda *a: opt.step(*a), input_signature=spec)
    per_example = tf.function(lambda *a: kg.per_example_gradients(fn, *a),
                              input_signature=spec)
    assert np.isfinite(float(step(*_images(2, 3, [5, 5], 0))))
    assert per_example(*_images(2, 3, [5, 5], 0))[0].shape == (3, 3, 3, 3, 4)
    for run in (per_example, step):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match="too_wide.*kernel span.*larger than its input"):
            run(*_images(2, 3, [2, 5], 1))
