"""Several model outputs joined into one tensor the loss reads through.

A loss that adds the terms of several outputs (a model with two heads, each
with its loss) has no one model output; its Gauss-Newton curvature is the
Hessian of the examples' summed loss over all of them
(``passes.loss_output.joint_outputs``). So that every part of the runtime
keeps one output ``z`` ``[B, N]``, the graph that is run gets

    joined = concat_k reshape(z_k, [-1, n_k])                 (axis 1)
    z_k'   = reshape(split(joined, [n_1, n_2, ..], axis 1)[k], shape(z_k))

(in the widest of their dtypes: under mixed precision a float16 code and
float32 logits are joined in float32, each cast back where it is read)
and every op that read ``z_k`` reads ``z_k'`` instead: the same values, and
every path from the variables to the loss now passes through ``joined``
(``n_k`` the values of ``z_k`` per example). An output that feeds another
(a VAE's encoder output: its KL term reads it, and so does the decoder,
whose output the reconstruction term reads) has only its loss head (the
ops from it to the loss's terms that pass no other output) rewired to read
``z_k'``; the ops of that head that also lead to another output (the
VAE's slices of ``mu`` and ``log var``) are copied, reading ``z_k``, for
the ops on the way there. Then ``joined`` depends on ``z_k`` itself, with
no cycle, and its Jacobian holds each output's own,
the inner one's dependence included: ``J^T blockdiag(H_k) J`` is the sum
of each term's Gauss-Newton matrix. The IR
gets a node ``JOINED`` with the joined shape and dtype (and no edges), for
the passes that read the output's shape.

Contract: ``join_outputs(graph_def, g, outputs, terms) -> graph_def`` (a
new proto; the input is left as it is); ``terms``: the loss's terms, one
tensor per term.
"""
from __future__ import annotations

import networkx as nx
import numpy as np
import tensorflow as tf

from passes import ir
from passes.node_defs import INT32, const_int, node

JOINED = "kfac_joined_outputs"


def join_outputs(graph_def, g, outputs, terms):
    """``graph_def`` with ``outputs`` joined (module docstring); adds the
    ``JOINED`` node to the IR ``g``."""
    shapes = [ir.shape_of(g, ir.resolve(g, z)) for z in outputs]
    own = [tf.as_dtype(ir.dtype_of(g, z)) for z in outputs]
    widest = max(own, key=lambda d: d.size)  # mixed precision: float16 codes, float32 logits
    dtype, dtype_name = widest.as_datatype_enum, widest.name
    sizes = [int(np.prod(s[1:])) if None not in s[1:] else None for s in shapes]
    new, rewired = [], {}
    for k, (z, n) in enumerate(zip(outputs, sizes)):
        flat = f"{JOINED}/flat_{k}"
        new += (_rows_shape(z, flat, own[k].as_datatype_enum) if n is None
                else [const_int(f"{flat}/shape", [-1, n])])
        new.append(node(flat, "Reshape", [z, f"{flat}/shape"], T=own[k].as_datatype_enum,
                        Tshape=INT32))
        if own[k] != widest:
            new.append(node(f"{flat}/cast", "Cast", [flat], SrcT=own[k].as_datatype_enum,
                            DstT=dtype))
    new.append(const_int(f"{JOINED}/axis", 1))
    flats = [f"{JOINED}/flat_{k}" + ("/cast" if own[k] != widest else "")
             for k in range(len(outputs))]
    if len(outputs) == 1:  # a head that mixes an output's positions: joined alone
        joined = node(JOINED, "Identity", flats, T=dtype)
    else:
        joined = node(JOINED, "ConcatV2", flats + [f"{JOINED}/axis"], T=dtype, Tidx=INT32)
        joined.attr["N"].i = len(outputs)
    new.append(joined)
    # a SplitV, not Slices: under XLA a Slice's gradient has no gradient of its own
    parts = f"{JOINED}/parts"
    split = node(parts, "SplitV", [JOINED, f"{parts}/sizes", f"{JOINED}/axis"], T=dtype,
                 Tlen=INT32)
    split.attr["num_split"].i = len(outputs)
    new += [*_split_sizes(f"{parts}/sizes", sizes, own), split]
    for k, z in enumerate(outputs):
        out, part = f"{JOINED}/out_{k}", f"{parts}:{k}"
        if own[k] != widest:
            new.append(node(f"{parts}/cast_{k}", "Cast", [part], SrcT=dtype,
                            DstT=own[k].as_datatype_enum))
            part = f"{parts}/cast_{k}"
        new += [node(f"{JOINED}/shape_{k}", "Shape", [z], T=own[k].as_datatype_enum,
                     out_type=INT32),
                node(out, "Reshape", [part, f"{JOINED}/shape_{k}"], T=own[k].as_datatype_enum,
                     Tshape=INT32)]
    result = type(graph_def)()
    result.CopyFrom(graph_def)
    nodes, flow = [ir.split_tensor(z)[0] for z in outputs], _flow(result)
    for k, z in enumerate(outputs):
        out = f"{JOINED}/out_{k}"
        if any(nodes[k] in nx.ancestors(flow, other) for other in nodes):
            new += _split_head(result, flow, z, out, nodes, terms, f"{JOINED}/shared_{k}")
        else:
            rewired[ir.tensor_name(*ir.split_tensor(z))] = out
    _rewire(result.node, rewired)
    result.node.extend(new)
    g.add_node(JOINED, op="ConcatV2", attrs={}, inputs=[], raw_inputs=[], dtypes=[dtype_name],
               shapes=[(shapes[0][0], None if None in sizes else sum(sizes))])
    return result


def _slice(name, vector, start):
    """``vector[start:start + 1]`` (int32)."""
    out = node(name, "Slice", [vector, f"{name}/begin", f"{name}/size"], T=INT32, Index=INT32)
    return [const_int(f"{name}/begin", [start]), const_int(f"{name}/size", [1]), out]


def _rows_shape(z, flat, dtype):
    """Nodes computing ``f"{flat}/shape"``, ``[B, -1]`` from ``z``'s shape at
    run time (an output whose sizes beyond the batch are not all static)."""
    dims = node(f"{flat}/dims", "Shape", [z], T=dtype, out_type=INT32)
    shape = node(f"{flat}/shape", "ConcatV2", [f"{flat}/batch", f"{flat}/rest", f"{flat}/axis"],
                 T=INT32, Tidx=INT32)
    shape.attr["N"].i = 2
    return [dims, *_slice(f"{flat}/batch", f"{flat}/dims", 0),
            const_int(f"{flat}/rest", [-1]), const_int(f"{flat}/axis", 0), shape]


def _split_sizes(name, sizes, own):
    """Nodes computing ``name``, each output's values per example: constants
    where every size is static, else read at run time from the flat outputs."""
    if None not in sizes:
        return [const_int(name, sizes)]
    new, pieces = [], []
    for k, n in enumerate(sizes):
        piece, flat = f"{name}/{k}", f"{JOINED}/flat_{k}"
        if n is None:
            new += [node(f"{piece}/dims", "Shape", [flat], T=own[k].as_datatype_enum,
                         out_type=INT32), *_slice(piece, f"{piece}/dims", 1)]
        else:
            new.append(const_int(piece, [n]))
        pieces.append(piece)
    joined = node(name, "ConcatV2", [*pieces, f"{name}/axis"], T=INT32, Tidx=INT32)
    joined.attr["N"].i = len(pieces)
    return [*new, const_int(f"{name}/axis", 0), joined]


def _rewire(nodes, rewired):
    """Every input of ``nodes`` named in ``rewired`` reads its value there."""
    for reader in nodes:
        for i, name in enumerate(reader.input):
            if not name.startswith("^"):
                reader.input[i] = rewired.get(ir.tensor_name(*ir.split_tensor(name)), name)


def _flow(graph_def) -> nx.DiGraph:
    """The GraphDef's own data flow (the IR's inputs are canonicalised: they
    skip casts and identities, which the rewiring must see)."""
    flow = nx.DiGraph()
    for n in graph_def.node:
        flow.add_node(n.name)
        flow.add_edges_from((ir.split_tensor(t.lstrip("^"))[0], n.name) for t in n.input)
    return flow


def _split_head(graph_def, flow, z, out, outputs, terms, prefix):
    """Rewires the ops from ``z`` to ``terms`` that pass no other output (the
    loss head) to read ``out`` for ``z``; those of them that also lead to
    another output are copied, under ``prefix``, reading ``z`` itself, for
    the ops on the way to that output. Returns the copies."""
    start = ir.split_tensor(z)[0]
    others = set(outputs) - {start}
    rest = flow.subgraph(set(flow) - others)
    ends = {ir.split_tensor(t)[0] for t in terms} & set(rest)
    head = (nx.descendants(rest, start) & set().union(
        *(nx.ancestors(rest, e) | {e} for e in ends)))
    upstream = set().union(*(nx.ancestors(flow, o) | {o} for o in others))
    shared = head & upstream
    by_name = {n.name: n for n in graph_def.node}
    copied, copies = {f"{name}": f"{prefix}/{name}" for name in shared}, []
    for name in shared:
        copy = type(by_name[name])()
        copy.CopyFrom(by_name[name])
        copy.name = copied[name]
        copies.append(copy)
    _rewire_nodes(copies, copied)
    _rewire_nodes([n for n in graph_def.node if n.name in upstream - head], copied)
    _rewire([n for n in graph_def.node if n.name in head],
            {ir.tensor_name(*ir.split_tensor(z)): out})
    return copies


def _rewire_nodes(readers, renamed):
    """Every input of ``readers`` from a node named in ``renamed`` reads the
    same output of the node it names."""
    for reader in readers:
        for i, name in enumerate(reader.input):
            node, index = ir.split_tensor(name.lstrip("^"))
            if node in renamed:
                reader.input[i] = ("^" + renamed[node] if name.startswith("^")
                                   else ir.tensor_name(renamed[node], index))
