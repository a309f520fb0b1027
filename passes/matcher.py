"""A general subgraph matcher for patterns declared as data.

``find_matches(g, pattern, claimed)`` yields ``{role: node}`` for every place
the pattern's graph embeds in the IR (a subgraph monomorphism found by
``networkx.algorithms.isomorphism.DiGraphMatcher``) whose ops, edges and
predicates agree, and whose non-shared nodes are not yet claimed by another
match. To stay linear in the graph's size, each search runs on the small
neighbourhood of one anchor node (the pattern's ``anchor`` role), not on the
whole graph.
"""
from __future__ import annotations

import collections
from typing import Iterator

import networkx as nx
from networkx.algorithms import isomorphism

from passes import ir
from passes.patterns import Pattern

_HUB_DEGREE = 24  # the neighbourhood search does not expand through hubs


def pattern_graph(pattern: Pattern) -> nx.DiGraph:
    p = nx.DiGraph()
    for role, spec in pattern.nodes.items():
        p.add_node(role, spec=spec)
    for edge in pattern.edges:
        src, dst, slot = edge[:3]
        p.add_edge(src, dst, slot=slot)
    return p


def find_matches(g: nx.DiGraph, pattern: Pattern, claimed: set[str],
                 undirected=None) -> Iterator[dict[str, str]]:
    p = pattern_graph(pattern)
    shape = nx.Graph(list(p.edges))  # the roles' links alone (to_undirected deep-copies the specs)
    shape.add_nodes_from(p)
    radius = max(nx.single_source_shortest_path_length(shape, pattern.anchor).values())
    undirected = undirected if undirected is not None else g.to_undirected(as_view=True)
    anchor_spec = pattern.nodes[pattern.anchor]
    for anchor in list(g.nodes):
        if (anchor in claimed or not anchor_spec.accepts(g, anchor)
                or not _anchor_neighbours_fit(g, p, pattern.anchor, anchor)):
            continue
        near = _neighbourhood(undirected, anchor, radius)
        matcher = isomorphism.DiGraphMatcher(
            g.subgraph(near), p,
            node_match=lambda a, b: True, edge_match=lambda a, b: True)
        for mapping in _monomorphisms(matcher, g, p, pattern, anchor):
            roles = {role: node for node, role in mapping.items()}
            if any(roles[r] in claimed for r, spec in pattern.nodes.items() if spec.exclusive):
                continue
            if pattern.check is None or pattern.check(g, roles):
                yield roles
                break


def _anchor_neighbours_fit(g, p, role, node) -> bool:
    """A cheap filter before the search: each pattern neighbour of the anchor
    role has some accepted IR neighbour on the same side."""
    for src in p.predecessors(role):
        spec = p.nodes[src]["spec"]
        if not any(spec.accepts(g, n) for n in g.predecessors(node)):
            return False
    for dst in p.successors(role):
        spec = p.nodes[dst]["spec"]
        if not any(spec.accepts(g, n) for n in g.successors(node)):
            return False
    return True


def _monomorphisms(matcher, g, p, pattern, anchor):
    # Semantic checks are done here rather than through node_match so that
    # they can read the whole IR (shapes, attributes, neighbours).
    matcher.semantic_feasibility = lambda n_g, n_p: (
        (n_p != pattern.anchor or n_g == anchor) and p.nodes[n_p]["spec"].accepts(g, n_g)
        and _edges_agree(g, p, matcher, n_g, n_p))
    return matcher.subgraph_monomorphisms_iter()


def _edges_agree(g, p, matcher, n_g, n_p) -> bool:
    """Every pattern edge between n_p and an already-mapped role must be an IR
    edge into the right input slot."""
    core = matcher.core_2  # pattern role -> IR node, for roles mapped so far
    for src_p in p.predecessors(n_p):
        if src_p in core and not _slot_ok(g, core[src_p], n_g, p.edges[src_p, n_p]["slot"]):
            return False
    for dst_p in p.successors(n_p):
        if dst_p in core and not _slot_ok(g, n_g, core[dst_p], p.edges[n_p, dst_p]["slot"]):
            return False
    return True


def _slot_ok(g, src, dst, slot) -> bool:
    if not g.has_edge(src, dst):
        return False
    return slot is None or any(s == slot for _, s in g.edges[src, dst]["slots"])


def _neighbourhood(undirected, start, radius) -> set[str]:
    seen = {start: 0}
    queue = collections.deque([start])
    while queue:
        node = queue.popleft()
        depth = seen[node]
        if depth == radius or (node != start and undirected.degree(node) > _HUB_DEGREE):
            continue
        for nxt in undirected.neighbors(node):
            if nxt not in seen:
                seen[nxt] = depth + 1
                queue.append(nxt)
    return set(seen)


def role_output(g: nx.DiGraph, pattern: Pattern, roles: dict, role: str, k: int = 0) -> str:
    """The tensor of ``role``'s node that the match reads: the output its
    edge to the first role consuming it carries (a ``Split``'s second half
    is ``split:1``), else output ``k``."""
    node = roles[role]
    for src, dst, *_ in pattern.edges:
        if src == role and g.has_edge(node, roles[dst]):
            indices = {i for i, _ in g.edges[node, roles[dst]]["slots"]}
            if len(indices) == 1:
                return ir.tensor_name(node, indices.pop())
    return ir.tensor_name(node, k)
