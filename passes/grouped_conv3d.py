"""A grouped `Conv3D` in the graph that is run: G ungrouped `Conv3D`s on
channel slices.

TensorFlow's CPU `Conv3D` kernel has no groups ("input and filter must have
the same depth"); Keras runs its `Conv3D(groups=G)` by compiling the op with
XLA (`jit_compile=True`), which the inlined graph no longer says. So the
graph the runtime re-imports has every grouped `Conv3D` node (input with
`Cin = G*cg` channels, kernel `W [kd, kh, kw, cg, Cout]`, `og = Cout/G`)
written as the same convolution per group,

    y = concat_j Conv3D(x[..., j*cg:(j+1)*cg], W[..., j*og:(j+1)*og])

(channel axis 1 for NCDHW), which the CPU runs forward and differentiates to
any order (its gradients are TensorFlow's own `Conv3D` gradients), and XLA
compiles too. The same multiply-adds as the grouped op; each output channel
sums the same products, so the result is exact. The concatenation keeps the
`Conv3D` node's name, so every tensor the registration names still exists.

Contract: ``split_grouped_conv3d(graph_def, g) -> graph_def``: ``g`` is the
IR of ``graph_def`` (its static shapes say which `Conv3D` is grouped); the
returned GraphDef is a new proto (the input is left as it is); a grouped
`Conv3D` whose channel counts are not static is left unchanged.
"""
from __future__ import annotations

import tensorflow as tf

from passes import ir

_PREFIX = "kfac_grouped"


def _groups(g, node) -> int:
    """G for a `Conv3D` node of the IR: input channels over the kernel's
    input channels; 1 when ungrouped or unknown."""
    if node not in g or g.nodes[node].get("op") != "Conv3D":
        return 1
    data = g.nodes[node]
    x, w = (ir.shape_of(g, t) for t in data["raw_inputs"][:2])
    if x is None or w is None or len(x) != 5 or len(w) != 5:
        return 1
    fmt = data["attrs"].get("data_format", "NDHWC")
    channels, per_group = (x[1] if fmt.startswith("NC") else x[-1]), w[3]
    if channels is None or per_group is None or channels == per_group or channels % per_group:
        return 1
    return channels // per_group


def _const_int(name, value):
    node = tf.compat.v1.NodeDef(name=name, op="Const")
    node.attr["dtype"].type = tf.int32.as_datatype_enum
    node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, tf.int32))
    return node


def _split(name, axis, value, groups, dtype_attr):
    node = tf.compat.v1.NodeDef(name=name, op="Split", input=[axis, value])
    node.attr["num_split"].i = groups
    node.attr["T"].CopyFrom(dtype_attr)
    return node


def _rewrite(node, groups, names):
    """The nodes that replace grouped `Conv3D` ``node`` (module docstring)."""
    base = f"{node.name}/{_PREFIX}"
    while any(n.startswith(base) for n in names):
        base += "_"
    x, w = node.input[0], node.input[1]
    control = [t for t in node.input[2:] if t.startswith("^")]
    fmt = node.attr["data_format"].s.decode() if "data_format" in node.attr else "NDHWC"
    dtype = node.attr["T"]
    out = [_const_int(f"{base}/channel_axis", 1 if fmt.startswith("NC") else 4),
           _const_int(f"{base}/kernel_axis", 4)]
    xs = _split(f"{base}/inputs", out[0].name, x, groups, dtype)
    ws = _split(f"{base}/kernels", out[1].name, w, groups, dtype)
    xs.input.extend(control)
    ws.input.extend(control)
    out += [xs, ws]
    for j in range(groups):
        conv = tf.compat.v1.NodeDef(name=f"{base}/group_{j}", op="Conv3D",
                                    input=[f"{xs.name}:{j}", f"{ws.name}:{j}"],
                                    device=node.device)
        for key, value in node.attr.items():
            if not key.startswith("_"):
                conv.attr[key].CopyFrom(value)
        out.append(conv)
    concat = tf.compat.v1.NodeDef(name=node.name, op="ConcatV2", device=node.device,
                                  input=[f"{base}/group_{j}" for j in range(groups)]
                                  + [out[0].name])
    concat.attr["N"].i = groups
    concat.attr["T"].CopyFrom(dtype)
    concat.attr["Tidx"].type = tf.int32.as_datatype_enum
    if "_output_shapes" in node.attr:
        concat.attr["_output_shapes"].CopyFrom(node.attr["_output_shapes"])
    out.append(concat)
    return out


def split_grouped_conv3d(graph_def, g):
    """``graph_def`` with each grouped `Conv3D` written per group (module
    docstring); the same proto object when there is none."""
    groups = {node.name: _groups(g, node.name) for node in graph_def.node if node.op == "Conv3D"}
    if all(n == 1 for n in groups.values()):
        return graph_def
    names = {node.name for node in graph_def.node}
    out = type(graph_def)()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    for node in graph_def.node:
        if groups.get(node.name, 1) > 1:
            out.node.extend(_rewrite(node, groups[node.name], names))
        else:
            out.node.add().CopyFrom(node)
    return out
