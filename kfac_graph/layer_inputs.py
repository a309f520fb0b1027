"""What a layer's rules read at one use: its input ``a`` as the op sees it.

The pass records, per use, the tensors a layer reads and how to turn them
into the rule's input:

- dense, conv2d, depthwise_conv2d: the op's input, reshaped to the op's
  static input shape (Conv1D's ExpandDims is a unit axis the pass saw
  through);
- embedding: the ids;
- scale_and_shift: the normalised input ``xhat`` such that the layer
  computes ``xhat * scale + shift``, by the use's ``normalizer``:
  ``identity`` (``xhat = x``), ``center_scale`` (``(x - mean) * inv_std``,
  Keras's batch and layer normalisation), ``fused_inference``
  (``(x - mean) * rsqrt(var + eps)``) and ``fused_training`` (the batch
  variance FusedBatchNorm outputs is Bessel-corrected: multiply it back by
  ``(n - 1) / n``).

Output gradients are reshaped to the op's static output shape likewise. For
a vector scale or shift of an ``NC...`` op both are moved to channels-last.
"""
from __future__ import annotations

import tensorflow as tf

from kfac_graph.layer_taps import reshape_like
from kfac_graph.registration import Layer


def layer_input(layer: Layer, use: int, tensors) -> tf.Tensor:
    """The rule input of ``layer``'s ``use``-th application, from the tensors
    ``LayerTaps.inputs`` holds for it."""
    attrs = layer.use_attrs[use]
    if layer.kind in ("dense", "conv2d", "depthwise_conv2d"):
        return reshape_like(tensors[0], attrs.get("input_shape"))
    if layer.kind == "embedding":
        return tensors[0]
    if layer.kind == "scale_and_shift":
        return _channels_last(layer, use, _normalised(attrs, tensors))
    raise ValueError(f"layer {layer.name!r} of kind {layer.kind!r} has no rule input")


def layer_output_gradient(layer: Layer, use: int, gradient: tf.Tensor) -> tf.Tensor:
    """The gradient at the use's output, shaped as the op's output."""
    attrs = layer.use_attrs[use]
    if layer.kind in ("conv2d", "depthwise_conv2d"):
        return reshape_like(gradient, attrs.get("output_shape"))
    if layer.kind == "dense" and attrs.get("input_shape"):
        # The same positions as the input: [..., d_in] -> [..., d_out].
        return reshape_like(gradient, (*attrs["input_shape"][:-1], gradient.shape[-1]))
    if layer.kind == "scale_and_shift":
        return _channels_last(layer, use, gradient)
    return gradient


def _channels_last(layer: Layer, use: int, tensor: tf.Tensor) -> tf.Tensor:
    """A ``[C]`` scale or shift of an ``NC...`` op (BiasAdd, FusedBatchNorm
    in NCHW) broadcasts along axis 1: move that axis last, where the rules
    and blocks broadcast a vector."""
    fmt = layer.use_attrs[use].get("data_format", "NHWC")
    rank = tensor.shape.rank
    if fmt.startswith("NC") and rank and rank >= 3 and len(layer.variables[0].shape) == 1:
        return tf.transpose(tensor, [0, *range(2, rank), 1])
    return tensor


def _normalised(attrs, tensors) -> tf.Tensor:
    normalizer = attrs.get("normalizer", "identity")
    if normalizer == "identity":
        return tensors[0]
    x = tensors[0]
    if normalizer == "center_scale":
        mean, inv_std = (tf.cast(t, x.dtype) for t in tensors[1:3])
        return (x - mean) * inv_std
    fmt = attrs.get("data_format", "NHWC")
    channel_shape = [1, -1, 1, 1] if fmt.startswith("NC") else [1, 1, 1, -1]
    mean, var = (tf.reshape(tf.cast(t, x.dtype), channel_shape) for t in tensors[1:3])
    if normalizer == "fused_training":
        axes = [0, 2, 3] if fmt.startswith("NC") else [0, 1, 2]
        n = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
        var = var * (n - 1) / tf.maximum(n, 1)
    elif normalizer != "fused_inference":
        raise ValueError(f"unknown normalizer {normalizer!r}")
    return (x - mean) * tf.math.rsqrt(var + tf.cast(attrs.get("epsilon", 1e-3), x.dtype))
