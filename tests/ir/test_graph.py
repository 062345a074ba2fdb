"""Use-def links, rewiring, ordering and the networkx view."""
from __future__ import annotations

import numpy as np
import pytest

from tessel import ir
from tessel.ir import Attributes, Graph, TensorType

T = TensorType("float32", (2, 3))


def _chain() -> tuple[Graph, ir.Value, ir.Node, ir.Node]:
    graph = Graph()
    x = graph.add_input("x", T)
    relu = graph.add_node("Relu", [x], Attributes(), [T], output_names=["r"])
    neg = graph.add_node("Neg", [relu.outputs[0]], Attributes(), [T], output_names=["y"])
    graph.outputs = [neg.outputs[0]]
    return graph, x, relu, neg


def test_uses_and_producers_are_linked():
    graph, x, relu, neg = _chain()
    assert x.uses == [(relu, 0)]
    assert relu.outputs[0].producer is relu and relu.outputs[0].uses == [(neg, 0)]
    assert neg.outputs[0].is_graph_output and x.is_graph_input
    ir.verify(graph)


def test_replace_all_uses_with_rewires_nodes_and_outputs():
    graph, x, relu, neg = _chain()
    graph.replace_all_uses_with(relu.outputs[0], x)
    assert neg.inputs[0] is x and relu.outputs[0].uses == []
    graph.remove_node(relu)
    graph.replace_all_uses_with(neg.outputs[0], x)
    assert graph.outputs == [x]
    ir.verify(graph)


def test_remove_node_refuses_while_used():
    graph, _, relu, _ = _chain()
    with pytest.raises(ValueError, match="still used"):
        graph.remove_node(relu)


def test_topological_sort_restores_order_and_detects_cycles():
    graph, x, relu, neg = _chain()
    graph.nodes.reverse()
    assert ir.check(graph)
    graph.topological_sort()
    assert graph.nodes == [relu, neg]
    graph.set_input(relu, 0, neg.outputs[0])
    with pytest.raises(ir.VerificationError, match="cycle"):
        graph.topological_sort()


def test_unique_names_across_scopes():
    graph, *_ = _chain()
    assert graph.unique_name("x") == "x_1"
    sub = Graph("sub", parent=graph)
    assert sub.add_constant("x", np.zeros(1, np.float32)).name == "x_1"
    assert sub.lookup("r") is graph.lookup("r")


def test_networkx_view_has_op_and_value_vertices():
    graph, *_ = _chain()
    view = graph.to_networkx()
    assert view.nodes["x"]["kind"] == "input"
    assert {(u, v) for u, v, _ in view.edges(keys=True)} == {("x", "Relu"), ("Relu", "Neg")}
