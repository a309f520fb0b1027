"""Differentially private SGD: per-example clipping and Gaussian noise.

The privatised gradient, as TensorFlow Privacy defines it for a mean loss
with flat clipping:

    g~ = (sum_i g_i * min(1, C / ||g_i||) + N(0, (sigma C)^2 I)) / B

with ``C = l2_norm_clip``, ``sigma = noise_multiplier`` and ``g_i`` example
i's own gradient (``kg.per_example_gradients``). For a sum loss the division
by ``B`` is left out. Options (``kfac_graph/privacy``):

- ``clipping``: ``"flat"``, ``"per_layer"`` or named groups of layers, each
  with its threshold; ``automatic_clipping`` normalises instead of clipping
  (Bu et al. 2022); the noise follows the sensitivity ``sqrt(sum_k C_k^2)``
  (``privacy/clipping.py``).
- ``mask`` and ``expected_batch_size``: for padded Poisson batches
  (``kg.privacy.poisson_batches``) a padded example contributes nothing and
  the mean divides by the expected batch size, not the drawn one
  (``privacy/sampling.py``).
- the noise: Philox keyed from OS entropy unless a seed is given;
  ``secure_mode`` refuses seeds (``privacy/noise.py``).

``method``: ``"reweight"`` (norms without materialising the gradients, then a
backward pass of the reweighted loss terms: memory of a batch gradient),
``"materialize"`` (the ``[B, ...]`` per-example gradients, clipped and
summed), or ``"auto"``: reweight unless the loss has a generic layer (whose
norms need the materialised Jacobian anyway).
"""
from __future__ import annotations

import tensorflow as tf

from kfac_graph import options
from kfac_graph.auto_register import RegisteredFunction, auto_register
from kfac_graph.privacy import accounting
from kfac_graph.privacy import clipping as clip_lib
from kfac_graph.privacy import gradients as grad_lib
from kfac_graph.privacy import noise as noise_lib

_METHODS = ("auto", "reweight", "materialize")
# what each option takes (kfac_graph/options.py); a tensor passes unchecked
OPTIONS = {"learning_rate": options.Real(0.0, low_open=True, dynamic=True),
           "noise_multiplier": options.Real(0.0, dynamic=True),
           "method": options.OneOf(_METHODS), "seed": options.Integer(),
           "expected_batch_size": options.Real(0.0, low_open=True, none=True)}
_CLIP = options.Real(0.0, low_open=True, dynamic=True)


def _check_clip(owner, clipping, l2_norm_clip):
    if isinstance(clipping, str) and clipping == "flat":
        options.check(owner, "l2_norm_clip", l2_norm_clip, _CLIP)


def _registered(fn, args):
    fn = fn if isinstance(fn, RegisteredFunction) else auto_register(fn)
    reg = fn.registration(*args)
    if reg.per_example_loss is None:
        raise ValueError(f"{fn.__name__}: the pass did not find the per-example loss terms, "
                         "so examples cannot be clipped one by one")
    return fn, reg


def dp_gradients(fn, *args, l2_norm_clip, noise_multiplier: float, seed=None,
                 method: str = "auto", clipping="flat", automatic_clipping: bool = False,
                 mask=None, expected_batch_size: float | None = None) -> list[tf.Tensor]:
    """Clipped-and-noised gradients aligned with the registration's variables.

    ``seed``: a stateless key (two integers, or a ``[2]`` tensor such as
    ``NoiseSource.next_key()``); the same key gives the same noise. ``None``
    (the default) draws a fresh key from the OS (``privacy/noise.py``).
    ``mask``: ``[B]``, 1 for real examples and 0 for padding; with a mask,
    a mean loss needs ``expected_batch_size`` (Poisson sampling's ``qN``)."""
    return privatize(fn, *args, l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier,
                     seed=seed, method=method, clipping=clipping,
                     automatic_clipping=automatic_clipping, mask=mask,
                     expected_batch_size=expected_batch_size, owner="kg.dp_gradients")[1]


def privatize(fn, *args, l2_norm_clip, noise_multiplier, seed=None, method="auto",
              clipping="flat", automatic_clipping=False, mask=None, expected_batch_size=None,
              owner="kg.dp_gradients"):
    """``(batch loss, dp_gradients(...))`` from one forward pass: the loss is
    the non-private batch loss at the current weights."""
    options.check_all(owner, OPTIONS, dict(
        noise_multiplier=noise_multiplier, method=method,
        expected_batch_size=expected_batch_size))
    _check_clip(owner, clipping, l2_norm_clip)
    fn, reg = _registered(fn, args)
    plan = clip_lib.plan(reg, clipping, l2_norm_clip, automatic_clipping)
    if mask is not None and expected_batch_size is None and reg.loss.reduction == "mean":
        raise ValueError(f"{owner}: with a mask (padded Poisson batches) give "
                         "expected_batch_size, the sampling rate times the data set size: "
                         "the mean must not divide by the drawn batch size")
    if method == "auto":
        method = "materialize" if any(l.kind == "generic" for l in reg.layers) else "reweight"
    key = noise_lib.fresh_key() if seed is None else tf.convert_to_tensor(seed, tf.int32)
    run = grad_lib.compiled(fn, reg, method, plan, mask is not None)
    mask = tf.zeros([0]) if mask is None else tf.convert_to_tensor(mask, tf.float32)
    loss, grads = run(plan.threshold_vector(), _as_float64(noise_multiplier), key,
                      tf.constant(expected_batch_size or 0.0, tf.float64), mask, *args)
    return loss, list(grads)


class DPSGD:
    """SGD on the privatised gradient: ``v <- v - learning_rate * g~``.

    ``step(*args, mask=None)`` runs one compiled step and returns the
    (non-private) batch loss. The noise comes from a ``NoiseSource``: OS
    entropy unless ``seed`` is given (``secure_mode=True`` refuses a seed).

    Accounting: give the sampler, either ``sampling=dataset.privacy_sampling``
    (from ``kg.privacy.poisson_batches`` / ``fixed_size_batches``) or
    ``sample_rate`` / ``num_examples`` and ``batch_size`` with
    ``sampling="poisson"`` or ``"fixed"``; then ``epsilon(delta)`` is the
    epsilon of the steps taken so far and ``privacy_statement(delta)`` says
    it in words. Under Poisson sampling with ``num_examples`` known, the mean
    divides by the expected batch size ``qN``."""

    def __init__(self, fn, learning_rate: float, l2_norm_clip, noise_multiplier: float,
                 seed: int | None = None, method: str = "auto", *, clipping="flat",
                 automatic_clipping: bool = False, secure_mode: bool = False,
                 sampling=None, sample_rate: float | None = None,
                 num_examples: int | None = None, batch_size: float | None = None):
        options.check_all("kg.DPSGD", OPTIONS, dict(
            learning_rate=learning_rate, noise_multiplier=noise_multiplier, method=method,
            **({} if seed is None else {"seed": seed})))
        _check_clip("kg.DPSGD", clipping, l2_norm_clip)
        self.fn = fn if isinstance(fn, RegisteredFunction) else auto_register(fn)
        self.learning_rate = learning_rate
        self.l2_norm_clip = l2_norm_clip
        self.noise_multiplier = noise_multiplier
        self.method = method
        self.clipping = clipping
        self.automatic_clipping = automatic_clipping
        self.noise = noise_lib.NoiseSource(seed, secure_mode)
        self.sampling = _sampling(sampling, sample_rate, num_examples, batch_size)
        self._accountant = None
        self.iterations = tf.Variable(0, dtype=tf.int64, trainable=False, name="dpsgd_step")
        # autograph=False: nothing here branches on tensors, and autograph would
        # convert every function the step calls, the pass included (~20 s, once)
        self._step = tf.function(self._step_impl, autograph=False)

    def step(self, *args, mask=None):
        self.fn.registration(*args)  # the pass runs eagerly, never under autograph
        if mask is None:
            return self._step(*args)
        return self._step(*args, mask=mask)

    def _step_impl(self, *args, mask=None):
        reg = self.fn.registration(*args)
        expected = None
        if self.sampling is not None and self.sampling.kind == "poisson":
            expected = self.sampling.batch_size
        loss, grads = privatize(self.fn, *args, l2_norm_clip=self.l2_norm_clip,
                                noise_multiplier=self.noise_multiplier,
                                seed=self.noise.next_key(), method=self.method,
                                clipping=self.clipping,
                                automatic_clipping=self.automatic_clipping, mask=mask,
                                expected_batch_size=expected, owner="kg.DPSGD")
        for v, g in zip(reg.variables, grads):
            v.assign_sub(tf.cast(self.learning_rate, v.dtype) * tf.cast(g, v.dtype))
        self.iterations.assign_add(1)
        return loss

    def epsilon(self, delta: float, accountant: str = "rdp") -> float:
        """Epsilon at ``delta`` for the ``iterations`` steps taken so far."""
        if self.sampling is None:
            raise ValueError("DPSGD.epsilon needs the sampler: DPSGD(..., sampling="
                             "dataset.privacy_sampling) or sample_rate= / num_examples= and "
                             "batch_size=")
        if not isinstance(self.noise_multiplier, (int, float)):
            raise ValueError("DPSGD.epsilon needs a fixed numeric noise_multiplier")
        if self._accountant is None:
            self._accountant = accounting.StepAccountant(self.noise_multiplier, self.sampling)
        return self._accountant.epsilon(int(self.iterations), delta, accountant)

    def privacy_statement(self, delta: float) -> str:
        """``kg.privacy.statement`` for the steps taken so far."""
        self.epsilon(delta)  # the same checks
        s = self.sampling
        return accounting.statement(self.noise_multiplier, delta, steps=int(self.iterations),
                                    sample_rate=s.rate, num_examples=s.num_examples,
                                    batch_size=s.batch_size, sampling=s.kind)


def _sampling(sampling, sample_rate, num_examples, batch_size):
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


def _as_float64(value):
    """A float64 scalar (``tf.cast`` would round a Python float to float32 first)."""
    if tf.is_tensor(value) or isinstance(value, tf.Variable):
        return tf.cast(value, tf.float64)
    return tf.constant(value, tf.float64)
