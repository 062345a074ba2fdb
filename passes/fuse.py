"""Operator fusion: group nodes into kernels, as TVM's FuseOps does, and make each group one node.

Walking the graph in order, a node joins the group that produces one of its
inputs when the patterns allow it (passes/op_patterns.py):
- elementwise/broadcast ops join any group (into a conv/matmul/reduction's
  epilogue only when they keep its output shape);
- injective ops join groups without an anchor (conv, matmul or reduction);
- a reduction, conv or matmul joins a group of injective producers (a
  transpose, slice or pad feeding it) and becomes its anchor.
A group returns exactly one value, produced by its last node; other values
are read only inside it. When joining leaves a diamond (SiLU: x·sigmoid(x)),
the readers that close it join too. Each group of two or more nodes becomes a
`tessel::Fused` node whose `body` subgraph holds the members; the backend
lowers it to one kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tessel.ir.graph import Graph, Node, Value
from tessel.ir.op_traits import Pattern, op_traits
from tessel.ir.schema import FUSED, TESSEL_DOMAIN, get_schema

from .base import Pass, PassResult, graphs_in
from .op_patterns import pattern

MAX_GROUP_NODES = 32


@dataclass
class Group:
    """Nodes that become one kernel; `anchor` is the pattern of its conv/matmul/reduction (or opaque op), if any."""

    members: list[Node] = field(default_factory=list)
    anchor: Pattern | None = None

    @property
    def output(self) -> Value:
        return self.members[-1].outputs[0]


def _escaping(members: list[Node]) -> list[Value]:
    inside = {id(n) for n in members}
    result = []
    for node in members:
        for out in node.outputs:
            if out is not None and (out.is_graph_output or any(id(u) not in inside for u, _ in out.uses)):
                result.append(out)
    return result


class _Fuser:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.position = {id(n): i for i, n in enumerate(graph.nodes)}
        self.group_of: dict[int, Group] = {}

    def run(self) -> list[Group]:
        groups = []
        for node in self.graph.nodes:
            if id(node) in self.group_of:
                continue
            group = self._join(node)
            if group is None:
                group = Group([node], _anchor_of(pattern(node)))
                groups.append(group)
            for member in group.members:
                self.group_of[id(member)] = group
        return [g for g in groups if len(g.members) > 1]

    def _join(self, node: Node) -> Group | None:
        kind = pattern(node)
        if kind == Pattern.OPAQUE:
            return None
        candidates = []
        for value in node.inputs:
            if value is None or value.producer is None or value.graph is not self.graph:
                continue
            group = self.group_of.get(id(value.producer))
            if group is not None and group.output is value and self._allowed(group, node, value, kind):
                candidates.append(group)
        # Prefer the epilogue of a conv or matmul, then a reduction, then an injective chain.
        candidates.sort(key=lambda g: -(g.anchor or 0))
        for group in candidates:
            members = self._close(group, node)
            if members is not None:
                group.members = members
                if kind in (Pattern.REDUCTION, Pattern.OUT_EWISE_FUSABLE):
                    group.anchor = kind
                return group
        return None

    @staticmethod
    def _allowed(group: Group, node: Node, value: Value, kind: Pattern) -> bool:
        if group.anchor == Pattern.OPAQUE:
            return False
        if kind in (Pattern.ELEMWISE, Pattern.BROADCAST):
            return group.anchor is None or node.outputs[0].type.shape == value.type.shape
        if kind in (Pattern.INJECTIVE, Pattern.REDUCTION, Pattern.OUT_EWISE_FUSABLE):
            return group.anchor is None
        return False

    def _close(self, group: Group, node: Node) -> list[Node] | None:
        """The members after `node` joins, with the readers that close diamonds; None when it cannot join."""
        members = group.members + [node]
        while True:
            if len(members) > MAX_GROUP_NODES:
                return None
            escaping = _escaping(members)
            last = max(members, key=lambda n: self.position[id(n)])
            if len(escaping) == 1 and escaping[0].producer is last and not self._depends_on(members, last):
                return sorted(members, key=lambda n: self.position[id(n)])
            readers = [u for v in escaping for u, _ in v.uses if u not in members]
            # A returned value, or one read inside a branch, can never become internal.
            if any(v.is_graph_output for v in escaping) or any(u.graph is not self.graph for u in readers):
                return None
            reader = min(readers, key=lambda n: self.position[id(n)])
            if id(reader) in self.group_of or pattern(reader) > Pattern.BROADCAST:
                return None
            if group.anchor is not None and reader.outputs[0].type.shape != group.output.type.shape:
                return None
            members = members + [reader]

    def _depends_on(self, members: list[Node], last: Node) -> bool:
        """True when an input read from outside depends on a member (the group would then be in a cycle)."""
        inside = {id(n) for n in members}
        first = min(self.position[id(n)] for n in members)
        stack = [v.producer for n in members for v in n.inputs
                 if v is not None and v.producer is not None and id(v.producer) not in inside]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if id(node) in seen or node.graph is not self.graph or self.position[id(node)] < first:
                continue
            seen.add(id(node))
            if id(node) in inside:
                return True
            stack.extend(v.producer for v in node.dependencies() if v.producer is not None)
        return False


def _anchor_of(kind: Pattern) -> Pattern | None:
    return kind if kind in (Pattern.REDUCTION, Pattern.OUT_EWISE_FUSABLE, Pattern.OPAQUE) else None


MAX_PARAMETER_ELEMENTS = 4096
# Small constants of any type (Resize scales, a few coefficients) are parameters too.
MAX_SMALL_CONSTANT = 64


def _is_parameter(value: Value) -> bool:
    """A constant that shapes the computation (an index, shape, scale or scalar), not a weight."""
    if not value.is_constant:
        return False
    small = value.type.numel <= MAX_SMALL_CONSTANT
    return small or (not value.type.dtype.startswith("float") and value.type.numel <= MAX_PARAMETER_ELEMENTS)


def _make_fused_node(graph: Graph, group: Group) -> Node:
    """Replace the group's members by one Fused node holding them in its body."""
    members = group.members
    inside = {id(n) for n in members}
    external: list[Value] = []
    constants: list[Value] = []
    for node in members:
        for value in node.inputs:
            if value is None or (value.producer is not None and id(value.producer) in inside):
                continue
            chosen = constants if _is_parameter(value) else external
            if value not in chosen:
                chosen.append(value)
    anchor = next((n for n in members if pattern(n) >= Pattern.REDUCTION), members[0])
    name = graph.unique_node_name(f"fused_{anchor.name}")
    body = Graph(f"{name}_body", parent=graph)
    # Parameters (shapes, axes, scalars) move into the body, where type inference needs their data;
    # weights stay inputs, so groups share them.
    mapping = {id(v): body.add_input(f"{name}/{v.name}", v.type) for v in external}
    mapping.update({id(v): body.add_constant(f"{name}/{v.name}", v.const) for v in constants})
    for node in members:
        copy = body.add_node(
            node.op_type, [mapping[id(v)] if v is not None else None for v in node.inputs], node.attrs,
            [v.type if v is not None else None for v in node.outputs], name=f"{name}/{node.name}",
            output_names=[f"{name}/{v.name}" if v is not None else "" for v in node.outputs],
        )
        for old, new in zip(node.outputs, copy.outputs):
            if old is not None:
                mapping[id(old)] = new
    result = group.output
    body.outputs = [mapping[id(result)]]
    schema = get_schema(FUSED, TESSEL_DOMAIN)
    attrs = schema.make_attributes({"body": body}, name)
    fused = graph.add_node(FUSED, external, attrs, [result.type], name=name, domain=TESSEL_DOMAIN,
                           output_names=[f"{result.name}_fused"], before=members[-1])
    result_name = result.name
    graph.replace_all_uses_with(result, fused.outputs[0])
    for node in reversed(members):
        graph.remove_node(node)
    graph.rename_value(fused.outputs[0], result_name)
    for value in constants:
        if not value.uses and not value.is_graph_output and value.graph is graph:
            graph.remove_constant(value)
    return fused


def fuse(graph: Graph) -> PassResult:
    """Fuse nodes into groups, each replaced by one Fused node; returns group counts and bytes saved."""
    nodes_fused = bytes_saved = 0
    for g in graphs_in(graph):
        groups = _Fuser(g).run()
        for group in groups:
            # Values read only inside a group are never written to memory.
            bytes_saved += sum(out.type.nbytes for n in group.members[:-1] for out in n.outputs if out is not None)
            nodes_fused += len(group.members)
            _make_fused_node(g, group)
        if groups:
            _check_acyclic(g)
    return PassResult(graph, nodes_fused > 0,
                      {"groups": sum(1 for n in graph.walk_nodes() if n.op_type == FUSED),
                       "nodes_fused": nodes_fused, "intermediate_bytes_saved": bytes_saved})


def _check_acyclic(graph: Graph) -> None:
    import networkx as nx

    from tessel.ir.errors import VerificationError

    view = graph.to_networkx()
    if not nx.is_directed_acyclic_graph(view):
        raise VerificationError([f"fusion made a cycle in graph '{graph.name}': {nx.find_cycle(view)}"])
    graph.topological_sort()


def is_kernel(node: Node) -> bool:
    """True when the node runs as a kernel (not a view, a branch or a failure marker)."""
    traits = op_traits(node.op_type)
    if not traits.kernel:
        return False
    if traits.view:
        # Dropout's optional mask output needs a kernel when something reads it.
        extra = [v for v in node.outputs[1:] if v is not None and (v.uses or v.is_graph_output)]
        return node.outputs[0] is None or bool(extra)
    return True


def kernel_members(node: Node) -> tuple[list[Node], dict[int, Value]]:
    """The ops a kernel node runs, and its body's parameters (by id) mapped to the node's inputs."""
    if node.op_type == FUSED and "body" in node.attrs:
        body: Graph = node.attrs["body"]
        return list(body.nodes), {id(p): v for p, v in zip(body.inputs, node.inputs)}
    return [node], {}


def kernel_count(graph: Graph) -> int:
    """Kernel calls one run makes at most (If counts its larger branch; a Fused node is one kernel)."""
    total = 0
    for node in graph.nodes:
        if node.op_type == "If":
            total += max(kernel_count(b) for b in node.subgraphs())
        elif is_kernel(node):
            total += 1
    return total


FUSE = Pass("fuse", fuse)
