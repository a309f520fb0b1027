"""The quadratic model through an image resize.

`kg.KFAC`'s default step (`momentum_type="qmodel"`) and `kg.verify`'s exact
Fisher check take Jacobian-vector products by differentiating a backward
pass again. TensorFlow registers `ResizeBilinearGrad` (the backward pass of
`UpSampling2D(interpolation="bilinear")`, a U-Net's or DeepLab's upsampling)
as not differentiable, so the products of every layer before a bilinear
resize were silently zero: the quadratic model saw none of their curvature,
and `kg.verify` failed their Fisher check with an infinite error. It has no
gradient at all for the nearest, bicubic and scale-and-translate (lanczos,
gaussian, antialiased) resizes' backward passes ("No gradient defined").
With `kfac_graph.double_backward` the products equal those of the same
model with the resize written as a matrix product, for every kernel and
corner convention; an op registered as not differentiable that the
products would cross is refused in one line; K-FAC with its defaults
trains through a nearest and a bilinear resize.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import kfac_graph as kg
from kfac_graph.optimizer import exact_fisher
from passes.errors import KfacGraphError

H, W, OUT = 6, 5, (11, 9)

RESIZES = {
    "nearest": lambda h: tf.raw_ops.ResizeNearestNeighbor(
        images=h, size=OUT, align_corners=False, half_pixel_centers=True),
    "nearest_corners": lambda h: tf.raw_ops.ResizeNearestNeighbor(
        images=h, size=OUT, align_corners=True, half_pixel_centers=False),
    "bilinear": lambda h: tf.image.resize(h, OUT, method="bilinear"),
    "bilinear_corners": lambda h: tf.raw_ops.ResizeBilinear(
        images=h, size=OUT, align_corners=True, half_pixel_centers=False),
    "bicubic": lambda h: tf.image.resize(h, OUT, method="bicubic"),
    "lanczos3": lambda h: tf.image.resize(h, OUT, method="lanczos3"),
    "bilinear_antialias": lambda h: tf.image.resize(h, (4, 3), antialias=True),
}


def _as_matrix(resize):
    """The resize as a matrix on the flattened pixels: its columns are the
    resized unit images (computed in float32, the op's own precision)."""
    basis = np.eye(H * W, dtype=np.float32).reshape(H * W, H, W, 1)
    columns = resize(tf.constant(basis)).numpy()
    out = columns.shape[1:3]
    matrix = tf.constant(columns.reshape(H * W, -1).T.astype(np.float64))

    def apply(h):
        flat = tf.reshape(tf.cast(h, tf.float64), [tf.shape(h)[0], H * W, h.shape[-1]])
        return tf.reshape(tf.einsum("pq,bqc->bpc", matrix, flat),
                          [tf.shape(h)[0], *out, h.shape[-1]])
    return apply


def _model(resize):
    keras.utils.set_random_seed(0)
    conv1 = keras.layers.Conv2D(3, 3, padding="same", dtype="float64")
    conv2 = keras.layers.Conv2D(2, 3, dtype="float64")
    head = keras.layers.Dense(3, dtype="float64")

    def logits(x, resize=resize):
        h = tf.tanh(conv1(x))
        h = tf.cast(resize(tf.cast(h, tf.float32)), tf.float64)  # the ops resize in float32
        return head(tf.reduce_mean(tf.tanh(conv2(h)), axis=[1, 2]))

    @kg.auto_register
    def loss_fn(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits(x)))

    rng = np.random.default_rng(0)
    args = (tf.constant(rng.normal(size=(3, H, W, 2))), tf.constant([0, 2, 1]))
    loss_fn(*args)
    return loss_fn, logits, args


@pytest.mark.parametrize("name", sorted(RESIZES))
def test_jacobian_vector_products_equal_the_matrix_resize(name):
    loss_fn, logits, args = _model(RESIZES[name])
    reg = loss_fn.registration(*args)
    rng = np.random.default_rng(1)
    u = [tf.constant(rng.normal(size=v.shape)) for v in reg.variables]
    got, _ = tf.function(lambda x, y: exact_fisher.jacobian_vector_products(
        reg, (x, y), [u]))(*args)
    # the same function with the resize as a matrix product (float64 throughout)
    matrix = _as_matrix(RESIZES[name])
    with tf.autodiff.ForwardAccumulator(list(reg.variables), u) as acc:
        z = logits(args[0], resize=matrix)
    want = acc.jvp(z).numpy()
    first = [np.zeros_like(t) if k >= 2 else t.numpy() for k, t in enumerate(u)]
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    # the first conv alone (its products all cross the resize) is not zero
    only_first, _ = tf.function(lambda x, y: exact_fisher.jacobian_vector_products(
        reg, (x, y), [[tf.constant(f) for f in first]]))(*args)
    assert np.abs(only_first[0]).max() > 1e-3


@pytest.mark.parametrize("name", ["nearest", "bilinear"])
def test_kfac_defaults_train_through_a_resize(name):
    loss_fn, _, args = _model(RESIZES[name])
    opt = kg.KFAC(loss_fn)
    losses = [float(opt.step(*args)) for _ in range(8)]
    assert losses[-1] < losses[0] and int(opt.skipped_steps) == 0, losses


def test_verify_checks_the_fisher_before_a_bilinear_upsampling():
    """Before: `fisher` failed with an infinite error (the reference's
    products were zero) on the layer before the resize."""
    loss_fn, _, args = _model(RESIZES["bilinear"])
    report = kg.verify(loss_fn, *args, estimation_mode="exact")
    assert not report.failures, report
    assert all(row.check("fisher").status == "pass" for row in report.rows), report


def test_a_product_through_an_op_not_differentiable_is_refused():
    """A fake-quantized activation (quantization-aware training): the
    backward pass's `FakeQuantWithMinMaxArgsGradient` is registered as not
    differentiable, so its products would be zero."""
    keras.utils.set_random_seed(0)
    dense, head = keras.layers.Dense(4), keras.layers.Dense(3)

    @kg.auto_register
    def loss_fn(x, y):
        h = tf.quantization.fake_quant_with_min_max_args(dense(x), min=-2.0, max=2.0)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, head(h)))

    args = (tf.constant(np.random.default_rng(0).normal(size=(4, 5)), tf.float32),
            tf.constant([0, 1, 2, 0]))
    reg = loss_fn.registration(*args)
    u = [tf.ones_like(v) for v in reg.variables]
    with pytest.raises(KfacGraphError, match="FakeQuantWithMinMaxArgsGradient.*not "
                       "differentiable.*momentum_type='regular'"):
        tf.function(lambda x, y: exact_fisher.jacobian_vector_products(
            reg, (x, y), [u]), autograph=False)(*args)
    opt = kg.KFAC(loss_fn, momentum_type="regular", learning_rate=0.05)
    assert np.isfinite(float(opt.step(*args)))
