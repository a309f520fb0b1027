"""A layer's bias read as a layer of its own: a shift (scale-and-shift
without a scale) on the layer's product.

Where one kernel has several biases (tied weights), where a table is both
looked up and projected onto (``passes.tied_embedding``), and where a
kernel is a low-rank adapter's (``passes.lora``), the kernel's layer keeps
its uses without the bias and the bias becomes a shift layer.

``detach_bias(g, roles, use) -> (use, shift item)``: the matched use
(``roles``: the match's, with ``"add"`` and ``"b"``) without its bias, its
output the product's, and the bias's ``(None, roles, Use)`` item for a
scale-and-shift group of the bias.
"""
from __future__ import annotations

import dataclasses

from passes import ir, scale_shift_use


def detach_bias(g, roles, use):
    """The module docstring's contract."""
    return without_bias(g, use, roles), bias_as_shift(g, roles, use)


def without_bias(g, use, roles):
    """``use`` without its bias add (as it is when it has none)."""
    if "add" not in roles or "b" not in roles:
        return use
    main = roles.get("unflat") or roles.get("b2s") or roles["op"]
    ops = tuple(n for n in use.ops if n != roles["add"])
    attrs = dict(use.attrs)
    if "parts" in attrs:
        attrs["parts"] = attrs["parts"][:1]
    return dataclasses.replace(use, output=ir.tensor_name(main), ops=ops, attrs=attrs)


def bias_as_shift(g, roles, use):
    """The bias's own shift item, on the product ``use`` adds it to."""
    main = roles.get("unflat") or roles.get("b2s") or roles["op"]
    attrs = {"op": g.nodes[roles["add"]]["op"], "normalizer": "identity", "has_scale": False,
             "input_shape": g.nodes[main]["shapes"][0],
             "output_shape": g.nodes[roles["add"]]["shapes"][0]}
    if "data_format" in g.nodes[roles["add"]]["attrs"]:
        attrs["data_format"] = g.nodes[roles["add"]]["attrs"]["data_format"]
    attrs["operand_shapes"] = (attrs["input_shape"],)
    attrs["scale_broadcast"] = scale_shift_use.scale_broadcast(
        g, roles["add"], roles["b"], attrs["output_shape"])
    shift = type(use)((ir.tensor_name(main),), ir.tensor_name(roles["add"]), (roles["add"],), attrs)
    return None, roles, shift
