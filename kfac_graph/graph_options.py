"""How TensorFlow optimises the graph of a K-FAC step, or of a per-example
gradient function, when it first runs it.

A ``tf.function`` is optimised by Grappler the first time it is called
(constant folding, arithmetic and layout rewrites, operator fusion, each
pass twice over the whole graph). A K-FAC step's graph holds the model's
forward and backward passes several times over (statistics, the quadratic
model's double backward passes) plus every block's algebra, and on large
models that optimisation was the largest part of the first step
(``benchmarks/cold_start.py``); a per-example gradient function's first
call spent 0.2-1.6 s there on ``keras.applications`` models and BERT-small
(a fifth to a third of that call), and its later calls ran no faster for
it. ``call_options(mode)`` is a context manager under which calls of
``tf.function``s run with:

- ``"default"``: TensorFlow's configuration (``tf.config.optimizer``);
- ``"off"``: Grappler's meta-optimizer disabled for these calls only.

The setting is per thread and per call (``tf.function`` keys an optimised
graph by it, so every call of one function must use the same mode); it is
restored on exit. The graph TensorFlow runs computes the same values either
way in float32 and float64; its rewrites (and the time they take) differ,
and where a model computes in a lower precision (``mixed_bfloat16``) a
rewrite may reorder or fuse its roundings, so the values differ at that
precision.
"""
from __future__ import annotations

import contextlib
import copy

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context

MODES = ("default", "off")


def _config(mode: str):
    config = config_pb2.ConfigProto()
    if mode == "off":
        config.graph_options.rewrite_options.disable_meta_optimizer = True
    return config


def check_mode(mode: str) -> None:
    """Raises ``ValueError`` unless ``mode`` is one of ``MODES``."""
    if mode not in MODES:
        raise ValueError(f"graph_optimization must be one of {MODES}, got {mode!r}")


@contextlib.contextmanager
def call_options(mode: str):
    """Calls of ``tf.function``s in this block are optimised by ``mode``."""
    check_mode(mode)
    if mode == "default":
        yield
        return
    ctx = context.context()
    previous = ctx.function_call_options
    options = copy.copy(previous)
    options.config_proto_serialized = _config(mode)
    ctx.function_call_options = options
    try:
        yield
    finally:
        ctx.function_call_options = previous


def eager_call(run, args, mode: str = "off"):
    """``run(*args)`` optimised by ``mode`` when called eagerly; inside a
    ``tf.function`` being traced the caller's graph decides (its own
    optimisation covers the call)."""
    check_mode(mode)
    if not tf.executing_eagerly():
        return run(*args)
    with call_options(mode):
        return run(*args)
