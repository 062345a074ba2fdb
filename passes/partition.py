"""Apply a placement: Send/Recv pairs between devices, one per (tensor, destination device).

Like TensorFlow's graph partitioner, a tensor read by several nodes of one
device crosses once. A Send goes right after the tensor's producer (the data
leaves as early as possible); a Recv right before its first reader (the buffer
lives as briefly as possible). Model inputs are on device 0, which feeds them;
model outputs end on device 0. Constants are not sent: each device loads the
weights its nodes read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from tessel.ir.graph import Graph, Node, Value
from tessel.ir.op_traits import op_traits
from tessel.ir.schema import TESSEL_DOMAIN, get_schema

HOME_DEVICE = 0


@dataclass
class Transfers:
    """What crossed between devices: (tensor, from, to, bytes) per Send/Recv pair."""

    pairs: list[tuple[str, int, int, int]] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        """Total bytes moved per run."""
        return sum(p[3] for p in self.pairs)


def node_device(node: Node, device: Mapping[str, int]) -> int:
    """The device a top-level node runs on (Send/Recv carry theirs)."""
    if node.domain == TESSEL_DOMAIN and op_traits(node.op_type).transfer:
        return node.attrs["device"]
    return device[node.name]


def _top_level(node: Node, graph: Graph) -> Node:
    while node.graph is not graph:
        owner = next(n for n in node.graph.parent.nodes if node.graph in n.subgraphs())
        node = owner
    return node


def insert_transfers(graph: Graph, device: Mapping[str, int]) -> Transfers:
    """Insert Send/Recv nodes so every node reads only values of its own device."""
    transfers = Transfers()
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    values = list(graph.inputs) + [v for n in list(graph.nodes) for v in n.outputs if v is not None]
    for value in values:
        source = HOME_DEVICE if value.producer is None else device[value.producer.name]
        readers: dict[int, list[tuple[Node, int]]] = {}
        for user, index in value.uses:
            d = device[_top_level(user, graph).name]
            if d != source:
                readers.setdefault(d, []).append((user, index))
        returned = value.is_graph_output and source != HOME_DEVICE
        if returned:
            readers.setdefault(HOME_DEVICE, [])
        for d, uses in sorted(readers.items()):
            output_name = ""
            if returned and d == HOME_DEVICE:
                # The model output keeps its name on device 0; the producer's copy is renamed.
                output_name = value.name
                graph.rename_value(value, graph.unique_name(f"{value.name}@{source}"))
            tops = [_top_level(u, graph) for u, _ in uses]
            first = min(tops, key=lambda n: position[id(n)]) if tops else None
            received = _transfer(graph, value, source, d, len(transfers.pairs), first, output_name)
            for user, index in uses:
                user.graph.set_input(user, index, received)
            if output_name:
                graph.outputs = [received if out is value else out for out in graph.outputs]
            transfers.pairs.append((output_name or value.name, source, d, value.type.nbytes))
    graph.topological_sort()
    return transfers


def _transfer(graph: Graph, value: Value, source: int, target: int, tag: int, before: Node | None,
              output_name: str = "") -> Value:
    send_schema, recv_schema = get_schema("Send", TESSEL_DOMAIN), get_schema("Recv", TESSEL_DOMAIN)
    if value.producer is None:
        after = graph.nodes[0] if graph.nodes else None
    else:
        index = graph.nodes.index(value.producer) + 1
        after = graph.nodes[index] if index < len(graph.nodes) else None
    graph.add_node("Send", [value], send_schema.make_attributes({"device": source, "peer": target, "tag": tag}, "Send"),
                   [], name=f"send_{value.name}_to{target}", domain=TESSEL_DOMAIN, before=after)
    attrs = recv_schema.make_attributes(
        {"device": target, "peer": source, "tag": tag, "tensor": value.name, "type": value.type.spec()}, "Recv")
    recv = graph.add_node("Recv", [], attrs, [value.type], name=f"recv_{value.name}_on{target}", domain=TESSEL_DOMAIN,
                          before=before, output_names=[output_name or f"{value.name}@{target}"])
    return recv.outputs[0]
