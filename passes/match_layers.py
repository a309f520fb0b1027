"""Match layers: find every dense, conv (plain, depthwise, transposed),
scale-and-shift and embedding layer on the loss's path, group shared weights,
and list orphans.

Contract: ``match_layers(g, rows) -> tuple[LayerMatch, ...]`` on a canonical IR
(``rows``: ``example_rows.graph_rows(g)``).
Each trainable variable the loss depends on belongs to exactly one
``LayerMatch``; layers come in the order their first use appears in the
graph, and their uses in graph order. A variable that no pattern claims, or
that is also read outside its layer's patterns, becomes a ``"generic"`` layer
whose ``reason`` says why.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Mapping

import networkx as nx

from passes import batch_flow, ir, scale_shift_use
from passes.atrous import atrous_attrs
from passes.bias_shift import bias_as_shift, detach_bias, without_bias
from passes.layer_names import readable, scope_name, unique_names
from passes.lookup_ids import ids_without_batch
from passes.matcher import find_matches, role_output
from passes.catalogue import LAYER_PATTERNS
from passes.unflatten_rows import unflatten_rows
from passes.patterns import Pattern, einsum_kernel_layout, var_shape, weighted_roles, whole_kernel
from passes.patterns_reshaped import kernel_matrix
from passes.patterns_stacked import STACKED_PATTERNS
from passes.patterns_multiaxis import einsum_perms, kernel_in_axes, kernel_perm, slice_rows
from passes.patterns_position import TABLE_ROWS, part_rows
from passes.lora import param_key, split_lora
from passes.tied_embedding import merge_tied
from passes.unroll import WHILE_OPS

_TRANSPOSE_KINDS = frozenset({"conv2d_transpose", "conv3d_transpose"})
_CONV_KINDS = frozenset({"conv2d", "conv3d", "depthwise_conv2d"}) | _TRANSPOSE_KINDS
_KERNEL_KINDS = _CONV_KINDS | {"dense"}
_OP_ATTRS = ("strides", "dilations", "padding", "explicit_paddings", "data_format",
             "transpose_a", "transpose_b", "adj_x", "adj_y", "equation", "epsilon",
             "is_training", "exponential_avg_factor")


@dataclasses.dataclass(frozen=True)
class Use:
    """One application of a layer's weights.

    ``inputs``: the tensors this use reads (the activation; for
    scale-and-shift the tensors its normaliser needs; for an embedding the
    ids). ``output``: the pre-activation tensor it produces. ``ops``: the IR
    nodes of the match. ``attrs``: the main op's attributes plus ``op``,
    ``input_shape``, ``output_shape`` and, where it applies,
    ``transpose_kernel``, ``kernel_in_axes`` (a dense kernel of rank > 2: how
    many leading axes are contracted; ``kernel_matrix``: ``(d_in, d_out)`` of
    a kernel reshaped to another matrix, ``passes.patterns_reshaped``;
    ``kernel_perm``: of the kernel after a Transpose, ``passes.patterns_multiaxis``;
    ``stacked_rows``: the rows of a kernel made of several variables, ``x @ W
    + h @ R`` read as ``[x, h] @ [W; R]``, ``passes.patterns_stacked``),
    ``ids_broadcast`` (a lookup whose ids have no batch axis, added over the
    batch; ``row_range``: those ids are ``range(*row_range)``, a table slice
    or its rows broadcast over the batch), for scale-and-shift ``normalizer``,
    ``operand_shapes`` and ``scale_broadcast`` (``passes.scale_shift_use``),
    ``unsupported`` (why the form has no exact layer of its kind: the layer
    then becomes generic), ``parts`` (per variable, the box of it the use
    reads, or None: ``passes.variable_parts``), and for convolutions
    ``kernel_shape`` and ``input_channels`` (a grouped Conv2D's kernel reads a
    share of them). An atrous convolution's are those of the dilated
    convolution on the input of SpaceToBatchND (``passes.atrous``).
    """
    inputs: tuple[str, ...]
    output: str
    ops: tuple[str, ...]
    attrs: Mapping


@dataclasses.dataclass(frozen=True)
class LayerMatch:
    kind: str
    name: str
    variables: tuple[str, ...]
    uses: tuple[Use, ...]
    reason: str = ""
    generic_uses: int = 0  # for a generic layer: the ops on the loss path that read it

    @property
    def num_uses(self) -> int:
        return len(self.uses) or self.generic_uses


def match_layers(g: nx.DiGraph, rows: dict) -> tuple[LayerMatch, ...]:
    output_node = ir.split_tensor(g.graph["output"])[0]
    on_path = nx.ancestors(g, output_node) | {output_node}
    data = ir.reachable_from(g, g.graph["arguments"])
    batched = data | ir.reachable_from(g, batch_flow.batch_sources(g))
    order = _data_flow_order(g, data)
    undirected = g.to_undirected(as_view=True)

    spread = batched | ir.reachable_from(g, batch_flow.batch_copies(g))
    find = lambda patterns: _find(g, patterns, on_path, spread, undirected)
    grouped = _group(g, find(LAYER_PATTERNS))
    if _stacked_kernels_shared(grouped):
        grouped = _group(g, find(tuple(p for p in LAYER_PATTERNS if p not in STACKED_PATTERNS)))
    grouped = unflatten_rows(split_lora(g, grouped, functools.partial(detach_bias, g)), rows, g)

    holders = collections.defaultdict(list)
    for node, d in g.nodes(data=True):
        if d.get("variable") is not None:
            holders[d["variable"]].append(node)
    readers = {key: [dst for node in nodes for dst in g.successors(node)]
               for key, nodes in holders.items()}
    groups = ids_without_batch(g, grouped, data, rows)
    reaching = on_path & (batched | batch_flow.weights_into_data(g, on_path, batched))
    groups, reasons = _resolve_conflicts(g, groups, reaching, readers)
    layers = [_layer(g, kind, keys, uses, order) for (kind, keys), uses in groups.items()]
    owned = {k for layer in layers for k in layer.variables}
    for key in _loss_variables(g, on_path, order):
        if key not in owned:
            reason = reasons.get(key) or _orphan_reason(g, readers[key], on_path, batched)
            n_reads = sum(1 for n in readers[key] if n in on_path)
            layers.append(_generic(g, key, reason, max(n_reads, 1)))
    layers.sort(key=lambda layer: _first_position(layer, order, readers))
    return tuple(unique_names(layers))


def _find(g, patterns, on_path, batched, undirected) -> list:
    """``(pattern, roles)`` of every match on the loss's path, ``patterns``
    tried in order, each op claimed by the first that takes it."""
    found = []
    claimed: set[str] = set()
    for pattern in patterns:
        weighted = weighted_roles(pattern)
        for roles in find_matches(g, pattern, claimed, undirected):
            if roles[pattern.output] not in on_path:
                continue
            inputs = _inputs(g, pattern, roles) or (ir.tensor_name(roles[pattern.output]),)
            source = ir.node_of(g, inputs[0])  # (a tiled weight: itself)
            if source not in batched and pattern.kind != "embedding":
                continue  # a product of weights or constants, the same for every example
                # (ids held in a variable are ids: CLIP's)
            if _leaks(g, pattern, roles, weighted, on_path):
                continue
            claimed |= {roles[r] for r, spec in pattern.nodes.items() if spec.exclusive}
            found.append((pattern, roles))
    return found


def _leaks(g, pattern: Pattern, roles, weighted, on_path) -> bool:
    """Whether an op inside the match that depends on its weights
    (``weighted``: a dense product before its bias) is also read outside it
    on the loss's path: the layer's output would then miss that path (XLNet
    adds three biases to one bias-free query projection; taking one of them
    as the projection's bias dropped the other two paths from the kernel's
    gradient)."""
    inner = {roles[r] for r in pattern.nodes}
    return any(s in on_path and s not in inner for r in weighted for s in g.successors(roles[r]))


def _stacked_kernels_shared(groups) -> bool:
    """Whether a variable of a stacked dense layer (``passes.patterns_stacked``)
    is also in another group: a kernel summed with another in some uses and
    applied alone in others. The pass then matches each product on its own
    (one dense layer per kernel, the bias a shift), the form every use fits."""
    stacked = [keys for (kind, keys), items in groups.items()
               if any(p in STACKED_PATTERNS for p, _, _ in items)]
    if not stacked:
        return False
    count = collections.Counter(k for _, keys in groups for k in keys)
    return any(count[k] > 1 for keys in stacked for k in keys)


def _inputs(g, pattern: Pattern, roles) -> tuple[str, ...]:
    out = []
    for role, where, k in pattern.inputs:
        node = roles[role]
        out.append(g.nodes[node]["raw_inputs"][k] if where == "in"
                   else ir.real_tensor(g, role_output(g, pattern, roles, role, k)))
    return tuple(out)


def _group(g, found):
    """(kind, variable keys) -> list of (pattern, roles, Use)."""
    groups = collections.defaultdict(list)
    for pattern, roles in found:
        keys = tuple(param_key(g, roles[p]) for p in pattern.params)
        groups[(pattern.kind, keys)].append((pattern, roles, _use(g, pattern, roles)))
    return groups


def _use(g, pattern: Pattern, roles) -> Use:
    main = roles.get("op") or roles.get("mul") or roles.get("add") or roles[pattern.anchor]
    data = g.nodes[main]
    attrs = {k: data["attrs"][k] for k in _OP_ATTRS if k in data["attrs"]}
    attrs["op"] = data["op"]
    inputs = _inputs(g, pattern, roles)
    attrs["input_shape"] = ir.shape_of(g, data["raw_inputs"][0]) if data["raw_inputs"] else None
    attrs["output_shape"] = data["shapes"][0] if data["shapes"] else None
    if pattern.kind == "dense":
        transposed = data["attrs"].get("transpose_b") or data["attrs"].get("adj_y")
        layout = (einsum_kernel_layout(data["attrs"]["equation"]) if data["op"] == "Einsum"
                  else ("oi" if transposed else "io"))
        attrs["transpose_kernel"] = (layout == "oi") != ("t" in roles)
        attrs["input_shape"] = ir.shape_of(g, inputs[0])
        k = kernel_in_axes(g, roles)
        if k is not None:
            attrs["kernel_in_axes"] = k
        if kernel_matrix(g, roles) is not None:  # passes.patterns_reshaped
            attrs["kernel_matrix"] = kernel_matrix(g, roles)
        attrs.update(einsum_perms(g, roles, attrs["input_shape"]))
        if "w2" in roles:  # a stacked kernel: the rows each variable gives it
            attrs["stacked_rows"] = tuple(int(var_shape(g, roles[r])[0]) for r in ("w", "w2"))
    if pattern.kind in _KERNEL_KINDS and kernel_perm(g, roles):
        attrs["kernel_perm"] = kernel_perm(g, roles)  # its kernel transposed before the op
    if pattern.kind == "embedding" and "add" in roles:
        attrs["ids_broadcast"] = True
        if "slice" in roles:
            attrs["row_range"] = slice_rows(g, roles)
        elif pattern.name in TABLE_ROWS:  # rows of the table added over the batch
            attrs["row_range"] = part_rows(g, roles)
    if pattern.kind in _CONV_KINDS:
        attrs["kernel_shape"] = whole_kernel(g, roles["w"], ir.shape_of(g, data["raw_inputs"][1]))
        attrs["input_channels"] = _channels(attrs["input_shape"], attrs.get("data_format"))
    if pattern.kind in _TRANSPOSE_KINDS:
        attrs.update(_transpose_attrs(g, data, inputs[0]))
    if "s2b" in roles:
        attrs.update(atrous_attrs(g, roles, inputs[0]))
    if pattern.kind == "scale_and_shift":
        inputs, attrs = scale_shift_use.use_attrs(g, pattern, roles, main, inputs, attrs)
    parts = tuple(g.nodes[roles[p]].get("part") for p in pattern.params)
    # (passes.variable_parts) per variable: its box, or None when whole; a
    # lookup's rows say it as row_range
    if any(parts) and "row_range" not in attrs:
        attrs["parts"] = parts
    nodes = tuple(roles[r] for r, spec in pattern.nodes.items() if spec.exclusive)
    return Use(inputs, ir.tensor_name(roles[pattern.output]), nodes, attrs)


def _transpose_attrs(g, data, x):
    """Conv2DBackpropInput, Conv3DBackpropInputV2: the layer's input is ``out_backprop`` (slot 2);
    ``input_sizes`` (slot 0), the output's shape, when it is a constant."""
    attrs = {"input_shape": ir.shape_of(g, x)}
    sizes = ir.const_value(g, data["inputs"][0])
    if sizes is not None:
        attrs["input_sizes"] = tuple(int(s) for s in sizes)
    return attrs


def _channels(shape, data_format):
    """The channel count of a 4-D or 5-D convolution input (None when
    unknown): a grouped Conv2D's kernel reads ``channels / groups`` of them."""
    if not shape or len(shape) not in (4, 5):
        return None
    return shape[1] if _channels_first(data_format) else shape[-1]


def _channels_first(data_format) -> bool:
    fmt = data_format.decode() if isinstance(data_format, bytes) else (data_format or "NHWC")
    return fmt.upper().startswith("NC")


def _resolve_conflicts(g, groups, on_path, readers):
    """Makes each variable belong to one group. ``on_path``: the ops on the
    loss's path that depend on the data (a weight penalty's reads do not).

    A kernel shared by uses with different biases (tied weights) keeps one
    group for the kernel and gives each bias its own shift-only layer; a
    table both looked up and projected onto is one tied embedding
    (``passes.tied_embedding``). A
    variable claimed by groups of different kinds, read outside its matches,
    or used in a form its kind cannot state exactly (``attrs["unsupported"]``:
    a fused batch norm whose normalised input cannot be recovered, an atrous
    convolution with no exact dilated form) is left to the generic fallback
    with the reason."""
    reasons = {}
    groups = dict(groups)
    by_kernel = collections.defaultdict(list)
    for kind, keys in groups:
        by_kernel[keys[0]].append((kind, keys))
    for kernel, owners in by_kernel.items():
        kinds = {kind for kind, _ in owners}
        if len(owners) > 1 and len(kinds) == 1 and kinds <= _KERNEL_KINDS:
            merged = []
            for owner in owners:
                for pattern, roles, use in groups.pop(owner):
                    merged.append((pattern, roles, without_bias(g, use, roles)))
                    if len(owner[1]) > 1:
                        shift = bias_as_shift(g, roles, use)
                        groups.setdefault(("scale_and_shift", (owner[1][1],)), []).append(shift)
            groups[(owners[0][0], (kernel,))] = merged
    groups = merge_tied(groups, functools.partial(detach_bias, g))
    owners_of = collections.defaultdict(set)
    for group in groups:
        for key in group[1]:
            owners_of[key].add(group)
    for key, owners in owners_of.items():
        if len(owners) > 1:
            for owner in owners:
                groups.pop(owner, None)
            kinds = ", ".join(sorted(kind for kind, _ in owners))
            reasons[key] = f"its weights are used by layers of different kinds ({kinds})"
    for group, items in list(groups.items()):
        claimed = {n for _, _, use in items for n in use.ops}
        for key in group[1]:
            outside = [n for n in readers[key] if n in on_path and n not in claimed]
            if outside:
                groups.pop(group, None)
                for k in group[1]:
                    reasons[k] = (_loop_reason(g, outside) or
                                  f"also read outside its layer pattern, by op {outside[0]!r}")
                break
        else:
            why = [use.attrs["unsupported"] for _, _, use in items if "unsupported" in use.attrs]
            if why:
                groups.pop(group)
                for k in group[1]:
                    reasons[k] = why[0]
    return groups, reasons


def _loss_variables(g, on_path, order):
    keys = {}
    for node in on_path:
        key = g.nodes[node].get("variable")
        if key is not None and g.graph["variables"][key].trainable:
            keys.setdefault(key, order[node])
    return sorted(keys, key=lambda k: (keys[k], k))


def _orphan_reason(g, readers, on_path, batched) -> str:
    loop = _loop_reason(g, [n for n in readers if n in on_path])
    if loop:
        return loop
    used = [n for n in readers if n in on_path]
    alone = used and not any(ir.split_tensor(t)[0] in batched for n in used
                             for t in g.nodes[n]["inputs"])
    ops = ", ".join(sorted({g.nodes[n]["op"] for n in used})) or "the graph"
    return (f"no layer pattern matches its use by {ops}"
            + ("; it meets no example there (the same for every example)" if alone else ""))


def _loop_reason(g, readers) -> str:
    """Why a variable read by a loop the pass kept is generic ("" if none
    of ``readers`` is such a loop)."""
    loops = sorted(n for n in readers if g.nodes[n]["op"] in WHILE_OPS)
    if not loops:
        return ""
    why = g.graph.get("loops", {}).get(loops[0], "")
    return f"read inside loop {readable(loops[0])!r}, which is not unrolled" + (
        f": {why}" if why else "")


def _layer(g, kind, keys, items, order) -> LayerMatch:
    uses = sorted((use for _, _, use in items), key=lambda u: order[ir.split_tensor(u.output)[0]])
    nodes = list(uses[0].ops) if uses else []
    if uses and uses[0].attrs.get("ids_broadcast"):
        nodes = nodes[:1]  # a position embedding: named by its lookup, not the sum
    suffix = uses[0].attrs.get("name_suffix", "") if uses else ""  # an adapter's A or B
    return LayerMatch(kind, scope_name(nodes) + suffix, keys, tuple(uses))


def _generic(g, key, reason, n_reads) -> LayerMatch:
    name = g.graph["variables"][key].name.split(":")[0]
    return LayerMatch("generic", name, (key,), (), reason, n_reads)


def _data_flow_order(g, data) -> dict:
    """A position per node that follows the data: a data-dependent node's
    longest distance from the arguments; a node computed from weights or
    constants alone sits just before its first data-dependent consumer (so
    BatchNorm's rsqrt(var) * gamma, or an RNN's first step on a zero state,
    is placed where it meets the data). Ties break by topological order."""
    topo = list(nx.topological_sort(g))
    depth = {}
    for n in topo:
        if n in data:
            depth[n] = max((depth[p] for p in g.predecessors(n) if p in data), default=-1) + 1
    for n in reversed(topo):
        if n not in data:
            later = [depth[s] for s in g.successors(n) if s in depth]
            depth[n] = min(later) - 0.5 if later else float(len(topo))
    return {n: (depth[n], i) for i, n in enumerate(topo)}


def _first_position(layer: LayerMatch, order, readers) -> tuple:
    if layer.uses:
        return (order[ir.split_tensor(layer.uses[0].output)[0]], layer.name)
    return (min([order[n] for n in readers.get(layer.variables[0], ())] or [(0, 0)]), layer.name)
