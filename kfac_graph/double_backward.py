"""Gradients for gradient ops TensorFlow cannot differentiate again.

The quadratic model's Jacobian-vector products (``optimizer/exact_fisher.py``)
differentiate a backward pass a second time. Some ops a backward pass writes
have no gradient of their own in TensorFlow ("No gradient defined for
operation ...", or, worse, one registered as not differentiable, whose
products are then silently zero); ``differentiable()`` gives the ones made
inside it one:

- ``XlaDynamicUpdateSlice``: inside an XLA context (``jit_compile=True``, or
  ``"auto"`` on an accelerator) the gradient of ``Slice`` (GPT-2 slices its
  position-embedding table) writes the cotangent into zeros at the slice's
  start. For ``y = x`` with ``u`` written at start ``i``:

      dx = dy with zeros in u's window at i,   du = dy's window at i,

  and none for ``i`` (an integer). Outside XLA the slice gradient is a
  ``Pad``, which TensorFlow differentiates itself.
- The gradients of the image resizes, ``Resize{NearestNeighbor,Bilinear,
  Bicubic}Grad`` and ``ScaleAndTranslateGrad`` (``keras.layers.Resizing``
  and ``UpSampling2D`` with any interpolation, ``tf.image.resize``'s lanczos
  and gaussian kernels; MobileNetV5's multi-scale fusion, a U-Net's or
  DeepLab's bilinear upsampling): each sums each output pixel's cotangent
  into the input pixels it was read from, with that pixel's weights, a
  linear map ``R^T``; its own gradient is ``R``, the resize itself, to the
  cotangent's size with the same corner conventions (and scale,
  translation and kernel). TensorFlow registers ``ResizeBilinearGrad`` as
  not differentiable, so a Jacobian-vector product through it was silently
  zero; the others raise "No gradient defined".
- ``SparseSegment{Sum,Mean,SqrtN}Grad`` and their ``V2``: the gradient of a
  sparse segment reduction (``tf.nn.embedding_lookup_sparse``'s combiner)
  scatters each segment's cotangent, scaled by ``c_s`` (1, ``1/n_s``,
  ``1/sqrt(n_s)``), to the rows its ``indices`` name, a linear map ``S^T``
  whose own gradient is ``S``, the reduction itself: for ``dy`` on the
  scattered rows, the same reduction of ``dy`` by ``indices`` (V2 returns
  only the rows named, in sorted unique order: ``indices`` are first
  mapped to their places there).
- ``LRNGrad`` (``tf.nn.local_response_normalization``, AlexNet's): with
  ``N = bias + alpha S(x^2)`` (``S``: the sum over the ``2r + 1`` channels
  around each, ``r = depth_radius``) and ``y = x N^-beta``, it computes
  ``J^T dy = dy N^-beta - 2 alpha beta x S(dy x N^(-beta-1))``; its
  gradient is that expression's, with respect to ``dy`` (``J u``) and to
  ``x``, taken on the expression written in differentiable ops (``y`` is a
  function of ``x``, so its own entry is None).
"""
import collections
import contextlib

import tensorflow as tf
from tensorflow.compiler.tf2xla.ops import gen_xla_ops
from tensorflow.python.framework import ops as tf_ops

from passes.errors import KfacGraphError

SLICE = "KfacGraphXlaDynamicUpdateSlice"
RESIZES = {f"Resize{kind}Grad": f"KfacGraphResize{kind}Grad"
           for kind in ("NearestNeighbor", "Bilinear", "Bicubic")}
RESIZES["ScaleAndTranslateGrad"] = "KfacGraphScaleAndTranslateGrad"


_SEGMENT_REDUCTIONS = {"Sum": tf.sparse.segment_sum, "Mean": tf.sparse.segment_mean,
                       "SqrtN": tf.sparse.segment_sqrt_n}
SEGMENTS = {f"SparseSegment{kind}Grad{v}": f"KfacGraphSparseSegment{kind}Grad{v}"
            for kind in _SEGMENT_REDUCTIONS for v in ("", "V2")}
LRN = "KfacGraphLRNGrad"


@contextlib.contextmanager
def differentiable():
    """Ops of the module docstring's types made in this block, in the
    default graph, get the gradients it states."""
    graph = tf.compat.v1.get_default_graph()
    with graph.gradient_override_map({"XlaDynamicUpdateSlice": SLICE, **RESIZES,
                                      **SEGMENTS, "LRNGrad": LRN}):
        yield


# registered as not differentiable, but their outputs do not depend on their
# inputs' values (or stop the gradient on purpose)
_VALUE_FREE = frozenset({"Shape", "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike",
                         "StopGradient", "BroadcastGradientArgs", "ConcatOffset"})


def pullback(z, w, variables):
    """``r(w) = J^T w`` (``J = dz/dtheta``): one backward pass from ``z``
    with cotangent ``w``, a list aligned with ``variables`` (None where a
    variable does not reach ``z``), inside ``differentiable()`` so that
    ``jacobian_products`` can differentiate it again with respect to
    ``w``. ``w`` may be any tensor of ``z``'s shape that the backward pass
    alone reads: zeros, or the loss's own ``dL/dz``, whose pullback is
    the loss's gradient along the paths through ``z``."""
    with differentiable():
        return tf.gradients(z, list(variables), grad_ys=w)


def jacobian_products(z, w, variables, vectors, pulled=None):
    """``[J u for u in vectors]`` (each ``u`` a list aligned with
    ``variables``; ``J = dz/dtheta``): ``r(w) = J^T w`` by one backward
    pass from ``z`` with cotangent ``w`` (``pullback``; ``pulled``: that
    pass already taken with this ``w``), then ``J u = d(r . u)/dw``, a
    second backward pass through the first (``r`` is linear in ``w``, so
    ``J u`` does not depend on ``w``'s value). An embedding's ``J^T w``
    (IndexedSlices, which ``tf.gradients`` cannot take as ``ys``) is made
    dense. Raises ``KfacGraphError`` where the first pass wrote an op
    TensorFlow registers as not differentiable whose output depends on
    ``w`` (its products would be silently zero)."""
    r = pullback(z, w, variables) if pulled is None else pulled
    pairs = [(k, tf.convert_to_tensor(g)) for k, g in enumerate(r) if g is not None]
    _check_differentiable(w, [g for _, g in pairs])
    out = []
    for u in vectors:
        jv = None
        if pairs:
            jv = tf.gradients([g for _, g in pairs], w,
                              grad_ys=[tf.cast(u[k], g.dtype) for k, g in pairs])[0]
        out.append(tf.zeros_like(z) if jv is None else jv)
    return out


def _check_differentiable(source, results):
    """Raises on an op between ``source`` and ``results`` with a float output
    that TensorFlow's gradient registry marks as not differentiable."""
    after, queue = set(), collections.deque([source.op])
    while queue:
        op = queue.popleft()
        for out in op.outputs:
            for consumer in out.consumers():
                if consumer not in after:
                    after.add(consumer)
                    queue.append(consumer)
    before, queue = set(), collections.deque(t.op for t in results)
    while queue:
        op = queue.popleft()
        if op in before or op not in after:
            continue
        before.add(op)
        queue.extend(t.op for t in op.inputs)
        try:
            kind = op.get_attr("_gradient_op_type").decode()
        except ValueError:
            kind = op.type
        if kind in _VALUE_FREE or not any(t.dtype.is_floating for t in op.outputs):
            continue
        try:
            if tf_ops._gradient_registry.lookup(kind) is not None:
                continue
        except LookupError:  # none registered: tf.gradients says so itself
            continue
        raise KfacGraphError(
            f"op {op.name!r} ({op.type}) of the backward pass has no gradient in TensorFlow "
            "(registered as not differentiable): the Jacobian-vector products of the "
            "quadratic model and of the exact Fisher's checks through it would be zero; "
            "use momentum_type='regular' or 'adam'")


@tf.RegisterGradient(SLICE)
def _dynamic_update_slice_gradient(op, dy):
    _, update, start = op.inputs
    window = tf.slice(dy, start, tf.shape(update, out_type=start.dtype))
    rest = gen_xla_ops.xla_dynamic_update_slice(dy, tf.zeros_like(update), start)
    return rest, window, None


def _resize_grad_gradient(resize):
    def gradient(op, dy):
        grads = op.inputs[0]
        resized = resize(images=dy, size=tf.shape(grads)[1:3],
                         align_corners=op.get_attr("align_corners"),
                         half_pixel_centers=op.get_attr("half_pixel_centers"))
        return tf.cast(resized, grads.dtype), None
    return gradient


for _kind in ("NearestNeighbor", "Bilinear", "Bicubic"):
    tf.RegisterGradient(RESIZES[f"Resize{_kind}Grad"])(
        _resize_grad_gradient(getattr(tf.raw_ops, f"Resize{_kind}")))


@tf.RegisterGradient(RESIZES["ScaleAndTranslateGrad"])
def _scale_and_translate_grad_gradient(op, dy):
    grads, _, scale, translation = op.inputs
    resized = tf.raw_ops.ScaleAndTranslate(
        images=dy, size=tf.shape(grads)[1:3], scale=scale, translation=translation,
        kernel_type=op.get_attr("kernel_type"), antialias=op.get_attr("antialias"))
    return tf.cast(resized, grads.dtype), None, None, None


def _segment_grad_gradient(reduce, v2):
    def gradient(op, dy, *_):
        grad, indices, segment_ids = op.inputs[:3]
        if v2:  # dy holds the rows of sorted unique indices (op.outputs[1]) only
            indices = tf.searchsorted(op.outputs[1], indices)
        back = reduce(dy, indices, segment_ids, num_segments=tf.shape(grad)[0])
        return (back,) + (None,) * (len(op.inputs) - 1)
    return gradient


for _kind, _reduce in _SEGMENT_REDUCTIONS.items():
    for _v in ("", "V2"):
        tf.RegisterGradient(SEGMENTS[f"SparseSegment{_kind}Grad{_v}"])(
            _segment_grad_gradient(_reduce, bool(_v)))


def _channel_window_sum(z, radius: int):
    """``S(z)``: each channel's sum over the channels within ``radius`` of it
    (zeros beyond the edges), on the last axis."""
    rank, channels = z.shape.rank, tf.shape(z)[-1]
    padded = tf.pad(z, [[0, 0]] * (rank - 1) + [[radius, radius]])
    return tf.add_n([padded[..., k:k + channels] for k in range(2 * radius + 1)])


@tf.RegisterGradient(LRN)
def _lrn_grad_gradient(op, ddx):
    dy, x = op.inputs[0], op.inputs[1]
    radius = op.get_attr("depth_radius")
    bias, alpha, beta = (tf.cast(op.get_attr(k), x.dtype) for k in ("bias", "alpha", "beta"))
    with tf.GradientTape() as tape:  # (records only the ops written here)
        tape.watch([dy, x])
        n = bias + alpha * _channel_window_sum(x * x, radius)
        dx = dy * n ** -beta - 2 * alpha * beta * x * _channel_window_sum(
            dy * x * n ** (-beta - 1), radius)
    d_dy, d_x = tape.gradient(dx, [dy, x], output_gradients=ddx)
    return d_dy, d_x, None
