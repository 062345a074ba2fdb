"""The verifier catches each kind of broken graph."""
from __future__ import annotations

from tessel import ir
from tessel.ir import Attributes, Graph, TensorType
from tessel.ir.graph import Value

T = TensorType("float32", (2, 3))


def _graph() -> tuple[Graph, ir.Node]:
    graph = Graph()
    x = graph.add_input("x", T)
    node = graph.add_node("Relu", [x], Attributes(), [T], output_names=["y"])
    graph.outputs = list(node.outputs)
    return graph, node


def test_valid_graph_has_no_problems():
    graph, _ = _graph()
    assert ir.check(graph) == []


def test_type_mismatch_is_reported():
    graph, node = _graph()
    node.outputs[0].type = TensorType("float32", (3, 2))
    assert any("typed f32[3,2], but its inputs give f32[2,3]" in p for p in ir.check(graph))


def test_dangling_value_is_reported():
    graph, node = _graph()
    stranger = Value("ghost", T, Graph("other"))
    node._inputs[0] = stranger
    stranger._uses.append((node, 0))
    assert any("dangling" in p for p in ir.check(graph))


def test_duplicate_names_are_reported():
    graph, node = _graph()
    node.outputs[0].name = "x"
    assert any("defined twice" in p for p in ir.check(graph))


def test_cycle_is_reported():
    graph, node = _graph()
    graph.set_input(node, 0, node.outputs[0])
    problems = ir.check(graph)
    assert any("cycle" in p for p in problems) and any("before it is produced" in p for p in problems)


def test_unknown_attribute_is_reported():
    graph, node = _graph()
    node.attrs = Attributes({"alpha": 1.0})
    assert any("unknown attributes ['alpha']" in p for p in ir.check(graph))
