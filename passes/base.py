"""What every pass shares: the `Pass` and `PassResult` types and graph-walking helpers.

A pass is a named callable `Graph -> PassResult(graph, changed, stats)`. Passes
edit the graph in place through `ir.Graph`'s edit methods and return it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

from tessel.ir.graph import Graph, Node, Value
from tessel.ir.op_traits import op_traits
from tessel.ir.schema import get_schema


@dataclass
class PassResult:
    """A pass's output graph, whether it changed anything, and counts of what it did."""

    graph: Graph
    changed: bool
    stats: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Pass:
    """A named graph pass."""

    name: str
    run: Callable[[Graph], PassResult]

    def __call__(self, graph: Graph) -> PassResult:
        """Run the pass on `graph`."""
        return self.run(graph)


def graphs_in(graph: Graph) -> Iterator[Graph]:
    """`graph` and every subgraph nested in it, innermost first (so rewrites of a branch precede its If)."""
    for node in list(graph.nodes):
        for sub in node.subgraphs():
            yield from graphs_in(sub)
    yield graph


def single_user(value: Value) -> Node | None:
    """The one node that reads `value` (once), or None when it has other readers or is a graph output."""
    uses = value.uses
    if len(uses) != 1 or value.is_graph_output:
        return None
    return uses[0][0]


def constant_scalar(value: Value | None) -> float | None:
    """The value of a one-element constant, or None."""
    if value is None or not value.is_constant or value.type.numel != 1:
        return None
    return float(value.const.reshape(-1)[0])


def can_replace(old: Value, new: Value) -> bool:
    """True when `new` can stand in for `old` everywhere, graph outputs keeping their names."""
    if not old.is_graph_output:
        return True
    # `new` takes over the output's name, so it must be a fresh value of the same graph.
    return new.graph is old.graph and not new.is_graph_input and not new.is_graph_output


def retire(node: Node, replacements: Mapping[int, Value]) -> None:
    """Replace outputs of `node` (by position) with other values, remove it, and keep graph output names.

    Every output not in `replacements` must be unread; check `can_replace` first. Producers
    that nothing reads any more are removed as well.
    """
    graph = node.graph
    renames = []
    for index, new in replacements.items():
        old = node.outputs[index]
        if old.is_graph_output:
            renames.append((old.name, new))
        graph.replace_all_uses_with(old, new)
    inputs = [v for v in node.inputs if v is not None]
    graph.remove_node(node)
    for name, new in renames:
        new.graph.rename_value(new, name)
    # Producers left unread go too, so a later rewrite never matches a dead chain.
    removed = {id(node)}
    while inputs:
        producer = inputs.pop().producer
        if (producer is not None and id(producer) not in removed and producer.graph is graph
                and is_pure(producer) and unread(producer)):
            inputs.extend(v for v in producer.inputs if v is not None)
            graph.remove_node(producer)
            removed.add(id(producer))


def unread(node: Node) -> bool:
    """True when no node reads any output of `node` and none is a graph output."""
    return all(out is None or (not out.uses and not out.is_graph_output) for out in node.outputs)


def add_op(graph: Graph, op_type: str, inputs: Sequence[Value | None], attrs: Mapping[str, Any] | None = None, *,
           name: str = "", before: Node | None = None, num_outputs: int = 1, domain: str = "") -> Node:
    """A new node with schema-checked attributes and inferred output types, inserted before `before`."""
    schema = get_schema(op_type, domain)
    where = name or op_type
    typed = schema.make_attributes(dict(attrs or {}), where)
    types = schema.infer(typed, [v.type if v is not None else None for v in inputs],
                         [v.const if v is not None else None for v in inputs], num_outputs)
    return graph.add_node(op_type, list(inputs), typed, types, name=name or op_type, before=before, domain=domain)


def is_pure(node: Node) -> bool:
    """True when the node's outputs depend only on its inputs and it has no effect besides them."""
    traits = op_traits(node.op_type)
    return not traits.side_effects and traits.deterministic and not node.subgraphs()
