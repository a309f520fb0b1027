"""Gradients for gradient ops TensorFlow cannot differentiate again.

The quadratic model's Jacobian-vector products (``optimizer/exact_fisher.py``)
differentiate a backward pass a second time. Two ops a backward pass writes
have no gradient of their own in TensorFlow ("No gradient defined for
operation ..."); ``differentiable()`` gives the ones made inside it one:

- ``XlaDynamicUpdateSlice``: inside an XLA context (``jit_compile=True``, or
  ``"auto"`` on an accelerator) the gradient of ``Slice`` (GPT-2 slices its
  position-embedding table) writes the cotangent into zeros at the slice's
  start. For ``y = x`` with ``u`` written at start ``i``:

      dx = dy with zeros in u's window at i,   du = dy's window at i,

  and none for ``i`` (an integer). Outside XLA the slice gradient is a
  ``Pad``, which TensorFlow differentiates itself.
- ``ResizeNearestNeighborGrad``: the gradient of a nearest-neighbour resize
  (``keras.layers.Resizing(interpolation="nearest")``, MobileNetV5's
  multi-scale fusion) sums each output pixel's cotangent into the input
  pixel it copies, a linear map ``R^T``; its own gradient is ``R``, the
  resize itself, to the cotangent's size with the same corner conventions.
  (TensorFlow registers the bilinear one's.)
- ``SparseSegment{Sum,Mean,SqrtN}Grad`` and their ``V2``: the gradient of a
  sparse segment reduction (``tf.nn.embedding_lookup_sparse``'s combiner)
  scatters each segment's cotangent, scaled by ``c_s`` (1, ``1/n_s``,
  ``1/sqrt(n_s)``), to the rows its ``indices`` name, a linear map ``S^T``
  whose own gradient is ``S``, the reduction itself: for ``dy`` on the
  scattered rows, the same reduction of ``dy`` by ``indices`` (V2 returns
  only the rows named, in sorted unique order: ``indices`` are first
  mapped to their places there).
"""
import contextlib

import tensorflow as tf
from tensorflow.compiler.tf2xla.ops import gen_xla_ops

SLICE = "KfacGraphXlaDynamicUpdateSlice"
RESIZE = "KfacGraphResizeNearestNeighborGrad"


_SEGMENT_REDUCTIONS = {"Sum": tf.sparse.segment_sum, "Mean": tf.sparse.segment_mean,
                       "SqrtN": tf.sparse.segment_sqrt_n}
SEGMENTS = {f"SparseSegment{kind}Grad{v}": f"KfacGraphSparseSegment{kind}Grad{v}"
            for kind in _SEGMENT_REDUCTIONS for v in ("", "V2")}


@contextlib.contextmanager
def differentiable():
    """Ops of the module docstring's types made in this block, in the
    default graph, get the gradients it states."""
    graph = tf.compat.v1.get_default_graph()
    with graph.gradient_override_map({"XlaDynamicUpdateSlice": SLICE,
                                      "ResizeNearestNeighborGrad": RESIZE, **SEGMENTS}):
        yield


@tf.RegisterGradient(SLICE)
def _dynamic_update_slice_gradient(op, dy):
    _, update, start = op.inputs
    window = tf.slice(dy, start, tf.shape(update, out_type=start.dtype))
    rest = gen_xla_ops.xla_dynamic_update_slice(dy, tf.zeros_like(update), start)
    return rest, window, None


@tf.RegisterGradient(RESIZE)
def _resize_nearest_grad_gradient(op, dy):
    grads = op.inputs[0]
    resized = tf.raw_ops.ResizeNearestNeighbor(
        images=dy, size=tf.shape(grads)[1:3], align_corners=op.get_attr("align_corners"),
        half_pixel_centers=op.get_attr("half_pixel_centers"))
    return tf.cast(resized, grads.dtype), None


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
