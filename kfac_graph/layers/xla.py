"""Whether the code being traced will be compiled by XLA.

Rules choose their kernels by this: on the CPU XLA runs convolutions (and the
grouped filter-gradient convolutions most of all) many times slower than
TensorFlow's oneDNN kernels, while matmul/slice formulations compile well.
"""

import tensorflow as tf


def in_xla_context():
    """True when tracing inside `tf.function(jit_compile=True)` (or an outer
    XLA context). Uses a TF-internal helper; returns False if it moves."""
    if tf.executing_eagerly():
        return False
    try:
        from tensorflow.python.ops import control_flow_util  # pylint: disable=g-import-not-at-top

        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
    except (ImportError, AttributeError):
        return False


def resolve_xla(xla):
    """`xla` if it is a bool, else the detected context (for `xla=None`)."""
    return in_xla_context() if xla is None else bool(xla)
