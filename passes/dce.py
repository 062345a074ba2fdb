"""Dead-code elimination: remove nodes and constants nothing reads."""
from __future__ import annotations

from tessel.ir.graph import Graph
from tessel.ir.op_traits import op_traits

from .base import Pass, PassResult, unread, graphs_in


def _is_dead(node) -> bool:
    return not op_traits(node.op_type).side_effects and unread(node)


def dce(graph: Graph) -> PassResult:
    """Remove every node whose outputs are all unread (except side-effecting ops), then unread constants."""
    removed_nodes = removed_constants = 0
    for g in graphs_in(graph):
        for node in reversed(list(g.nodes)):
            if _is_dead(node):
                g.remove_node(node)
                removed_nodes += 1
    # Constants last: removing nodes above frees the constants they read, in every scope.
    for g in graphs_in(graph):
        for value in list(g.constants):
            if not value.uses and not value.is_graph_output:
                g.remove_constant(value)
                removed_constants += 1
    changed = bool(removed_nodes or removed_constants)
    return PassResult(graph, changed, {"nodes_removed": removed_nodes, "constants_removed": removed_constants})


DCE = Pass("dce", dce)
