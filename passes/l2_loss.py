"""``tf.nn.l2_loss(x)`` written out as ``0.5 * sum(x * x)``.

``L2Loss`` sums the squares of every element into one scalar, so the loss
pass cannot read a loss computed by it (``tf.nn.l2_loss(z - y) / B``) as a
sum of per-example terms: the examples' squared errors exist only inside
the op. ``written_out(graph_def)`` returns the graph with each ``L2Loss``
replaced by ``Square``, a ``Sum`` over ``range(rank)`` and a ``Mul`` by
``0.5``, the ``Mul`` under the ``L2Loss``'s own name (its readers are
unchanged); the same value, and a graph whose per-example squared errors
the loss pass reads as a Gaussian likelihood, and whose weight penalty
``tf.nn.l2_loss(W)`` stays a penalty. A graph without ``L2Loss`` is
returned as it is.
"""
from __future__ import annotations

import tensorflow as tf

from passes.node_defs import INT32, const_int, node


def written_out(graph_def):
    """``graph_def`` (a copy where it changes) with every ``L2Loss`` written out."""
    if not any(n.op == "L2Loss" for n in graph_def.node):
        return graph_def
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    kept = [n for n in out.node if n.op != "L2Loss"]
    added = []
    for n in (n for n in graph_def.node if n.op == "L2Loss"):
        dtype, x, name = n.attr["T"].type, n.input[0], n.name
        half = node(f"{name}/kfac_graph_half", "Const", device=n.device, dtype=dtype)
        half.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(0.5, tf.as_dtype(dtype)))
        added += [
            node(f"{name}/kfac_graph_square", "Square", [x], n.device, T=dtype),
            node(f"{name}/kfac_graph_rank", "Rank", [x], n.device, T=dtype),
            const_int(f"{name}/kfac_graph_zero", 0, n.device),
            const_int(f"{name}/kfac_graph_one", 1, n.device),
            node(f"{name}/kfac_graph_axes", "Range", [f"{name}/kfac_graph_zero",
                 f"{name}/kfac_graph_rank", f"{name}/kfac_graph_one"], n.device, Tidx=INT32),
            node(f"{name}/kfac_graph_sum", "Sum", [f"{name}/kfac_graph_square",
                 f"{name}/kfac_graph_axes"], n.device, T=dtype, Tidx=INT32),
            half,
            node(name, "Mul", [f"{name}/kfac_graph_sum", f"{name}/kfac_graph_half"], n.device,
                 T=dtype)]
        added[-1].input.extend([f"^{c}" for c in n.input if c.startswith("^")])
    del out.node[:]
    out.node.extend(kept + added)
    return out
