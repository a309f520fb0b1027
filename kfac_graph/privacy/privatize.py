"""Checked entry to the privatised gradient (``gradients.py``) for the
public façades (``kg.dp_gradients``, ``kg.DPSGD``, ``kg.DPModel``): the
options, the clipping plan, the noise key, the call, and the sampler a
façade was told about."""
from __future__ import annotations

import tensorflow as tf

from kfac_graph import options
from kfac_graph.auto_register import RegisteredFunction, auto_register
from kfac_graph.normaliser_coupling import coupling_layers
from kfac_graph.privacy import accounting
from kfac_graph.privacy import clipping as clip_lib
from kfac_graph.privacy import gradients as grad_lib
from kfac_graph.privacy import noise as noise_lib
from passes.errors import KfacGraphError

_METHODS = ("auto", "reweight", "materialize")
# what each option takes (kfac_graph/options.py); a tensor passes unchecked
OPTIONS = {"learning_rate": options.Real(0.0, low_open=True, dynamic=True),
           "noise_multiplier": options.Real(0.0, dynamic=True),
           "method": options.OneOf(_METHODS), "seed": options.Integer(),
           "expected_batch_size": options.Real(0.0, low_open=True, none=True)}
_CLIP = options.Real(0.0, low_open=True, dynamic=True)


def check_clip(owner, clipping, l2_norm_clip):
    if isinstance(clipping, str) and clipping == "flat":
        options.check(owner, "l2_norm_clip", l2_norm_clip, _CLIP)


def registered(fn, args):
    fn = fn if isinstance(fn, RegisteredFunction) else auto_register(fn)
    reg = fn.registration(*args)
    if reg.per_example_loss is None:
        raise ValueError(f"{fn.__name__}: the pass did not find the per-example loss terms, "
                         "so examples cannot be clipped one by one")
    return fn, reg


def privatize(fn, *args, l2_norm_clip, noise_multiplier, seed=None, method="auto",
              clipping="flat", automatic_clipping=False, mask=None, expected_batch_size=None,
              owner="kg.dp_gradients", share=1.0, batch_total=None):
    """``(batch loss, dp_gradients(...))`` from one forward pass: the loss is
    the non-private batch loss at the current weights. On one of R replicas
    (``kg.DPModel`` under ``tf.distribute``): ``share = 1 / R`` of the noise
    (the same key on every replica) and of a penalty's gradient, and a mean
    divided by ``batch_total``, the examples of all replicas (without
    ``expected_batch_size``); the replicas' gradients then sum to one
    device's (``gradients.compiled``)."""
    options.check_all(owner, OPTIONS, dict(
        noise_multiplier=noise_multiplier, method=method,
        expected_batch_size=expected_batch_size))
    check_clip(owner, clipping, l2_norm_clip)
    fn, reg = registered(fn, args)
    coupling = reg.coupling or coupling_layers(reg)
    if coupling:
        raise KfacGraphError(
            f"{owner}: the loss couples the examples at op {coupling[0]!r} (batch "
            "statistics such as batch normalisation in training mode, two tensors of "
            "examples combined, as a contrastive loss's a @ b^T, the batch reordered or "
            "mixed, as in-batch mixup, or a custom gradient whose function reads across the "
            "examples, as tf.clip_by_norm over the batch): clipping each example's share "
            "does not bound its influence on the update, so the noise gives no differential "
            "privacy; use per-example normalisation (LayerNormalization, GroupNormalization) "
            "or batch normalisation in inference mode")
    if reg.batch_statistics:
        raise KfacGraphError(
            f"{owner}: the loss scales each example's term by a statistic of the whole batch's "
            f"data at op {reg.batch_statistics[0]!r} (a masked mean's sum(mask) over the batch, "
            "Keras's ignore_class or a masked loss): removing one example changes every other "
            "example's term, which clipping does not bound, so the noise gives no differential "
            "privacy; divide by a constant (the expected number of tokens in a batch) or by "
            "each example's own count (sum(mask, axis=1)), or use a Keras loss with "
            "reduction='sum'")
    if reg.padded_to_longest:
        raise KfacGraphError(
            f"{owner}: op {reg.padded_to_longest[0]!r} pads each example to the batch's "
            "longest (TextVectorization without output_sequence_length, or a ragged "
            "to_tensor() without a shape): an example's term can then depend on the other "
            "examples' lengths, which clipping does not bound, so the noise gives no "
            "differential privacy; give every example one fixed length "
            "(output_sequence_length=..., to_tensor(shape=[None, length]))")
    plan = clip_lib.plan(reg, clipping, l2_norm_clip, automatic_clipping)
    if mask is not None and expected_batch_size is None and reg.loss.reduction == "mean":
        raise ValueError(f"{owner}: with a mask (padded Poisson batches) give "
                         "expected_batch_size, the sampling rate times the data set size: "
                         "the mean must not divide by the drawn batch size")
    if method == "auto":
        generic = any(layer.kind == "generic" for layer in reg.layers)
        method = "materialize" if generic else "reweight"
    key = noise_lib.fresh_key() if seed is None else tf.cast(seed, tf.int64)
    run = grad_lib.compiled(fn, reg, method, plan, mask is not None)
    mask = tf.zeros([0]) if mask is None else tf.cast(tf.convert_to_tensor(mask), tf.float32)
    denominator = expected_batch_size if expected_batch_size is not None else batch_total
    loss, grads = run(plan.threshold_vector(), as_float64(noise_multiplier), key,
                      as_float64(0.0 if denominator is None else denominator),
                      as_float64(share), mask, *args)
    return loss, list(grads)


def sampling_from(sampling, sample_rate, num_examples, batch_size):
    """An ``accounting.Sampling`` or None (nothing said about the sampler)."""
    if isinstance(sampling, accounting.Sampling):
        return sampling
    if sample_rate is None and num_examples is None and batch_size is None:
        if sampling not in (None, "poisson", "fixed"):
            raise ValueError(f"sampling must be 'poisson', 'fixed' or a "
                             f"kg.privacy.Sampling, got {sampling!r}")
        return None
    return accounting.Sampling.make(sampling or "poisson", sample_rate, num_examples,
                                    batch_size)


def as_float64(value):
    """A float64 scalar (``tf.cast`` would round a Python float to float32 first)."""
    if tf.is_tensor(value) or isinstance(value, tf.Variable):
        return tf.cast(value, tf.float64)
    return tf.constant(value, tf.float64)
