"""FLOP counts and the activation-memory lower bound."""
from __future__ import annotations

import numpy as np

from tessel import ir
from tessel.ir import Attributes, Graph, TensorType
from tessel.ir.analysis import max_live_bytes, op_histogram, total_bytes_moved, total_flops
from tessel.ir.costs import bytes_moved, flops
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


def test_node_costs_count_flops_and_bytes():
    x_type, w_type, y_type = TensorType("float32", (1, 8, 10, 10)), TensorType("float32", (16, 8, 3, 3)), TensorType("float32", (1, 16, 8, 8))
    graph = Graph()
    x = graph.add_input("x", x_type)
    w = graph.add_constant("w", np.zeros(w_type.shape, "float32"))
    conv = graph.add_node("Conv", [x, w], Attributes(), [y_type])
    graph.outputs = list(conv.outputs)
    assert flops(conv) == 2 * y_type.numel * 8 * 3 * 3
    assert bytes_moved(conv) == x_type.nbytes + w_type.nbytes + y_type.nbytes == total_bytes_moved(graph)


def test_training_ops_flops():
    """MaxPoolWithTaps searches each window twice (its maximum, then its first tap); BatchStats reads x twice."""
    from tessel.passes.base import add_op

    graph = Graph()
    x = graph.add_input("x", TensorType("float32", (2, 4, 8, 8)))
    pool = add_op(graph, "MaxPoolWithTaps", [x], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
                  num_outputs=2, domain="tessel")
    stats = add_op(graph, "BatchStats", [x], num_outputs=2, domain="tessel")
    assert flops(pool) == 2 * (2 * 4 * 4 * 4) * 9
    assert flops(stats) == 4 * x.type.numel
