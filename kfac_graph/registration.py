"""What the pass found: the layers, the loss, and a readable report.

``Registration`` is the public result of auto-registration. It holds
``Layer``s (one per set of weights, with every use of them) and a
``LossSpec``; both are frozen. Tensor names refer to the inlined graph the
pass analysed (``Registration.graph_def``), which later passes rewrite.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import networkx as nx
import numpy as np
import tensorflow as tf

from kfac_graph import layers as layer_kinds
from passes.errors import LOSS_HOW_TO
from passes.loss_sizes import SizeDivisor

KINDS = tuple(layer_kinds.KINDS)


@dataclasses.dataclass(frozen=True)
class GraphVariable:
    """Stands in for a variable known only by name (the GraphDef front end)."""
    name: str
    shape: tuple
    dtype: str


@dataclasses.dataclass(frozen=True, eq=False)
class Layer:
    """One set of weights and every place the graph applies them.

    ``variables``: kernel (or scale) first, then bias (or shift) if any.
    ``uses``: how many times the weights are applied. Per use ``i``:
    ``inputs[i]`` the tensors read (the activation; for scale-and-shift the
    tensors its normaliser reads, see ``use_attrs[i]["normalizer"]``; for an
    embedding the ids), ``outputs[i]`` the pre-activation tensor produced,
    ``use_attrs[i]`` the op's attributes, ``ops[i]`` the matched IR nodes.
    ``reason`` says why a layer is ``"generic"``.
    """
    name: str
    kind: str
    variables: tuple
    uses: int
    inputs: tuple[tuple[str, ...], ...] = ()
    outputs: tuple[str, ...] = ()
    use_attrs: tuple[Mapping[str, Any], ...] = ()
    ops: tuple[tuple[str, ...], ...] = ()
    reason: str = ""

    @property
    def attrs(self) -> Mapping[str, Any]:
        """The first use's op attributes (all uses of a layer share its kind)."""
        return self.use_attrs[0] if self.use_attrs else {}

    @property
    def num_parameters(self) -> int:
        return int(sum(np.prod(_shape(v)) for v in self.variables))


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """The loss's predictive distribution, read from the graph.

    ``L = scale * (1/B) * sum_i -log p(y_i | z_i)`` for ``reduction="mean"``
    (drop the ``1/B`` for ``"sum"``); ``output`` names ``z`` (logits for
    categorical and bernoulli, the mean for normal, whose variance is 1/2),
    ``targets`` names ``y``.

    A per-token loss (``z`` ``[B, T, K]``, targets ``[B, T]``) has
    ``l_i = sum_t w_it * -log p(y_it | z_it)``: ``weights`` names the data
    tensors the terms are multiplied (or masked) by, ``divisors`` those the
    loss is divided by (the ``sum(w)`` of a masked mean, a batch statistic
    held constant for the batch), ``sizes`` the divisors that are sizes
    known at run time only, such as the positions' count T of a mean traced
    with sizes ``None`` (``passes.loss_sizes.SizeDivisor``); ``w_it`` is read
    at run time as the loss's derivative by token ``it``'s term
    (``LayerTaps.token_weights``), and is 1 when all three are empty.

    A ``"ggn"`` loss is no likelihood but has a model output
    (``passes.loss_output``: Huber, focal, Poisson, KL, cosine): ``l_i`` is
    example ``i``'s own share of its terms, ``scale`` 1, no ``targets``; its
    curvature is ``l_i``'s Hessian at ``z`` (``kfac_graph.fisher.ggn``), and
    ``reason`` says why it is no likelihood the pass reads.

    An ``"opaque"`` loss has no ``output`` or ``targets``: ``l_i`` is example
    ``i``'s own share of the terms the pass read down to (``Registration.
    per_example_loss``), ``scale`` 1, and ``reason`` says where its reading
    stopped (``no_fisher``).

    ``penalties`` names the terms added to the loss that depend on the
    variables alone (a weight penalty, ``R`` in ``L = ... + R``): they are in
    every example's gradient, and in no Fisher (``passes.loss_terms``);
    ``summed_penalties``, those of them added to every example's term of a
    summed loss, are in the batch's loss once per example.

    ``blocks``: a ``"ggn"`` loss over joined outputs beyond ``MAX_CLASSES``
    values per example has a block-diagonal Hessian, ``(n, K)`` per block
    along ``z``'s columns (``kfac_graph.fisher.ggn_blocks``); empty: whole.
    ``likelihood_blocks``, per block: the terms of the categorical heads whose
    Fisher the block is (``K x K`` per position, no backward pass; a
    word-piece masked-LM head beside a next-sentence head), or ``()``
    where the block is the loss's Hessian.

    ``nonnegative``: the loss is ``>= 0`` for any input, its weights taken
    ``>= 0``: a likelihood's terms (``passes.match_loss.KINDS``) or terms
    proven ``>= 0`` (``passes.loss_bounds``: absolute, Huber, hinge
    losses), and every penalty and added term proven so (the quadratic
    model's cap needs it, ``kfac_graph.optimizer.qmodel``)."""
    kind: str
    reduction: str = "mean"
    output: str | None = None
    targets: str | None = None
    scale: float = 1.0
    weights: tuple[str, ...] = ()
    divisors: tuple[str, ...] = ()
    sizes: tuple[SizeDivisor, ...] = ()
    reason: str = ""
    penalties: tuple[str, ...] = ()
    summed_penalties: tuple[str, ...] = ()
    blocks: tuple[tuple[int, int], ...] = ()
    nonnegative: bool = False
    likelihood_blocks: tuple[tuple[str, ...], ...] = ()

    @property
    def no_fisher(self) -> str:
        """Why there is no Fisher at this loss ('' where there is one): an
        ``"opaque"`` loss (per-example terms of a loss the pass does not read
        as a negative log-likelihood, ``passes.match_loss``; ``reason``: where
        its reading stopped) has no predictive distribution."""
        if self.output is not None:
            return ""
        if self.kind != "opaque":
            return ("the loss pass found no model output to take the Fisher at"
                    + (f" ({self.reason})" if self.reason else "") + f"; {LOSS_HOW_TO}")
        return (f"the loss is opaque ({self.reason}): kfac_graph has its per-example terms "
                "but no predictive distribution, so its Fisher can only be the empirical one "
                "(estimation_mode=\"empirical\"; kg.KFAC with momentum_type=\"regular\" or "
                f"qmodel_curvature=\"kfac\"); if it is a negative log-likelihood, {LOSS_HOW_TO}")

    @property
    def weighted(self) -> bool:
        """Whether tokens (or examples) carry weights read at run time: from
        data, or sizes known at run time only."""
        return bool(self.weights or self.divisors or self.sizes)

    @property
    def data_weighted(self) -> bool:
        """Whether tokens (or examples) carry weights read from data."""
        return bool(self.weights or self.divisors)

    @property
    def size_scaled(self) -> bool:
        """Whether the loss divides by sizes known at run time alone (a mean
        over an axis traced as ``None``): its tokens' weights are then
        ``w_it = s m_it``, ``s`` the product of ``1 / size`` (``1/T``) and
        ``m_it`` the data's (1 without data weights), and ``s`` is read at
        run time as a factor of the curvature's scale, not of the tokens
        (``LayerTaps.size_scale``), as the constant ``scale`` holds it at
        known sizes; so the Fisher's tokens, and the factors, read alike at
        any size. (A ``"ggn"`` loss's Hessian, and an ``"opaque"`` loss's
        terms, hold ``s`` themselves.)"""
        return bool(self.sizes) and self.output is not None and self.kind != "ggn"

    @property
    def divided_by(self) -> tuple[str, ...]:
        """The data divisors' names and the sizes' in words."""
        return self.divisors + tuple(s.words for s in self.sizes)


@dataclasses.dataclass(frozen=True, eq=False)
class Registration:
    """Layers and loss, plus what later passes need to re-run the graph:
    ``graph_def`` (functions inlined), ``arguments`` (its argument
    placeholders, in flattened order), ``output`` (the loss tensor),
    ``variable_placeholders`` (placeholder node -> variable object),
    ``variable_reads`` (placeholder node -> its ReadVariableOp nodes), and
    ``per_example_loss`` with ``per_example_coefficient`` (example i's own
    loss term is the coefficient times the sum of ``per_example_loss[i]``,
    plus each of ``per_example_extras``' ``(terms, coefficient)`` read the
    same way: terms added beside the likelihood's, ``passes.loss_terms``),
    ``handle_readers`` (placeholder node -> the ops on the loss's path that
    take the variable's handle itself rather than a read of it, such as a
    loop the pass did not unroll: reads inside them cannot be replaced),
    ``coupling`` (the ops where one example's loss comes to depend on other
    examples: ``passes.coupling``, and the ``IdentityN`` of a replayed custom
    gradient whose function reads across them, ``passes.gradient_coupling``;
    DP-SGD refuses such a loss), and
    ``captured_resources`` (placeholder node -> the resource handle it
    stands for, a lookup table's: the re-run graph captures it), and
    ``batch_statistics`` (the ops that reduce the data alone over the
    examples on the way to the loss, a masked mean's ``sum(mask)``:
    ``passes.coupling.batch_statistics``; DP-SGD refuses such a loss), and
    ``padded_to_longest`` (the ops that pad ragged data to the batch's
    longest row, ``passes.coupling.padded_to_longest``; DP-SGD refuses
    those too), and ``replica_reads`` (the name scopes where the trace read
    across replicas, each answered with one device's own values:
    ``passes.one_device``; K-FAC refuses such a loss under several replicas)."""
    layers: tuple[Layer, ...]
    loss: LossSpec
    graph_def: Any = dataclasses.field(default=None, repr=False, compare=False)
    arguments: tuple[str, ...] = ()
    output: str = ""
    ir: nx.DiGraph | None = dataclasses.field(default=None, repr=False, compare=False)
    timings: Mapping[str, float] = dataclasses.field(default_factory=dict, compare=False)
    variable_placeholders: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    variable_reads: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict,
                                                                      repr=False)
    per_example_loss: str | None = None
    per_example_coefficient: float = 1.0
    handle_readers: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict,
                                                                      repr=False)
    coupling: tuple[str, ...] = ()
    per_example_extras: tuple[tuple[str, float], ...] = ()
    constraints: tuple = dataclasses.field(default=(), repr=False, compare=False)
    captured_resources: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False,
                                                              compare=False)
    batch_statistics: tuple[str, ...] = ()
    padded_to_longest: tuple[str, ...] = ()
    replica_reads: tuple[str, ...] = ()
    # terms tensor -> the model output whose positions lay out its rows (a loss over
    # several outputs: a per-token head's terms come flattened to [B T])
    term_outputs: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def variables(self) -> tuple:
        """Every trainable variable the loss depends on, in layer order."""
        return tuple(v for layer in self.layers for v in layer.variables)

    def apply_constraints(self):
        """``v.assign(c(v))`` for each variable Keras gave a constraint ``c``
        (``kernel_constraint=NonNeg()``, ``MaxNorm``, ...), as Keras's
        optimizers do after every update; ``kg.KFAC`` and ``kg.DPSGD`` call
        it after theirs. ``constraints``: ``(variable, c)`` pairs."""
        for v, constraint in self.constraints:
            v.assign(tf.cast(constraint(tf.convert_to_tensor(v)), v.dtype))

    @property
    def generic_variables(self) -> tuple:
        """The variables of generic layers (their per-example gradients need
        the variables' own reads, ``LayerTaps.build(read_variables=...)``)."""
        return tuple(v for layer in self.layers if layer.kind == layer_kinds.GENERIC
                     for v in layer.variables)

    def summary(self) -> str:
        """A table: one row per layer, then the loss."""
        rows = [("#", "layer", "kind", "variables", "uses", "params")]
        for i, layer in enumerate(self.layers):
            shapes = ", ".join("x".join(map(str, _shape(v))) or "scalar" for v in layer.variables)
            rows.append((str(i), layer.name, layer.kind, shapes, str(layer.uses),
                         f"{layer.num_parameters:,}"))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        line = lambda r: "  ".join(s.ljust(w) for s, w in zip(r, widths)).rstrip()  # noqa: E731
        out = [line(rows[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in rows[1:]]
        total = sum(layer.num_parameters for layer in self.layers)
        out.append(f"{len(self.layers)} layers, {total:,} parameters")
        loss = self.loss
        extras = ", ".join(t for t, _ in self.per_example_extras)
        out.append(f"loss: {loss.kind}, {loss.reduction} over the batch"
                   + (f"; per-example terms {self.per_example_loss}" if not loss.output else "")
                   + (f", scale {loss.scale:g}" if loss.scale != 1.0 else "")
                   + (f"; output {loss.output}" if loss.output else "")
                   + (" (curvature: the loss's Hessian there" + (
                       ", in blocks " + ", ".join(_block_text(n, k, head) for (n, k), head in zip(
                           loss.blocks, loss.likelihood_blocks or [()] * len(loss.blocks)))
                       if loss.blocks else "") + ")" if loss.kind == "ggn" else "")
                   + (f"; targets {loss.targets}" if loss.targets else "")
                   + (f"; weights {', '.join(loss.weights)}" if loss.weights else "")
                   + (f"; divided by {', '.join(loss.divided_by)}" if loss.divided_by else "")
                   + (f"; per-example terms added {extras}" if extras else "")
                   + (f"; penalties {', '.join(loss.penalties)}" if loss.penalties else ""))
        if self.per_example_loss is None and loss.reason:
            out.append(f"no per-example terms read ({loss.reason}): a per-example gradient is "
                       "the example's share of the batch gradient (DP-SGD refuses the loss)")
        if self.coupling:
            out.append(f"examples meet at: {', '.join(self.coupling)} (DP-SGD refuses the loss)")
        if self.batch_statistics:
            out.append(f"statistics of the batch's data: {', '.join(self.batch_statistics)} "
                       "(DP-SGD refuses the loss)")
        if self.padded_to_longest:
            out.append(f"padded to the batch's longest row: {', '.join(self.padded_to_longest)}"
                       " (DP-SGD refuses the loss)")
        if self.constraints:
            out.append("constraints applied after each update: " + ", ".join(
                f"{v.name} {getattr(c, '__name__', type(c).__name__)}"
                for v, c in self.constraints))
        for layer in self.layers:
            if layer.reason:
                out.append(f"{layer.kind} {layer.name}: {layer.reason}")
        return "\n".join(out)

    def as_dict(self) -> dict:
        """The registration as plain data (JSON-serialisable): per layer its
        name, kind, variables (name, shape, dtype), uses, input and output
        tensors and reason; the loss; and the variables in gradient order."""
        layers = [{"name": layer.name, "kind": layer.kind,
                   "variables": [_variable_dict(v) for v in layer.variables],
                   "uses": layer.uses, "parameters": layer.num_parameters,
                   "inputs": [list(i) for i in layer.inputs], "outputs": list(layer.outputs),
                   **({"reason": layer.reason} if layer.reason else {})}
                  for layer in self.layers]
        return {"layers": layers, "loss": dataclasses.asdict(self.loss),
                "variables": [_variable_dict(v)["name"] for v in self.variables]}

    def to_dot(self, path: str | None = None) -> str:
        """A Graphviz DOT picture of the analysed graph, each matched layer's
        ops filled with its kind's colour. Writes it to ``path`` if given."""
        colour, label = {}, {}
        for layer in self.layers:
            for ops in layer.ops:
                for node in ops:
                    colour[node] = layer_kinds.kind(layer.kind).colour
                    label[node] = layer.name
        lines = ["digraph kfac_graph {", "  rankdir=TB;", '  node [shape=box, fontsize=10];']
        g = self.ir
        ids = {n: f"n{i}" for i, n in enumerate(g.nodes)} if g is not None else {}
        for node, i in ids.items():
            op = g.nodes[node]["op"]
            style = f', style=filled, fillcolor="{colour[node]}"' if node in colour else ""
            lines.append(f'  {i} [label="{_escape(node)}\\n{op}"{style}];')
        if g is not None:
            for u, v in g.edges:
                lines.append(f"  {ids[u]} -> {ids[v]};")
        lines.append("}")
        text = "\n".join(lines) + "\n"
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _shape(v) -> tuple:
    """The variable's shape; () when unknown (a GraphDef without shapes)."""
    shape = v.shape
    if shape is None or getattr(shape, "rank", 0) is None:
        return ()
    return tuple(shape.as_list()) if hasattr(shape, "as_list") else tuple(shape)


def _variable_dict(v) -> dict:
    dtype = getattr(v.dtype, "name", v.dtype)
    name = getattr(v, "path", None) or v.name  # a Keras 3 variable's path is unique
    return {"name": name.removesuffix(":0"),
            "shape": list(_shape(v)), "dtype": str(dtype)}


def _block_text(n, k, head) -> str:
    """A block of the loss's Hessian: ``PxKxK`` (``?`` positions: read at
    run time), "categorical" where it is a likelihood's Fisher."""
    size = f"{n // k if n else '?'}x({k}x{k})" if n != k else f"{n}x{n}"
    return f"{size} categorical" if head else size
