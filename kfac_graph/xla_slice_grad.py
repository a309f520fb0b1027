"""A gradient for the slice gradient TensorFlow writes under XLA.

Inside an XLA context (``jit_compile=True``, or ``"auto"`` on an
accelerator) TensorFlow's gradient of ``Slice`` is an
``XlaDynamicUpdateSlice`` (the cotangent written into zeros at the slice's
start), an op with no gradient of its own. A backward pass through a slice
(GPT-2 slices its position-embedding table) then cannot be differentiated
again, as the quadratic model's Jacobian-vector products do
(``optimizer/exact_fisher.py``): "No gradient defined for operation ...
XlaDynamicUpdateSlice". ``differentiable()`` gives the ones made inside it
this gradient, for ``y = x`` with ``u`` written at start ``i``:

    dx = dy with zeros in u's window at i,   du = dy's window at i,

and none for ``i`` (an integer). Outside an XLA context the slice gradient
is a ``Pad``, which TensorFlow differentiates itself.
"""
import contextlib

import tensorflow as tf
from tensorflow.compiler.tf2xla.ops import gen_xla_ops

NAME = "KfacGraphXlaDynamicUpdateSlice"


@contextlib.contextmanager
def differentiable():
    """Ops of type ``XlaDynamicUpdateSlice`` made in this block, in the default
    graph, get the gradient of the module docstring."""
    graph = tf.compat.v1.get_default_graph()
    with graph.gradient_override_map({"XlaDynamicUpdateSlice": NAME}):
        yield


@tf.RegisterGradient(NAME)
def _dynamic_update_slice_gradient(op, dy):
    _, update, start = op.inputs
    window = tf.slice(dy, start, tf.shape(update, out_type=start.dtype))
    rest = gen_xla_ops.xla_dynamic_update_slice(dy, tf.zeros_like(update), start)
    return rest, window, None
