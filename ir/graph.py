"""The graph IR: values, nodes and graphs with use-def links.

Only this module edits use-def links. A `Value` knows its producer (a node,
or none for graph inputs and constants) and its uses; `Graph` keeps nodes in
topological order and offers the few edits passes need, with
`replace_all_uses_with` as the one way to rewire consumers.
"""
from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from .errors import VerificationError
from .types import TensorType

if TYPE_CHECKING:
    from .attributes import Attributes


class Value:
    """A tensor in the graph: a graph input, a constant, or a node output."""

    __slots__ = ("name", "type", "graph", "producer", "const", "_uses")

    def __init__(self, name: str, type: TensorType, graph: "Graph"):
        self.name = name
        self.type = type
        self.graph = graph
        self.producer: Node | None = None
        self.const: np.ndarray | None = None
        self._uses: list[tuple[Node, int]] = []

    @property
    def uses(self) -> list[tuple["Node", int]]:
        """(node, input index) pairs that read this value, in insertion order."""
        return list(self._uses)

    @property
    def is_constant(self) -> bool:
        """True when the value holds compile-time data."""
        return self.const is not None

    @property
    def is_graph_input(self) -> bool:
        """True when the value is one of its graph's inputs."""
        return self.producer is None and self.const is None

    @property
    def is_graph_output(self) -> bool:
        """True when its graph returns this value."""
        return any(out is self for out in self.graph.outputs)

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


class Node:
    """One operation: an op type from a domain, typed attributes, inputs and outputs.

    Inputs and outputs may hold None where an optional ONNX input or output is
    omitted.
    """

    __slots__ = ("name", "op_type", "domain", "attrs", "graph", "_inputs", "outputs")

    def __init__(self, name: str, op_type: str, domain: str, attrs: "Attributes", graph: "Graph"):
        self.name = name
        self.op_type = op_type
        self.domain = domain
        self.attrs = attrs
        self.graph = graph
        self._inputs: list[Value | None] = []
        self.outputs: list[Value | None] = []

    @property
    def inputs(self) -> tuple[Value | None, ...]:
        """The node's inputs; rewire them through `Graph.set_input` or `replace_all_uses_with`."""
        return tuple(self._inputs)

    def subgraphs(self) -> list["Graph"]:
        """Graphs held in attributes (If branches), in attribute order."""
        return [v for v in self.attrs.values() if isinstance(v, Graph)]

    def captured_values(self) -> list[Value]:
        """Values from enclosing scopes that this node's subgraphs read, without duplicates."""
        seen: dict[int, Value] = {}
        for sub in self.subgraphs():
            for value in sub.outer_values():
                seen.setdefault(id(value), value)
        return list(seen.values())

    def dependencies(self) -> list[Value]:
        """Every value the node needs before it runs: inputs and captured values."""
        return [v for v in self._inputs if v is not None] + self.captured_values()

    def __repr__(self) -> str:
        return f"Node({self.name!r}, {self.domain + '::' if self.domain else ''}{self.op_type})"


class Graph:
    """A dataflow graph: inputs, constants, nodes in topological order, outputs.

    A graph held by an If node is a subgraph: `parent` is the enclosing graph,
    and its nodes may read values of enclosing graphs directly.
    """

    def __init__(self, name: str = "main", parent: "Graph | None" = None):
        self.name = name
        self.parent = parent
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.nodes: list[Node] = []
        self.constants: list[Value] = []
        # Names of the constants that are the model's float initializers (set by a training import, see from_onnx).
        self.initializers: frozenset[str] = frozenset()
        self._names: set[str] = set()
        self._node_names: set[str] = set()
        self._values: dict[str, Value] = {}

    # ---- names -------------------------------------------------------------
    def _root(self) -> "Graph":
        graph = self
        while graph.parent is not None:
            graph = graph.parent
        return graph

    def _all_value_names(self) -> set[str]:
        return self._root()._names

    def unique_name(self, base: str) -> str:
        """A value name not used anywhere in this graph's scope tree, based on `base`."""
        names = self._all_value_names()
        if base and base not in names:
            return base
        base = base or "v"
        for i in itertools.count(1):
            candidate = f"{base}_{i}"
            if candidate not in names:
                return candidate
        raise AssertionError("unreachable")

    def unique_node_name(self, base: str) -> str:
        """A node name not used in this graph's scope tree, based on `base`."""
        names = self._root()._node_names
        if base and base not in names:
            return base
        for i in itertools.count(1):
            candidate = f"{base}_{i}"
            if candidate not in names:
                return candidate
        raise AssertionError("unreachable")

    def _new_value(self, name: str, type: TensorType) -> Value:
        name = self.unique_name(name)
        value = Value(name, type, self)
        self._all_value_names().add(name)
        self._values[name] = value
        return value

    def lookup(self, name: str) -> Value | None:
        """The value called `name` in this graph or an enclosing one, or None."""
        graph: Graph | None = self
        while graph is not None:
            if name in graph._values:
                return graph._values[name]
            graph = graph.parent
        return None

    def values(self) -> Iterator[Value]:
        """Every value owned by this graph: inputs, constants, node outputs."""
        yield from self.inputs
        yield from self.constants
        for node in self.nodes:
            yield from (v for v in node.outputs if v is not None)

    # ---- construction ------------------------------------------------------
    def add_input(self, name: str, type: TensorType) -> Value:
        """Append a graph input."""
        value = self._new_value(name, type)
        self.inputs.append(value)
        return value

    def add_constant(self, name: str, array: np.ndarray) -> Value:
        """Add a constant holding `array` (stored read-only; a read-only contiguous array is shared, not copied)."""
        if not (isinstance(array, np.ndarray) and array.flags.c_contiguous and not array.flags.writeable):
            array = np.array(array, order="C")
            array.setflags(write=False)
        value = self._new_value(name, TensorType.of(array))
        value.const = array
        self.constants.append(value)
        return value

    def add_node(
        self,
        op_type: str,
        inputs: Sequence[Value | None],
        attrs: "Attributes",
        output_types: Sequence[TensorType | None],
        *,
        name: str = "",
        output_names: Sequence[str] | None = None,
        domain: str = "",
        before: Node | None = None,
    ) -> Node:
        """Create a node and its outputs; appended, or inserted before `before`.

        An output type of None omits that optional output.
        """
        node = Node(self.unique_node_name(name or op_type), op_type, domain, attrs, self)
        self._root()._node_names.add(node.name)
        for value in inputs:
            self._check_visible(value)
        node._inputs = list(inputs)
        for i, value in enumerate(inputs):
            if value is not None:
                value._uses.append((node, i))
        names = list(output_names) if output_names is not None else [""] * len(output_types)
        for i, (out_name, out_type) in enumerate(zip(names, output_types)):
            if out_type is None:
                node.outputs.append(None)
                continue
            value = self._new_value(out_name or f"{node.name}_out{i}", out_type)
            value.producer = node
            node.outputs.append(value)
        for sub in node.subgraphs():
            sub.parent = self
        if before is None:
            self.nodes.append(node)
        else:
            self.nodes.insert(self.nodes.index(before), node)
        return node

    def _check_visible(self, value: Value | None) -> None:
        if value is None:
            return
        graph: Graph | None = self
        while graph is not None:
            if value.graph is graph:
                return
            graph = graph.parent
        raise ValueError(f"value {value.name!r} belongs to graph {value.graph.name!r}, not visible from {self.name!r}")

    # ---- rewiring ----------------------------------------------------------
    def set_input(self, node: Node, index: int, value: Value | None) -> None:
        """Make input `index` of `node` read `value`."""
        node.graph._check_visible(value)
        old = node._inputs[index]
        if old is not None:
            old._uses.remove((node, index))
        node._inputs[index] = value
        if value is not None:
            value._uses.append((node, index))

    def replace_all_uses_with(self, old: Value, new: Value) -> None:
        """Make every reader of `old` (nodes in any scope, graph outputs) read `new`."""
        if old is new:
            return
        for node, index in list(old._uses):
            node.graph.set_input(node, index, new)
        graph = old.graph
        graph.outputs = [new if out is old else out for out in graph.outputs]

    def remove_node(self, node: Node) -> None:
        """Remove a node whose outputs are unused and not graph outputs."""
        for out in node.outputs:
            if out is not None and (out._uses or out.is_graph_output):
                raise ValueError(f"cannot remove node {node.name!r}: output {out.name!r} is still used")
        for index, value in enumerate(node._inputs):
            if value is not None:
                value._uses.remove((node, index))
        for sub in node.subgraphs():
            sub.release_uses()
        for out in node.outputs:
            if out is not None:
                self._forget(out)
        self.nodes.remove(node)
        self._root()._node_names.discard(node.name)

    def remove_constant(self, value: Value) -> None:
        """Remove an unused constant."""
        if value._uses or value.is_graph_output:
            raise ValueError(f"cannot remove constant {value.name!r}: it is still used")
        self.constants.remove(value)
        self._forget(value)

    def release_uses(self) -> None:
        """Make this graph's nodes (and their subgraphs') stop reading values of enclosing scopes:
        for a subgraph being thrown away, so its reads do not linger in other values' use lists."""
        for inner in self.walk_nodes():
            for index, value in enumerate(inner._inputs):
                if value is not None and (inner, index) in value._uses:
                    value._uses.remove((inner, index))

    def rename_value(self, value: Value, new_name: str) -> None:
        """Give `value` a new name, which must be unused in this graph's scope tree."""
        names = self._all_value_names()
        if new_name in names:
            raise ValueError(f"value name {new_name!r} is already used")
        owner = value.graph
        del owner._values[value.name]
        names.discard(value.name)
        value.name = new_name
        owner._values[new_name] = value
        names.add(new_name)

    def _forget(self, value: Value) -> None:
        del self._values[value.name]
        self._all_value_names().discard(value.name)

    # ---- order -------------------------------------------------------------
    def topological_sort(self) -> None:
        """Reorder nodes so each runs after its producers; raise VerificationError on a cycle.

        Keeps the current order wherever it is already valid.
        """
        producers = {id(n): n for n in self.nodes}
        pending: dict[int, int] = {}
        readers: dict[int, list[Node]] = {}
        for node in self.nodes:
            deps = {id(v.producer) for v in node.dependencies() if v.producer is not None and id(v.producer) in producers}
            pending[id(node)] = len(deps)
            for dep in deps:
                readers.setdefault(dep, []).append(node)
        position = {id(n): i for i, n in enumerate(self.nodes)}
        ready = [(position[id(n)], id(n)) for n in self.nodes if pending[id(n)] == 0]
        heapq.heapify(ready)
        order: list[Node] = []
        while ready:
            _, key = heapq.heappop(ready)
            node = producers[key]
            order.append(node)
            for reader in readers.get(key, []):
                pending[id(reader)] -= 1
                if pending[id(reader)] == 0:
                    heapq.heappush(ready, (position[id(reader)], id(reader)))
        if len(order) != len(self.nodes):
            stuck = sorted(n.name for n in self.nodes if pending[id(n)] > 0)
            raise VerificationError([f"graph '{self.name}' has a cycle through nodes {', '.join(stuck[:5])}"])
        self.nodes = order

    # ---- views -------------------------------------------------------------
    def outer_values(self) -> list[Value]:
        """Values of enclosing graphs read by nodes of this graph (or its subgraphs), or returned by it."""
        found: dict[int, Value] = {}

        def visit(graph: Graph) -> None:
            for node in graph.nodes:
                for value in node._inputs:
                    if value is not None and not _owned_within(value.graph, self):
                        found.setdefault(id(value), value)
                for sub in node.subgraphs():
                    visit(sub)

        visit(self)
        for value in self.outputs:
            if not _owned_within(value.graph, self):
                found.setdefault(id(value), value)
        return list(found.values())

    def walk_nodes(self) -> Iterator[Node]:
        """Every node in this graph and, depth first, in its subgraphs."""
        for node in self.nodes:
            yield node
            for sub in node.subgraphs():
                yield from sub.walk_nodes()

    def to_networkx(self):
        """A networkx.MultiDiGraph view: one vertex per node (by name), one edge per value read.

        Graph inputs and constants appear as vertices of kind "input" or "constant";
        edges carry the value name and its type.
        """
        import networkx as nx

        g = nx.MultiDiGraph(name=self.name)
        for value in self.inputs:
            g.add_node(value.name, kind="input", type=str(value.type))
        for value in self.constants:
            g.add_node(value.name, kind="constant", type=str(value.type))
        for node in self.nodes:
            g.add_node(node.name, kind="op", op_type=node.op_type, domain=node.domain)
        for node in self.nodes:
            for value in node.dependencies():
                if value.graph is not self:
                    continue
                source = value.producer.name if value.producer is not None else value.name
                g.add_edge(source, node.name, value=value.name, type=str(value.type))
        return g

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, {len(self.inputs)} inputs, {len(self.nodes)} nodes, {len(self.outputs)} outputs)"


def _owned_within(graph: Graph, scope: Graph) -> bool:
    """True when `graph` is `scope` or nested inside it."""
    current: Graph | None = graph
    while current is not None:
        if current is scope:
            return True
        current = current.parent
    return False
