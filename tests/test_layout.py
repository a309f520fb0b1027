"""The code's layout keeps the architecture's promises: small files, imports
in one direction (tools -> kfac_graph -> passes), no cycles between modules,
one table of layer kinds, and public façades that nothing inside imports."""
import ast
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("kfac_graph", "passes", "tools")
# the public entry points: only the package's __init__ (and tools) import them
FACADES = ("kfac_graph.per_example_api", "kfac_graph.dp", "kfac_graph.estimator",
           "kfac_graph.optimizer", "kfac_graph.keras_fit", "kfac_graph.emit")
MAX_LINES = 400


def _modules():
    """``{module name: path}`` for every Python file of the packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name, path):
    """The project modules ``name`` imports (a package's own ``__init__`` for
    ``from package import name`` when ``name`` is not a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = nx.DiGraph([(m, t) for m, p in MODULES.items() for t in _imports(m, p)])
GRAPH.add_nodes_from(MODULES)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_file_over_the_limit(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name].relative_to(ROOT)} has {lines} lines"


def test_no_import_cycle():
    # a package's __init__ re-exporting its own modules is not a cycle of ideas
    edges = [(a, b) for a, b in GRAPH.edges if not b.startswith(a + ".")]
    cycles = list(nx.simple_cycles(nx.DiGraph(edges)))
    assert not cycles, f"import cycles: {cycles[:3]}"


def test_imports_point_one_way():
    for module, target in GRAPH.edges:
        if module.startswith("passes"):
            assert not target.startswith(("kfac_graph", "tools")), (module, target)
        if module.startswith("kfac_graph") and module != "kfac_graph.__main__":
            assert not target.startswith("tools"), (module, target)


def test_facades_are_imported_only_by_the_package():
    for facade in FACADES:
        internal = {m for m in GRAPH.predecessors(facade)
                    if m.startswith("kfac_graph") and m != "kfac_graph"
                    and not m.startswith(facade + ".")}
        assert not internal, f"{facade} is imported by {sorted(internal)}"


def test_layer_kinds_know_nothing_of_their_users():
    for module, target in GRAPH.edges:
        if module.startswith("kfac_graph.layers"):
            assert target.startswith("kfac_graph.layers"), (module, target)


def test_one_table_of_kinds():
    from kfac_graph import fisher, layers, registration
    from kfac_graph.fisher import block_choice
    from kfac_graph.per_example import default_registry

    assert registration.KINDS == tuple(layers.KINDS)
    assert set(fisher.DEFAULT_BLOCKS) == set(layers.KINDS) == set(block_choice.ALIASES)
    with_rules = {name for name, record in layers.KINDS.items() if record.rule is not None}
    assert set(default_registry().kinds) == with_rules
