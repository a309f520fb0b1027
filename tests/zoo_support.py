"""What the registration zoo is made of: the expected-registration records
(``L``, ``Built``, ``ZooCase``), variable comparisons, and small data and
weight helpers. The models themselves are in ``zoo.py``."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import keras
import tensorflow as tf

B = 4  # the default batch size


@dataclasses.dataclass(frozen=True)
class L:
    """One expected layer: kind, variables (kernel/scale first), uses."""
    kind: str
    variables: Any  # a list of variables, or a callable returning one
    uses: Any = 1  # an int, or a tuple of the acceptable counts

    def resolved(self) -> list:
        return list(self.variables() if callable(self.variables) else self.variables)

    def accepts_uses(self, uses: int) -> bool:
        return uses in (self.uses if isinstance(self.uses, tuple) else (self.uses,))


@dataclasses.dataclass
class Built:
    loss_fn: Callable  # the plain Python loss function, not wrapped
    make_args: Callable[[int], tuple]  # batch size -> example arguments
    layers: list[L]
    loss: str  # "categorical" | "bernoulli" | "normal"
    reduction: str = "mean"
    scale: float = 1.0
    track: Any = None  # what a tf.Module must hold to save the variables
    # LossSpec.output is the last layer's output, LossSpec.targets this
    # argument; None where the loss op reads a reshaped copy of them.
    output_is_last_layer: bool = True
    targets_arg: Any = 1

    @property
    def args(self) -> tuple:
        return self.make_args(B)


@dataclasses.dataclass(frozen=True)
class ZooCase:
    name: str
    build: Callable[[], Built]
    fast_saved: bool = False  # in the unmarked SavedModel subset

    def __repr__(self) -> str:
        return self.name


def tf_variable(v):
    """The tf.Variable behind a keras.Variable (or ``v`` itself)."""
    if isinstance(v, keras.Variable):
        return v.value if isinstance(v.value, tf.Variable) else v._value  # noqa: SLF001
    return v


def same_variable(a, b) -> bool:
    a, b = tf_variable(a), tf_variable(b)
    return a is b or (hasattr(a, "handle") and hasattr(b, "handle") and a.handle is b.handle)


def variable_name(v) -> str:
    return tf_variable(v).name.split(":")[0]


# --- data -------------------------------------------------------------------

def normal(shape, seed):
    return tf.random.stateless_normal(shape, seed=[seed, 7])


def labels(batch, classes, seed, shape=()):
    return tf.random.stateless_uniform([batch, *shape], [seed, 11], maxval=classes, dtype=tf.int32)


def one_hot(batch, classes, seed):
    return tf.one_hot(labels(batch, classes, seed), classes)


def bits(batch, k, seed):
    return tf.cast(tf.random.stateless_uniform([batch, k], [seed, 13]) > 0.5, tf.float32)


def xy_sparse(d, k, seed=0, x_shape=None):
    shape = x_shape or (d,)
    return lambda b: (normal([b, *shape], seed), labels(b, k, seed))


def sparse_ce(y, logits):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)


def var(shape, name, seed):
    return tf.Variable(0.3 * normal(shape, seed), name=name)


def kb(layer) -> list:
    """A Keras layer's kernel and bias (if it has one)."""
    return [layer.kernel] + ([layer.bias] if layer.bias is not None else [])
