"""Tessel's modules import one another without a circle, and each package only from the packages below it."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
# Which packages each package may import from (docs/ARCHITECTURE.md): the runtime never reaches up into the
# compiler, the IR depends on nothing else of ours.
ALLOWED = {
    "ir": set(),
    "passes": {"ir"},
    "backends": {"ir"},
    "runtime": {"ir", "passes", "backends"},
    "compiler": {"ir", "passes", "backends", "runtime"},
}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the five packages: dotted name → (file, whether it is a package's __init__)."""
    found = {}
    for package in ALLOWED:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(["tessel", *(parts[:-1] if is_package else parts)])] = (path, is_package)
    return found


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import statements under `if TYPE_CHECKING:`: they never run, so they close no circle."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return skipped


def _imported(node: ast.AST, package: str) -> list[str]:
    """Dotted names an import statement reaches, relative ones resolved against `package`."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [f"{prefix}.{alias.name}" for alias in node.names]


def import_graph() -> nx.DiGraph:
    """Module → module edges for every import statement, at the top level or inside functions."""
    modules = _modules()
    graph = nx.DiGraph()
    for module, (path, is_package) in modules.items():
        graph.add_node(module)
        tree = ast.parse(path.read_text())
        skipped = _type_checking_only(tree)
        package = module if is_package else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            for name in _imported(node, package):
                # `from tessel.ir.graph import Graph` reaches tessel.ir.graph: strip names until a module matches.
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    graph.add_edge(module, name)
    return graph


def test_the_graph_sees_top_level_relative_and_function_level_imports():
    graph = import_graph()
    assert graph.has_edge("tessel.passes.placement", "tessel.passes.collectives")  # relative, top level
    assert graph.has_edge("tessel.compiler.worker_programs", "tessel.runtime.profile")  # absolute
    assert graph.has_edge("tessel.runtime.calibrate", "tessel.runtime.launch")  # inside a function
    assert not graph.has_edge("tessel.ir.graph", "tessel.ir.attributes")  # only under TYPE_CHECKING


def test_no_module_imports_itself_through_others():
    cycles = list(nx.simple_cycles(import_graph()))
    assert cycles == [], "import circles: " + "; ".join(" -> ".join(c + c[:1]) for c in cycles)


def test_each_package_imports_only_from_the_packages_below_it():
    wrong = sorted(f"{a} imports {b}" for a, b in import_graph().edges
                   if b.split(".")[1] != a.split(".")[1] and b.split(".")[1] not in ALLOWED[a.split(".")[1]])
    assert wrong == []
