"""Low-rank adapters (LoRA): a dense kernel ``K = W0 + s A B``.

Keras 3's ``Dense.enable_lora(r)`` and ``EinsumDense.enable_lora(r)`` (and
keras-hub's ``Backbone.enable_lora``, which calls them) freeze the layer's
kernel ``W0`` and apply ``K = W0 + s * matmul(A, B)`` with trainable
``A [*lead, r]`` and ``B [r, n]`` (``s = alpha / r``; the product broadcasts
over ``A``'s leading axes, so ``K`` is ``[*lead, n]``). Such a layer is two
dense layers in a row, ``y = x W0 + s (x A) B`` (for a kernel of rank > 2,
along K's leading axes):

- A is a dense layer on ``x``, contracted on K's contracted axes, whose
  output gradient is ``s g B^T`` at each of K's output axes but the last;
- B is a dense layer on ``s x A``, applied at every position and every
  one of those output axes, whose output gradient is ``g``.

A table ``K [V, d]`` looked up by ids (``Embedding.enable_lora``) gives
``K[ids] = W0[ids] + s A[ids] B``: A is a lookup of the same ids whose
output gradient is ``s g B^T``, and B a dense layer on ``s A[ids]``.

So each gets the dense kind's exact per-example rule and its Kronecker block
(``kfac_graph/layers/lora.py`` makes those operands from the use's input,
the output gradient and the read of the other variable); the Fisher's
cross terms between A and B are dropped, as between any two layers.

Contract:

- ``mark_lora(g) -> g``: returns ``g``, or a copy in which the last node of
  every adapter's kernel chain carries ``lora`` = ``{"key", "a", "b", "base",
  "scale", "rank", "reads", "ops"}``: the chain is a ``MatMul`` of two
  trainable whole variables (A maybe reshaped to 2-D first, the product
  maybe reshaped to ``[*lead, n]``), maybe times a scalar constant ``s``,
  maybe plus a constant or a whole variable ``W0`` of its shape, each link
  read by the next alone; ``reads`` are the tensors of A and B it reads,
  ``ops`` its nodes, ``base`` W0's key where it is trainable (else None),
  ``key`` the group key layer patterns give it (``param_key``).
  Layer patterns take such a node wherever they take a kernel variable.
- ``split_lora(g, groups, detach_bias) -> groups``: the matcher's groups
  ``{(kind, keys): [(pattern, roles, Use)]}`` with every group whose kernel
  is an adapter's replaced by a ``"dense"`` group of A (an ``"embedding"``
  group where the kernel is a table looked up: Keras's
  ``Embedding.enable_lora``) and a ``"dense"`` group of B (each
  use's ``attrs["lora"]`` says its ``role``, ``"a"`` or ``"b"``; its inputs
  are the activation and the other variable's read), and its bias, split
  off by ``detach_bias(roles, use)``, a shift layer of its own; a trainable
  W0 is a dense layer of its own with the kernel's use (Keras's frozen
  flag does not survive a SavedModel: there W0 is trainable). A kernel
  the op permutes keeping its last axis last (Gemma's ``"btd,ndh->btnh"``)
  is the adapter of the permuted ``A``. An adapter read by another kind of
  layer, or by a dense op that transposes it, moves its last axis or stacks
  it, becomes a group of A and B whose uses say why
  (``attrs["unsupported"]``): the caller leaves them generic.
"""
from __future__ import annotations

import collections
import dataclasses
import networkx as nx

from passes import ir

_MATMULS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})
_TRANSPOSED = ("transpose_a", "transpose_b", "adj_x", "adj_y")
_REFUSED = (("transpose_kernel", "applies it transposed"),
            ("stacked_rows", "stacks it with another kernel"),
            ("output_perm", "interleaves its output axes"), ("parts", "reads a part of it"))
_LOOKUP_FORMS = ("ids_broadcast", "row_range", "grad_perm")


def param_key(g: nx.DiGraph, node: str):
    """The variable key a layer pattern's parameter role gives a group: the
    variable's, or for an adapter's kernel a key of its own."""
    data = g.nodes[node]
    return data["variable"] if data.get("lora") is None else data["lora"]["key"]


def mark_lora(graph: nx.DiGraph) -> nx.DiGraph:
    """The module docstring's contract."""
    found = {}
    for node, data in graph.nodes(data=True):
        if data["op"] in _MATMULS and not any(data["attrs"].get(k) for k in _TRANSPOSED):
            chain = _chain(graph, node)
            if chain is not None:
                found[chain[0]] = chain[1]
    if not found:
        return graph
    g = graph.copy()
    for top, info in found.items():
        g.nodes[top]["lora"] = info
    return g


def _trainable(g, node) -> bool:
    data = g.nodes[node]
    key = data.get("variable")
    return (data["op"] == "Variable" and key is not None and data.get("part") is None
            and g.graph["variables"][key].trainable)


def _operand(g, node, slot):
    """``(variable node, read tensor, via)``: the trainable whole variable
    input ``slot`` of ``node`` reads, maybe through a Reshape read by
    ``node`` alone (``via``); else None."""
    src = ir.split_tensor(g.nodes[node]["inputs"][slot])[0]
    via = ()
    if g.nodes[src]["op"] == "Reshape" and g.out_degree(src) == 1:
        via, src = (src,), ir.split_tensor(g.nodes[src]["inputs"][0])[0]
    if not _trainable(g, src):
        return None
    reader, k = (via[0], 0) if via else (node, slot)
    return src, g.nodes[reader]["raw_inputs"][k], via


def _only_reader(g, node):
    readers = ir.consumers(g, ir.tensor_name(node))
    return readers[0] if len(readers) == 1 and g.out_degree(node) == 1 else (None, None)


def _other(g, node, slot):
    """The tensor ``node`` (a binary op) reads beside input ``slot``."""
    return g.nodes[node]["inputs"][1 - slot]


def _chain(g, matmul):
    """``(top node, lora info)`` of the adapter chain from ``matmul``, or None."""
    a, b = _operand(g, matmul, 0), _operand(g, matmul, 1)
    if a is None or b is None or a[0] == b[0]:
        return None
    shape_a, shape_b = (g.graph["variables"][g.nodes[v[0]]["variable"]].shape for v in (a, b))
    if (not shape_a or not shape_b or len(shape_a) < 2 or len(shape_b) != 2
            or None in shape_a or None in shape_b or shape_a[-1] != shape_b[0]):
        return None
    want = (*shape_a[:-1], shape_b[1])
    top, ops, scale = matmul, [*a[2], matmul], 1.0
    nxt, slot = _only_reader(g, top)
    if nxt is not None and g.nodes[nxt]["op"] == "Reshape" and g.nodes[nxt]["shapes"][0] == want:
        top, ops = nxt, ops + [nxt]
        nxt, slot = _only_reader(g, top)
    if nxt is not None and g.nodes[nxt]["op"] == "Mul":
        value = ir.const_value(g, _other(g, nxt, slot))
        if value is not None and value.size == 1:
            top, ops, scale = nxt, ops + [nxt], float(value.reshape(()))
            nxt, slot = _only_reader(g, top)
    base = None
    if nxt is not None and g.nodes[nxt]["op"] in ("Add", "AddV2"):
        node = ir.split_tensor(_other(g, nxt, slot))[0]
        whole = g.nodes[node]["op"] == "Const" or (
            g.nodes[node]["op"] == "Variable" and g.nodes[node].get("variable") is not None
            and g.nodes[node].get("part") is None)
        if whole and ir.shape_of(g, _other(g, nxt, slot)) == want:
            top, ops = nxt, ops + [nxt]
            base = g.nodes[node]["variable"] if _trainable(g, node) else None
    shapes = g.nodes[top]["shapes"]
    if not shapes or tuple(shapes[0] or ()) != want:
        return None
    keys = (g.nodes[a[0]]["variable"], g.nodes[b[0]]["variable"])
    return top, {"key": ("lora", top), "a": keys[0], "b": keys[1], "base": base, "scale": scale,
                 "rank": int(shape_b[0]), "reads": (a[1], b[1]), "ops": tuple(ops)}


def split_lora(g: nx.DiGraph, groups: dict, detach_bias) -> dict:
    """The module docstring's contract (``groups`` is not modified)."""
    out = collections.defaultdict(list)
    for (kind, keys), items in groups.items():
        adapters = [k for k in keys if isinstance(k, tuple)]
        if not adapters:
            out[(kind, keys)].extend(items)
            continue
        info = g.nodes[adapters[0][1]]["lora"]
        mine = (info["a"], info["b"]) + ((info["base"],) if info["base"] else ())
        for pattern, roles, use in items:
            why = _refusal(kind, keys, use)
            if why:  # A and B (and the rest) stay generic, saying why
                attrs = {**use.attrs, "unsupported": f"its low-rank adapter's kernel {why}"}
                others = tuple(k for k in keys if not isinstance(k, tuple))
                out[(kind, mine + others)].append((pattern, roles, dataclasses.replace(
                    use, ops=tuple(use.ops) + info["ops"], attrs=attrs)))
                continue
            if len(keys) > 1:  # its bias: a shift layer of its own
                use, shift = detach_bias(roles, use)
                out[("scale_and_shift", keys[1:])].append(shift)
            ops = tuple(use.ops) + info["ops"]
            if info["base"] is not None:  # W0 trainable: a dense layer of its own, as applied
                out[("dense", (info["base"],))].append(
                    (pattern, roles, dataclasses.replace(use, ops=ops)))
            for role, key, read in (("a", info["a"], info["reads"][1]),
                                    ("b", info["b"], info["reads"][0])):
                a_kind = kind if role == "a" else "dense"  # a lookup's A is a lookup too
                out[(a_kind, (key,))].append((pattern, roles, _role_use(
                    g, use, info, role, read, ops, roles[pattern.params[0]], kind)))
    return dict(out)


def _refusal(kind, keys, use) -> str:
    if kind not in ("dense", "embedding"):
        return f"is read by a layer of kind {kind!r}, which has no adapter form here"
    if kind == "embedding" and any(use.attrs.get(k) for k in _LOOKUP_FORMS):
        return "is looked up by ids without an example axis"
    if not isinstance(keys[0], tuple) or any(isinstance(k, tuple) for k in keys[1:]):
        return "is not the layer's one kernel"  # (a stacked form's is refused below)
    perm = use.attrs.get("kernel_perm")
    if perm and perm[-1] != len(perm) - 1:
        return "is read by an op that moves its last axis"
    return next((f"is read by an op that {what}" for attr, what in _REFUSED
                 if use.attrs.get(attr)), "")


def _role_use(g, use, info, role, read, ops, kernel, kind):
    """The use of A (``role`` "a") or B ("b"): the activation and the other
    variable's ``read``; ``lora`` holds the kernel's shape and contracted
    axes as the op applies it (its ``kernel_in_axes``, else all but the
    last), the op's permutation of the kernel (``perm``: A's too, as it
    keeps the last axis last; B is applied as it is), A's shape (its
    read may have lost unit axes) and whether the kernel is looked up."""
    perm = use.attrs.get("kernel_perm")
    stored = tuple(g.nodes[kernel]["shapes"][0])
    shape = tuple(stored[p] for p in perm) if perm else stored
    k = use.attrs.get("kernel_in_axes") or len(shape) - 1
    attrs = {key: value for key, value in use.attrs.items()
             if key not in ("kernel_in_axes", "kernel_perm") or role == "a"}
    attrs["lora"] = {"role": role, "scale": info["scale"], "rank": info["rank"],
                     "kernel_shape": shape, "kernel_in_axes": k, "perm": perm,
                     "a_shape": (*stored[:-1], info["rank"]),
                     "lookup": kind == "embedding"}
    attrs["name_suffix"] = f"/lora_{role}"
    return dataclasses.replace(use, inputs=(use.inputs[0], read), ops=ops, attrs=attrs)
