"""Differentially private SGD: per-example clipping and Gaussian noise.

The privatised gradient, as TensorFlow Privacy defines it for a mean loss
with flat clipping:

    g~ = (sum_i g_i * min(1, C / ||g_i||) + N(0, (sigma C)^2 I)) / B

with ``C = l2_norm_clip``, ``sigma = noise_multiplier`` and ``g_i`` example
i's own gradient (``kg.per_example_gradients``, less any weight penalty's).
For a sum loss the division by ``B`` is left out. A weight penalty ``R`` in
the loss (Keras's ``kernel_regularizer``) reads no example: ``dR`` is added
to ``g~`` unclipped and without noise. Options (``kfac_graph/privacy``):

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

from kfac_graph import options, relaxed_shapes
from kfac_graph.auto_register import RegisteredFunction, auto_register
from kfac_graph.privacy.ledger import Ledger, TracedOption, new_noise
from kfac_graph.privacy import noise as noise_lib
from kfac_graph.privacy.privatize import OPTIONS, check_clip, privatize, sampling_from

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
        check_clip("kg.DPSGD", clipping, l2_norm_clip)
        self.fn = fn if isinstance(fn, RegisteredFunction) else auto_register(fn)
        self.method = method
        self.clipping = clipping
        self.automatic_clipping = automatic_clipping
        self.noise = noise_lib.NoiseSource(seed, secure_mode)
        self.sampling = sampling_from(sampling, sample_rate, num_examples, batch_size)
        self._ledger = Ledger()
        self.iterations = tf.Variable(0, dtype=tf.int64, trainable=False, name="dpsgd_step")
        self.learning_rate = learning_rate
        self.l2_norm_clip = l2_norm_clip
        self.noise_multiplier = noise_multiplier

    # read by the compiled step when traced: setting one traces it anew
    learning_rate = TracedOption()
    l2_norm_clip = TracedOption(lambda self, value: check_clip("kg.DPSGD", self.clipping, value))
    noise_multiplier = TracedOption(new_noise)  # (a new one ends a phase of the ledger)

    def _steps(self) -> int:
        return int(self.iterations.numpy())

    def step(self, *args, mask=None):
        if self._step_function is None:
            self.fn.registration(*args)  # the pass runs eagerly, never under autograph
            # autograph=False: nothing here branches on tensors, and autograph would
            # convert every function the step calls, the pass included (~20 s, once);
            # batches of new shapes: one more trace, with the sizes that changed unknown
            # (per-example gradients are exact there; nothing is averaged across steps)
            self._step_function = relaxed_shapes.Relaxed(
                self._step_impl, relaxed_shapes.kinds_check(self.fn), "kg.DPSGD",
                autograph=False)
        if mask is None:
            return self._step_function(*args)
        return self._step_function(*args, mask=mask)

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
            rate = self.learning_rate  # (a Python float in the variable's precision)
            rate = tf.cast(rate, v.dtype) if tf.is_tensor(rate) else tf.constant(rate, v.dtype)
            v.assign_sub(rate * tf.cast(g, v.dtype))
        reg.apply_constraints()
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
        return self._ledger.epsilon(delta, self.noise_multiplier, self.sampling, self._steps(),
                                    accountant)

    def privacy_statement(self, delta: float) -> str:
        """``kg.privacy.statement`` for the steps taken so far (a line per phase
        where the noise multiplier changed)."""
        self.epsilon(delta)  # the same checks
        return self._ledger.statement(delta, self.noise_multiplier, self.sampling, self._steps())
