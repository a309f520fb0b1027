"""Predictive distributions p(y | z) for the loss kinds, with their Fisher.

Every distribution is parameterised by the network output `z` of shape
`[..., K]` (the last axis is the event axis; leading axes are examples and
any positions) and provides, per leading index:

  log_prob(y)        log p(y | z), summed over the event axis: `[...]`.
  sample(seed)       targets y ~ p(y | z); stateless, deterministic in `seed`
                     (a shape-[2] integer tensor).
  fisher()           F = E_y[grad_z log p grad_z log p^T]: `[..., K, K]`.
  fisher_diagonal()  diag(F): `[..., K]` (exact for the diagonal kinds).
  multiply_fisher(v) F v for v `[..., K]` without forming F.
  sqrt_fisher()      S with F = S S^T: `[..., K, K]`; its columns
                     `S[..., :, c]` are the cotangents of the "exact" mode.
  sqrt_fisher_columns()  the K columns as a list of `[..., K]` tensors.

Closed forms (p = softmax(z) or sigmoid(z)):
  Categorical: F = diag(p) - p p^T,  S = diag(sqrt p) - p sqrt(p)^T
               (S S^T = diag p - 2 p p^T + p (sum p) p^T = F as sum p = 1).
  Bernoulli:   F = diag(p (1 - p)),  S = diag(sqrt(p (1 - p))).
  Normal(z, variance s2): F = I / s2,  S = I / sqrt(s2); with the default
               s2 = 1/2, -log p = (y - z)^2 + const.
"""

import math
import types

import tensorflow as tf


def _diag_columns(diag):
    k = diag.shape[-1]
    return [diag * tf.one_hot(c, k, dtype=diag.dtype) for c in range(k)]


class Categorical:
    """Softmax over the last axis; targets are ids `[...]` or one-hot `[..., K]`."""

    kind = "categorical"

    def __init__(self, logits):
        self.logits = tf.convert_to_tensor(logits)
        self.probs = tf.nn.softmax(self.logits, axis=-1)

    def log_prob(self, y):
        y = tf.convert_to_tensor(y)
        log_p = tf.nn.log_softmax(self.logits, axis=-1)
        if y.dtype.is_integer:
            return tf.gather(log_p, y, axis=-1, batch_dims=len(y.shape))
        return tf.reduce_sum(tf.cast(y, log_p.dtype) * log_p, axis=-1)

    def sample(self, seed, one_hot=False):
        """Ids `[...]` (int64), or one-hot `[..., K]` in the logits' dtype."""
        k = self.logits.shape[-1]
        flat = tf.reshape(self.logits, [-1, k])
        # Non-finite logits (a step about to be skipped) must still give valid ids.
        flat = tf.where(tf.math.is_finite(flat), flat, tf.zeros_like(flat))
        ids = tf.minimum(tf.random.stateless_categorical(flat, 1, seed=seed)[:, 0], k - 1)
        ids = tf.reshape(ids, tf.shape(self.logits)[:-1])
        return tf.one_hot(ids, k, dtype=self.logits.dtype) if one_hot else ids

    def fisher(self):
        p = self.probs
        return tf.linalg.diag(p) - p[..., :, None] * p[..., None, :]

    def fisher_diagonal(self):
        return self.probs * (1.0 - self.probs)

    def multiply_fisher(self, v):
        p = self.probs
        return p * v - p * tf.reduce_sum(p * v, -1, keepdims=True)

    def sqrt_fisher(self):
        p = self.probs
        sq = tf.sqrt(p)
        return tf.linalg.diag(sq) - p[..., :, None] * sq[..., None, :]

    def sqrt_fisher_columns(self):
        p = self.probs
        sq = tf.sqrt(p)
        k = p.shape[-1]
        return [sq * tf.one_hot(c, k, dtype=p.dtype) - p * sq[..., c : c + 1] for c in range(k)]


class Bernoulli:
    """Independent Bernoulli per output unit, parameterised by logits."""

    kind = "bernoulli"

    def __init__(self, logits):
        self.logits = tf.convert_to_tensor(logits)
        self.probs = tf.sigmoid(self.logits)

    def log_prob(self, y):
        y = tf.cast(y, self.logits.dtype)
        return -tf.reduce_sum(
            tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=self.logits), axis=-1
        )

    def sample(self, seed):
        u = tf.random.stateless_uniform(tf.shape(self.logits), seed=seed, dtype=self.logits.dtype)
        return tf.cast(u < self.probs, self.logits.dtype)

    def fisher_diagonal(self):
        return self.probs * (1.0 - self.probs)

    def fisher(self):
        return tf.linalg.diag(self.fisher_diagonal())

    def multiply_fisher(self, v):
        return self.fisher_diagonal() * v

    def sqrt_fisher(self):
        return tf.linalg.diag(tf.sqrt(self.fisher_diagonal()))

    def sqrt_fisher_columns(self):
        return _diag_columns(tf.sqrt(self.fisher_diagonal()))


class Normal:
    """Normal with mean z and a fixed variance (default 1/2)."""

    kind = "normal"

    def __init__(self, mean, variance=0.5):
        self.mean = tf.convert_to_tensor(mean)
        self.variance = float(variance)

    def log_prob(self, y):
        y = tf.cast(y, self.mean.dtype)
        const = 0.5 * math.log(2.0 * math.pi * self.variance)
        sq = tf.square(y - self.mean) / (2.0 * self.variance)
        return -tf.reduce_sum(sq + const, axis=-1)

    def sample(self, seed):
        eps = tf.random.stateless_normal(tf.shape(self.mean), seed=seed, dtype=self.mean.dtype)
        return self.mean + math.sqrt(self.variance) * eps

    def fisher_diagonal(self):
        return tf.ones_like(self.mean) / self.variance

    def fisher(self):
        return tf.linalg.diag(self.fisher_diagonal())

    def multiply_fisher(self, v):
        return v / self.variance

    def sqrt_fisher(self):
        return tf.linalg.diag(tf.sqrt(self.fisher_diagonal()))

    def sqrt_fisher_columns(self):
        return _diag_columns(tf.sqrt(self.fisher_diagonal()))


DISTRIBUTIONS = types.MappingProxyType(
    {"categorical": Categorical, "bernoulli": Bernoulli, "normal": Normal}
)


def at_least_float32(z):
    """`z`, a 16-bit float output (mixed precision) cast to float32: the
    distribution, its samples and its Fisher are computed in float32."""
    if z.dtype in (tf.float16, tf.bfloat16):
        return tf.cast(z, tf.float32)
    return z


def make_distribution(kind, z, **kwargs):
    """The distribution for a `LossSpec.kind` at network output `z`."""
    try:
        cls = DISTRIBUTIONS[kind]
    except KeyError:
        raise ValueError(f"make_distribution: unknown loss kind {kind!r}") from None
    return cls(z, **kwargs)
