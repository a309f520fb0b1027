"""Samplers whose batches match the privacy accounting (``accounting.py``).

``poisson_batches(data, rate)``: at every step each of the ``N`` examples is
in the batch independently with probability ``rate`` (``q``), so the batch
size is Binomial(N, q): mean ``qN``, variance ``qN(1-q)``, sometimes 0. This
is the sampling the ``"poisson"`` accountant assumes. To keep the step from
retracing for every size, a batch of ``b`` examples is padded with zeros up to
the next multiple of ``pad_multiple`` (at least one multiple; default
``ceil(sqrt(qN))``, about one standard deviation of the size, so a few sizes
cover almost every batch and padding wastes about ``sqrt(qN)/2`` examples)
and comes with a ``mask`` (1.0 real, 0.0 padding). Elements are
``(x, y, mask)`` for ``(x, y)`` data (``(*element, mask)`` for other tuples),
so Keras reads the mask as ``sample_weight``. A padded example contributes
exactly nothing to the clipped sum (its clipping weight is multiplied by 0),
and the privatised gradient of a mean loss is divided by the *expected* batch
size ``qN``, never by the drawn size (a data-dependent divisor would need its
own accounting): ``g~ = (sum_i m_i clip(g_i) + N(0, sigma^2 C^2)) / (qN)``.
This is Opacus's convention for Poisson sampling.

``fixed_size_batches(data, batch_size)``: each step draws ``batch_size``
distinct examples uniformly at random, afresh (sampling without replacement
within a step, with replacement across steps); accounted as
``SampledWithoutReplacementDpEvent`` under replace-one adjacency (RDP), and
normalised by ``batch_size``. Elements are the data's own structure.

Both keep the examples in memory (drawn once from ``data``: a finite
``tf.data.Dataset`` of single examples, or a tuple of arrays/tensors with the
examples on the first axis), as each step needs random access to all of them.
The sampling randomness is secret and fresh: ``seed=None`` draws the seed
from the operating system (``secrets``), and every pass over the dataset
(``repeat``, each Keras epoch) draws new batches. ``steps``: batches per pass
(default ``floor(1/q)``, at least 1: so ``E`` passes never take more steps
than the ``ceil(E/q)`` that ``noise_for_epsilon(epochs=E)`` plans for).

The returned dataset carries its sampler as ``dataset.privacy_sampling`` (an
``accounting.Sampling``), which ``kg.DPModel.fit`` reads, and
``dataset.privacy_fingerprint()``: what decides its batches, as int64s (the
seed pair ``tf.data`` draws from: the global seed, or its default, and the
seed; and a 63-bit BLAKE2 digest of the examples, computed when called).
Under ``MultiWorkerMirroredStrategy`` ``DPModel.fit`` checks that every
worker's agree, as each worker draws the whole batch and keeps its share.
Transformations of the dataset drop both.
"""
from __future__ import annotations

import hashlib
import math
import secrets

import numpy as np
import tensorflow as tf

from kfac_graph.privacy.accounting import Sampling


def _in_memory(data):
    """``(structure of tensors with examples on axis 0, N)``."""
    if isinstance(data, tf.data.Dataset):
        card = int(data.cardinality())
        if card == int(tf.data.INFINITE_CARDINALITY):
            raise ValueError("a DP sampler needs a finite dataset of single examples "
                             "(this one repeats forever)")
        if card == 0:
            raise ValueError("a DP sampler needs at least one example (the dataset is empty)")
        tensors = data.batch(2 ** 31 - 1).get_single_element()
    else:  # a list (targets of several outputs) as a tuple: tf.data returns no lists
        tensors = _lists_as_tuples(tf.nest.map_structure(tf.convert_to_tensor, data))
    flat = tf.nest.flatten(tensors)
    sizes = {int(t.shape[0]) for t in flat}
    if len(sizes) != 1:
        raise ValueError(f"every component of the data needs the same number of examples "
                         f"on its first axis, got {sorted(sizes)}")
    n = sizes.pop()
    if n == 0:
        raise ValueError("a DP sampler needs at least one example (the data is empty)")
    return tensors, n


def _seed(seed):
    if seed is None:
        return secrets.randbits(62)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer or None, got {seed!r}")
    return int(seed)


def _step_keys(seed, steps):
    """``steps`` fresh stateless keys per pass (``[2]`` int64 each)."""
    return (tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True)
            .batch(2, drop_remainder=True).take(steps))


def _sampled(dataset, sampling, seed, tensors):
    """``dataset`` with its sampler and fingerprint (module docstring) attached."""
    seeds = tuple(int(s) for s in tf.compat.v1.random.get_seed(seed))  # as tf.data reads them

    def fingerprint():
        digest = hashlib.blake2b(digest_size=8)
        for t in tf.nest.flatten(tensors, expand_composites=True):  # (a ragged one's parts)
            t = np.ascontiguousarray(np.asarray(t))
            digest.update(f"{t.dtype.str}{t.shape}".encode())
            if t.dtype == object:  # strings: their bytes, each with its length
                for item in t.ravel():
                    digest.update(len(item).to_bytes(8, "little") + bytes(item))
            else:
                digest.update(t.tobytes())
        return (*seeds, int.from_bytes(digest.digest(), "little") >> 1)

    dataset.privacy_sampling = sampling
    dataset.privacy_fingerprint = fingerprint
    return dataset


def _lists_as_tuples(structure):
    if isinstance(structure, list) or type(structure) is tuple:  # (a namedtuple stays)
        return tuple(_lists_as_tuples(s) for s in structure)
    if isinstance(structure, dict):
        return {k: _lists_as_tuples(s) for k, s in structure.items()}
    return structure


def poisson_batches(data, rate: float, *, steps: int | None = None, seed: int | None = None,
                    pad_multiple: int | None = None) -> tf.data.Dataset:
    """Poisson-sampled, padded, masked batches of ``data`` (see the module
    docstring)."""
    tensors, n = _in_memory(data)
    sampling = Sampling.make("poisson", sample_rate=rate, num_examples=n)
    steps = _steps(steps, sampling)
    m = max(1, math.ceil(math.sqrt(rate * n))) if pad_multiple is None else pad_multiple
    if isinstance(m, bool) or not float(m).is_integer() or m < 1:
        raise ValueError(f"pad_multiple must be an integer >= 1, got {pad_multiple!r}")
    m = int(m)

    def draw(key):
        chosen = tf.where(tf.random.stateless_uniform([n], seed=key, dtype=tf.float64)
                          < rate)[:, 0]
        b = tf.shape(chosen)[0]
        padded = tf.maximum(1, (b + m - 1) // m) * m
        mask = tf.concat([tf.ones([b], tf.float32), tf.zeros([padded - b], tf.float32)], 0)

        def take(t):
            picked = tf.gather(t, chosen)
            pad = [[0, padded - b]] + [[0, 0]] * (t.shape.rank - 1)
            return tf.pad(picked, pad)

        batch = tf.nest.map_structure(take, tensors)
        if isinstance(batch, tuple):
            return (*batch, mask)
        return batch, mask

    seed = _seed(seed)
    dataset = _step_keys(seed, steps).map(draw, num_parallel_calls=1).prefetch(2)
    return _sampled(dataset, sampling, seed, tensors)


def fixed_size_batches(data, batch_size: int, *, steps: int | None = None,
                       seed: int | None = None) -> tf.data.Dataset:
    """Batches of ``batch_size`` distinct examples drawn uniformly afresh at
    every step (see the module docstring)."""
    tensors, n = _in_memory(data)
    if isinstance(batch_size, bool) or not float(batch_size).is_integer() or \
            not 1 <= batch_size <= n:
        raise ValueError(f"batch_size must be an integer in [1, {n}], got {batch_size!r}")
    sampling = Sampling.make("fixed", num_examples=n, batch_size=int(batch_size))
    steps = _steps(steps, sampling)
    b = int(batch_size)

    def draw(key):
        # the b smallest of n iid uniforms: a uniformly random b-subset
        _, chosen = tf.math.top_k(-tf.random.stateless_uniform([n], seed=key), k=b)
        return tf.nest.map_structure(lambda t: tf.gather(t, chosen), tensors)

    seed = _seed(seed)
    dataset = _step_keys(seed, steps).map(draw, num_parallel_calls=1).prefetch(2)
    return _sampled(dataset, sampling, seed, tensors)


def _steps(steps, sampling: Sampling) -> int:
    if steps is None:
        return max(1, int(math.floor(1.0 / sampling.rate + 1e-9)))
    if isinstance(steps, bool) or not float(steps).is_integer() or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    return int(steps)


def sample_arrays(data, batch_size: int, kind: str, validation_split: float = 0.0,
                  validation_data=None, owner: str = "kg.DPModel.fit", seed=None):
    """``(batches, validation_data)`` for a DP ``fit`` on arrays ``data`` (``(x,
    y)`` or ``(x, y, weights)``): the last ``validation_split`` of the rows
    held out as Keras holds them out (else ``validation_data`` as given),
    the rest drawn by ``kind`` sampling (``"poisson"`` at rate ``batch_size /
    N``, or ``"fixed"`` batches of ``batch_size``) from ``seed`` (None: a
    fresh one from the OS); ``batches.privacy_sampling`` says how."""
    n = int(np.shape(tf.nest.flatten(data[0])[0])[0])
    if validation_split:
        cut = n - int(math.floor(n * validation_split))
        validation_data = tuple(_rows(t, cut, None) for t in data)
        data, n = tuple(_rows(t, 0, cut) for t in data), cut
    if batch_size > n:
        raise ValueError(f"{owner}: batch_size {batch_size} is more than the {n} examples to "
                         "sample from; give at most that many (a sampling rate of at most 1)")
    if kind == "fixed":
        return fixed_size_batches(data, batch_size, seed=seed), validation_data
    return poisson_batches(data, batch_size / n, seed=seed), validation_data


def _rows(data, start, stop):
    return tf.nest.map_structure(lambda t: t[start:stop], data)


def check_padding_mask(mask, sampling: Sampling | None, owner: str = "kg.DPModel.fit") -> None:
    """One-line ``ValueError`` unless ``mask`` (a batch's third element, eager)
    is None or the 0/1 padding mask of ``poisson_batches`` under Poisson
    ``sampling``: sample weights read as the mask would scale each clipped
    gradient past the clip norm."""
    if mask is None:
        return
    if sampling is None or sampling.kind != "poisson":
        raise ValueError(f"{owner}: sample_weight and class_weight are not supported (a third "
                         "element is read only as the padding mask of "
                         "kg.privacy.poisson_batches)")
    shape = np.shape(mask)  # (a causal LM's [B, T] padding mask as weights: not one per example)
    if len(shape) != 1 or not np.all(np.isin(np.asarray(mask), (0, 1))):
        held = "other values" if len(shape) == 1 else f"shape {list(shape)}, not [batch]"
        raise ValueError(f"{owner}: the dataset's third element is read as the padding mask of "
                         f"kg.privacy.poisson_batches (0 or 1 per example), and it holds {held}: "
                         "a weight would scale each clipped gradient past the clip norm; "
                         "give sample weights with arrays (fit(x, y, sample_weight=w))")
