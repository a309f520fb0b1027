"""Several model outputs joined into one tensor the loss reads through.

A loss that adds the terms of several outputs (a model with two heads, each
with its loss) has no one model output; its Gauss-Newton curvature is the
Hessian of the examples' summed loss over all of them
(``passes.loss_output.joint_outputs``). So that every part of the runtime
keeps one output ``z`` ``[B, N]``, the graph that is run gets

    joined = concat_k reshape(z_k, [-1, n_k])                 (axis 1)
    z_k'   = reshape(split(joined, [n_1, n_2, ..], axis 1)[k], shape(z_k))

and every op that read ``z_k`` reads ``z_k'`` instead: the same values, and
every path from the variables to the loss now passes through ``joined``
(``n_k`` the values of ``z_k`` per example). The IR
gets a node ``JOINED`` with the joined shape and dtype (and no edges), for
the passes that read the output's shape.

Contract: ``join_outputs(graph_def, g, outputs) -> graph_def`` (a new proto;
the input is left as it is).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from passes import ir
from passes.node_defs import INT32, const_int, node

JOINED = "kfac_joined_outputs"


def join_outputs(graph_def, g, outputs):
    """``graph_def`` with ``outputs`` joined (module docstring); adds the
    ``JOINED`` node to the IR ``g``."""
    shapes = [ir.shape_of(g, ir.resolve(g, z)) for z in outputs]
    dtype_name = ir.dtype_of(g, outputs[0])
    dtype = tf.as_dtype(dtype_name).as_datatype_enum
    sizes = [int(np.prod(s[1:])) for s in shapes]
    new, rewired = [], {}
    for k, (z, n) in enumerate(zip(outputs, sizes)):
        flat = f"{JOINED}/flat_{k}"
        new += [const_int(f"{flat}/shape", [-1, n]),
                node(flat, "Reshape", [z, f"{flat}/shape"], T=dtype, Tshape=INT32)]
    new.append(const_int(f"{JOINED}/axis", 1))
    joined = node(JOINED, "ConcatV2", [f"{JOINED}/flat_{k}" for k in range(len(outputs))]
                  + [f"{JOINED}/axis"], T=dtype, Tidx=INT32)
    joined.attr["N"].i = len(outputs)
    new.append(joined)
    # a SplitV, not Slices: under XLA a Slice's gradient has no gradient of its own
    parts = f"{JOINED}/parts"
    split = node(parts, "SplitV", [JOINED, f"{parts}/sizes", f"{JOINED}/axis"], T=dtype,
                 Tlen=INT32)
    split.attr["num_split"].i = len(outputs)
    new += [const_int(f"{parts}/sizes", sizes), split]
    for k, z in enumerate(outputs):
        out = f"{JOINED}/out_{k}"
        new += [node(f"{JOINED}/shape_{k}", "Shape", [z], T=dtype, out_type=INT32),
                node(out, "Reshape", [f"{parts}:{k}", f"{JOINED}/shape_{k}"], T=dtype,
                     Tshape=INT32)]
        rewired[ir.tensor_name(*ir.split_tensor(z))] = out
    result = type(graph_def)()
    result.CopyFrom(graph_def)
    for reader in result.node:
        for i, name in enumerate(reader.input):
            if not name.startswith("^"):
                reader.input[i] = rewired.get(ir.tensor_name(*ir.split_tensor(name)), name)
    result.node.extend(new)
    g.add_node(JOINED, op="ConcatV2", attrs={}, inputs=[], raw_inputs=[],
               dtypes=[dtype_name], shapes=[(shapes[0][0], sum(sizes))])
    return result
