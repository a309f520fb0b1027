"""A grouped or channels-first `Conv3D` in the graph that is run: G
ungrouped channels-last `Conv3D`s on channel slices.

TensorFlow's CPU `Conv3D` kernel has no groups ("input and filter must have
the same depth"); Keras runs its `Conv3D(groups=G)` by compiling the op with
XLA (`jit_compile=True`), which the inlined graph no longer says. So the
graph the runtime re-imports has every grouped `Conv3D` node (input with
`Cin = G*cg` channels, kernel `W [kd, kh, kw, cg, Cout]`, `og = Cout/G`)
written as the same convolution per group,

    y = concat_j Conv3D(x[..., j*cg:(j+1)*cg], W[..., j*og:(j+1)*og])

which the CPU runs forward and differentiates to any order (its gradients
are TensorFlow's own `Conv3D` gradients), and XLA compiles too. The same
multiply-adds as the grouped op; each output channel sums the same
products, so the result is exact. Channels-first (NCDHW, which Keras also
compiles with XLA, and the CPU runs only in float32) is transposed to NDHWC
around the convolutions (G = 1 included), so it runs in every dtype. The
last node keeps the `Conv3D` node's name, so every tensor the registration
names still exists.

A grouped channels-first `Conv2D` (Keras's Conv1D and Conv2D with
``groups > 1``, which Keras also compiles with XLA: the CPU's `Conv2D` runs
NHWC only) is transposed to NHWC around the one grouped convolution, which
the CPU runs and ``kfac_graph.grouped_conv_grad`` differentiates.

Contract: ``split_grouped_conv3d(graph_def, g) -> graph_def``: ``g`` is the
IR of ``graph_def`` (its static shapes say which `Conv3D` is grouped); the
returned GraphDef is a new proto (the input is left as it is); a grouped
`Conv3D` whose channel counts are not static is left unchanged (and fails
where TensorFlow's kernel does).
"""
from __future__ import annotations

import tensorflow as tf

from passes import ir
from passes.node_defs import const_int

_PREFIX = "kfac_grouped"


_RANKS = {"Conv3D": 5, "Conv2D": 4}


def _groups(g, node) -> int:
    """G for a `Conv3D` or `Conv2D` node of the IR: input channels over the
    kernel's input channels; 1 when ungrouped or unknown."""
    rank = _RANKS.get(g.nodes[node].get("op")) if node in g else None
    if rank is None:
        return 1
    data = g.nodes[node]
    x, w = (ir.shape_of(g, t) for t in data["raw_inputs"][:2])
    if x is None or w is None or len(x) != rank or len(w) != rank:
        return 1
    fmt = data["attrs"].get("data_format", "NDHWC")
    channels, per_group = (x[1] if fmt.startswith("NC") else x[-1]), w[-2]
    if channels is None or per_group is None or channels == per_group or channels % per_group:
        return 1
    return channels // per_group


def _channels_first(node) -> bool:
    return "data_format" in node.attr and node.attr["data_format"].s.decode().startswith("NC")


def _op(name, op, inputs, dtype_attr, device, **ints):
    node = tf.compat.v1.NodeDef(name=name, op=op, input=inputs, device=device)
    node.attr["T"].CopyFrom(dtype_attr)
    for key, value in ints.items():
        if key in ("Tidx", "Tperm"):
            node.attr[key].type = tf.int32.as_datatype_enum
        else:
            node.attr[key].i = value
    return node


def _rewrite(node, groups, names):
    """The nodes that replace `Conv3D` or `Conv2D` ``node`` (module
    docstring); the last one takes its name. A `Conv2D` keeps its groups."""
    base = f"{node.name}/{_PREFIX}"
    while any(n.startswith(base) for n in names):
        base += "_"
    dtype, device = node.attr["T"], node.device
    x, w = node.input[0], node.input[1]
    control = [t for t in node.input[2:] if t.startswith("^")]
    first = _channels_first(node)
    rank = _RANKS[node.op]
    if node.op == "Conv2D":
        groups = 1  # (the CPU runs a grouped NHWC Conv2D)
    out = []
    if first:  # NC... -> N...C
        out += [const_int(f"{base}/to_channels_last", [0, *range(2, rank), 1]),
                _op(f"{base}/inputs_channels_last", "Transpose", [x, f"{base}/to_channels_last"]
                    + control, dtype, device, Tperm=0)]
        x = out[-1].name
    attrs = {key: value for key, value in node.attr.items() if not key.startswith("_")}
    if first:
        attrs = dict(attrs)
        for key in ("strides", "dilations"):
            if key in attrs:
                v = list(attrs[key].list.i)
                attrs[key] = tf.compat.v1.AttrValue(
                    list=tf.compat.v1.AttrValue.ListValue(i=[v[0], *v[2:], v[1]]))
        attrs["data_format"] = tf.compat.v1.AttrValue(s=b"NDHWC" if rank == 5 else b"NHWC")
    if groups > 1:
        out += [const_int(f"{base}/channel_axis", 4),
                _op(f"{base}/inputs", "Split", [f"{base}/channel_axis", x] + control, dtype,
                    device, num_split=groups),
                _op(f"{base}/kernels", "Split", [f"{base}/channel_axis", w] + control, dtype,
                    device, num_split=groups)]
        pairs = [(f"{base}/inputs:{j}", f"{base}/kernels:{j}") for j in range(groups)]
    else:
        pairs = [(x, w)]
    for j, (xj, wj) in enumerate(pairs):
        conv = tf.compat.v1.NodeDef(name=f"{base}/group_{j}", op=node.op, input=[xj, wj],
                                    device=device)
        for key, value in attrs.items():
            conv.attr[key].CopyFrom(value)
        out.append(conv)
    if groups > 1:
        out.append(_op(f"{base}/concat", "ConcatV2",
                       [f"{base}/group_{j}" for j in range(groups)] + [f"{base}/channel_axis"],
                       dtype, device, N=groups, Tidx=0))
    if first:  # N...C -> NC...
        out += [const_int(f"{base}/to_channels_first", [0, rank - 1, *range(1, rank - 1)]),
                _op(f"{base}/channels_first", "Transpose",
                    [out[-1].name, f"{base}/to_channels_first"], dtype, device, Tperm=0)]
    out[-1].name = node.name
    if "_output_shapes" in node.attr:
        out[-1].attr["_output_shapes"].CopyFrom(node.attr["_output_shapes"])
    return out


def split_grouped_conv3d(graph_def, g):
    """``graph_def`` with each grouped or channels-first `Conv3D`, and each
    grouped channels-first `Conv2D`, rewritten (module docstring); the same
    proto object when there is none."""
    todo = {node.name: _groups(g, node.name) for node in graph_def.node
            if (node.op == "Conv3D" and (_channels_first(node) or _groups(g, node.name) > 1))
            or (node.op == "Conv2D" and _channels_first(node) and _groups(g, node.name) > 1)}
    if not todo:
        return graph_def
    names = {node.name for node in graph_def.node}
    out = type(graph_def)()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    for node in graph_def.node:
        if node.name in todo:
            out.node.extend(_rewrite(node, todo[node.name], names))
        else:
            out.node.add().CopyFrom(node)
    return out
