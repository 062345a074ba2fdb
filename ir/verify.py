"""The verifier: checks the IR invariants every pass must keep."""
from __future__ import annotations

from .errors import VerificationError
from .graph import Graph, Node
from .schema import InferenceFailure, get_schema


def verify(graph: Graph) -> None:
    """Raise VerificationError listing every violated invariant of `graph`."""
    problems = check(graph)
    if problems:
        raise VerificationError(problems)


def check(graph: Graph) -> list[str]:
    """Every invariant `graph` violates, as readable sentences (empty when it is valid)."""
    problems: list[str] = []
    _check_names(graph, problems)
    _check_scope(graph, set(), problems)
    return problems


def _check_names(graph: Graph, problems: list[str]) -> None:
    seen_values: set[str] = set()
    seen_nodes: set[str] = set()

    def visit(g: Graph) -> None:
        for value in g.values():
            if value.name in seen_values:
                problems.append(f"value name '{value.name}' is defined twice")
            seen_values.add(value.name)
        for node in g.nodes:
            if node.name in seen_nodes:
                problems.append(f"node name '{node.name}' is used twice")
            seen_nodes.add(node.name)
            for sub in node.subgraphs():
                visit(sub)

    visit(graph)


def _check_scope(graph: Graph, outer: set[int], problems: list[str]) -> None:
    """Check one graph whose enclosing scopes define the values whose ids are in `outer`."""
    defined = set(outer)
    defined.update(id(v) for v in graph.inputs)
    defined.update(id(v) for v in graph.constants)
    produced_here = {id(out) for node in graph.nodes for out in node.outputs if out is not None}
    for value in list(graph.inputs) + list(graph.constants):
        if value.graph is not graph:
            problems.append(f"value '{value.name}' is listed in graph '{graph.name}' but owned by '{value.graph.name}'")
    for node in graph.nodes:
        where = f"node '{node.name}' ({node.op_type})"
        if node.graph is not graph:
            problems.append(f"{where} is listed in graph '{graph.name}' but owned by '{node.graph.name}'")
        for index, value in enumerate(node.inputs):
            if value is None:
                continue
            if id(value) not in defined:
                if id(value) in produced_here:
                    problems.append(f"{where} reads '{value.name}' before it is produced (nodes out of order, or a cycle)")
                else:
                    problems.append(f"{where} reads '{value.name}', which is not defined in its scope (dangling value)")
            if (node, index) not in value.uses:
                problems.append(f"{where}: input {index} '{value.name}' does not list the node among its uses")
        for sub in node.subgraphs():
            if sub.parent is not graph:
                problems.append(f"{where}: subgraph '{sub.name}' does not name graph '{graph.name}' as its parent")
            _check_scope(sub, defined, problems)
        for out in node.outputs:
            if out is not None:
                if out.producer is not node:
                    problems.append(f"{where}: output '{out.name}' names another producer")
                defined.add(id(out))
        _check_node_types(node, where, problems)
    for value in graph.values():
        for user, index in value.uses:
            if index >= len(user.inputs) or user.inputs[index] is not value:
                problems.append(f"value '{value.name}' lists a use by '{user.name}' input {index} that reads something else")
            elif not _attached(user):
                problems.append(f"value '{value.name}' lists a use by '{user.name}', which is no longer in any graph")
    for value in graph.outputs:
        if id(value) not in defined:
            problems.append(f"graph '{graph.name}' returns '{value.name}', which is not defined in its scope")
    _check_acyclic(graph, problems)


def _attached(node: Node) -> bool:
    """True when the node is in its graph and that graph hangs from a node of its parent, up to the root."""
    while True:
        graph = node.graph
        if node not in graph.nodes:
            return False
        if graph.parent is None:
            return True
        owner = next((n for n in graph.parent.nodes if any(sub is graph for sub in n.subgraphs())), None)
        if owner is None:
            return False
        node = owner


def _check_node_types(node: Node, where: str, problems: list[str]) -> None:
    schema = get_schema(node.op_type, node.domain)
    if schema is None:
        problems.append(f"{where}: op {node.domain + '::' if node.domain else ''}{node.op_type} has no schema")
        return
    unknown = sorted(set(node.attrs) - set(schema.attributes))
    if unknown:
        problems.append(f"{where}: unknown attributes {unknown}")
        return
    types = [v.type if v is not None else None for v in node.inputs]
    data = [v.const if v is not None else None for v in node.inputs]
    try:
        inferred = schema.infer(node.attrs, types, data, len(node.outputs))
    except InferenceFailure as exc:
        problems.append(f"{where}: type inference fails: {exc}")
        return
    for index, (out, expected) in enumerate(zip(node.outputs, inferred)):
        if out is not None and out.type != expected:
            problems.append(f"{where}: output {index} '{out.name}' is typed {out.type}, but its inputs give {expected}")


def _check_acyclic(graph: Graph, problems: list[str]) -> None:
    producers: dict[int, Node] = {id(n): n for n in graph.nodes}
    edges: dict[int, set[int]] = {id(n): set() for n in graph.nodes}
    for node in graph.nodes:
        for value in node.dependencies():
            if value.producer is not None and id(value.producer) in producers:
                edges[id(node)].add(id(value.producer))
    state: dict[int, int] = {}
    for start in edges:
        if state.get(start):
            continue
        stack = [(start, iter(edges[start]))]
        state[start] = 1
        while stack:
            key, deps = stack[-1]
            nxt = next(deps, None)
            if nxt is None:
                state[key] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                problems.append(f"graph '{graph.name}' has a cycle through node '{producers[nxt].name}'")
                return
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(edges[nxt])))
