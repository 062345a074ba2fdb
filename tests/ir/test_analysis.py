"""FLOP counts and the activation-memory lower bound."""
from __future__ import annotations

import ir
from ir import Attributes, Graph, TensorType
from ir.analysis import max_live_bytes, op_histogram, total_flops
from tests.conftest import POSITIVE


def test_resnet18_flops_match_the_published_count():
    model = next(m for m in POSITIVE if m.name == "resnet18")
    graph = ir.from_onnx(model.path, model.input_shapes)
    # ResNet-18 at 224x224 is 1.82 GMACs: about 3.64 GFLOPs.
    assert 3.5e9 < total_flops(graph) < 3.75e9
    assert op_histogram(graph)["Conv"] == 20


def test_max_live_bytes_frees_values_after_their_last_use():
    t = TensorType("float32", (1024,))  # 4 KiB each
    graph = Graph()
    x = graph.add_input("x", t)
    a = graph.add_node("Relu", [x], Attributes(), [t]).outputs[0]
    b = graph.add_node("Neg", [a], Attributes(), [t]).outputs[0]
    c = graph.add_node("Abs", [b], Attributes(), [t]).outputs[0]
    graph.outputs = [graph.add_node("Add", [c, x], Attributes(), [t]).outputs[0]]
    live = max_live_bytes(graph)
    # x stays live to the end; each step holds x, the node's input and its output.
    assert live.peak_bytes == 3 * 4096
