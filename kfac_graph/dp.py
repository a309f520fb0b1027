"""Differentially private SGD: per-example clipping and Gaussian noise.

The privatised gradient, as TensorFlow Privacy defines it for a mean loss:

    g~ = (sum_i g_i * min(1, C / ||g_i||) + N(0, (sigma C)^2 I)) / B

with ``C = l2_norm_clip``, ``sigma = noise_multiplier`` and ``g_i`` example
i's own gradient (``kg.per_example_gradients``). For a sum loss the division
by ``B`` is left out. Two ways to compute it, chosen by ``method``:

- ``"reweight"``: the per-example norms without materialising the gradients
  (the rules' Gram and ``||a|| ||g||`` forms), then one more backward pass of
  ``sum_i w_i l_i`` with the clipping weights ``w_i`` held constant. Memory
  stays that of a batch gradient.
- ``"materialize"``: build the ``[B, ...]`` per-example gradients, clip and
  sum them.

``"auto"`` reweights unless the loss has a generic layer (whose norms need
the materialised Jacobian anyway), then materialises.
"""
from __future__ import annotations

import tensorflow as tf

from kfac_graph import options
from kfac_graph import per_example as pe
from kfac_graph.auto_register import RegisteredFunction, auto_register
from kfac_graph.taps import LayerTaps
from kfac_graph.per_example.gradients import per_layer_results
from kfac_graph.registration import Registration

_METHODS = ("auto", "reweight", "materialize")
# what each option takes (kfac_graph/options.py); a tensor passes unchecked
OPTIONS = {"learning_rate": options.Real(0.0, low_open=True, dynamic=True),
           "l2_norm_clip": options.Real(0.0, low_open=True, dynamic=True),
           "noise_multiplier": options.Real(0.0, dynamic=True),
           "method": options.OneOf(_METHODS), "seed": options.Integer()}


def dp_gradients(fn, *args, l2_norm_clip: float, noise_multiplier: float, seed=(0, 0),
                 method: str = "auto") -> list[tf.Tensor]:
    """Clipped-and-noised gradients aligned with the registration's variables.
    ``seed``: a stateless seed (two integers); the same seed gives the same
    noise."""
    options.check_all("kg.dp_gradients", OPTIONS, dict(
        l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier, method=method))
    fn = fn if isinstance(fn, RegisteredFunction) else auto_register(fn)
    reg = fn.registration(*args)
    if reg.per_example_loss is None:
        raise ValueError(f"{fn.__name__}: the pass did not find the per-example loss terms, "
                         "so examples cannot be clipped one by one")
    if method == "auto":
        method = "materialize" if any(l.kind == "generic" for l in reg.layers) else "reweight"
    run = _compiled(fn, reg, method)
    return list(run(tf.cast(l2_norm_clip, tf.float32), tf.cast(noise_multiplier, tf.float32),
                    tf.convert_to_tensor(seed, tf.int32), *args))


class DPSGD:
    """SGD on the privatised gradient: ``v <- v - learning_rate * g~``.

    ``step(*args)`` runs one compiled step and returns the (non-private)
    batch loss; the noise seed advances each step from ``seed``."""

    def __init__(self, fn, learning_rate: float, l2_norm_clip: float, noise_multiplier: float,
                 seed: int = 0, method: str = "auto"):
        options.check_all("kg.DPSGD", OPTIONS, dict(
            learning_rate=learning_rate, l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier, seed=seed, method=method))
        self.fn = fn if isinstance(fn, RegisteredFunction) else auto_register(fn)
        self.learning_rate = learning_rate
        self.l2_norm_clip = l2_norm_clip
        self.noise_multiplier = noise_multiplier
        self.method = method
        self.seed = int(seed)
        self.iterations = tf.Variable(0, dtype=tf.int64, trainable=False, name="dpsgd_step")
        # autograph=False: nothing here branches on tensors, and autograph would
        # convert every function the step calls, the pass included (~20 s, once)
        self._step = tf.function(self._step_impl, autograph=False)

    def step(self, *args):
        self.fn.registration(*args)  # the pass runs eagerly, never under autograph
        return self._step(*args)

    def _step_impl(self, *args):
        reg = self.fn.registration(*args)
        loss = self.fn.tf_function(*args)
        seed = tf.stack([tf.constant(self.seed, tf.int64), self.iterations])
        grads = dp_gradients(self.fn, *args, l2_norm_clip=self.l2_norm_clip,
                             noise_multiplier=self.noise_multiplier,
                             seed=tf.cast(seed, tf.int32), method=self.method)
        for v, g in zip(reg.variables, grads):
            v.assign_sub(tf.cast(self.learning_rate, v.dtype) * tf.cast(g, v.dtype))
        self.iterations.assign_add(1)
        return loss


def _compiled(fn: RegisteredFunction, reg: Registration, method: str):
    key = ("dp", method, id(reg))
    if key in fn.derived:
        return fn.derived[key]
    registry = pe.default_registry()
    variables = list(reg.variables)
    generic = reg.generic_variables

    @tf.function(autograph=False)  # (no tensor-dependent Python control flow)
    def run(clip, noise, seed, *args):
        reads = variables if method == "reweight" else generic
        taps = LayerTaps.build(reg, args, read_variables=reads)
        batch = taps.batch_size
        if method == "reweight":
            sq = tf.add_n(per_layer_results(reg, taps, registry, "norms"))
            weights = _clip_weights(sq, clip)
            terms = taps.per_example_loss
            summed = tf.gradients(tf.reduce_sum(tf.stop_gradient(tf.cast(weights, terms.dtype))
                                                * terms), [taps.variable_reads[v.ref()]
                                                           for v in variables])
            summed = [tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g)
                      for g, v in zip(summed, variables)]
        else:
            grads = [g for layer in per_layer_results(reg, taps, registry, "grads") for g in layer]
            sq = tf.add_n([tf.reduce_sum(tf.square(tf.reshape(g, [batch, -1])), 1) for g in grads])
            weights = _clip_weights(sq, clip)
            summed = [tf.tensordot(tf.cast(weights, g.dtype), g, axes=1) for g in grads]
        out = []
        for k, g in enumerate(summed):
            z = tf.random.stateless_normal(tf.shape(g), seed=seed + [0, 1 + k], dtype=g.dtype,
                                           alg="philox")  # the same numbers under XLA
            g = g + tf.cast(noise * clip, g.dtype) * z
            if reg.loss.reduction == "mean":
                g = g / tf.cast(batch, g.dtype)
            out.append(g)
        return out

    fn.derived[key] = run
    return run


def _clip_weights(squared_norms, clip):
    """``min(1, C / ||g_i||)``; an example with a zero gradient keeps weight 1."""
    norms = tf.sqrt(tf.cast(squared_norms, tf.float32))
    return tf.minimum(1.0, clip / tf.maximum(norms, 1e-12))
