"""Send/Recv insertion: one pair per (tensor, destination), outputs back on device 0, same function."""
from __future__ import annotations

import numpy as np
from onnx import helper

from tessel.passes.partition import insert_transfers, node_device
from tests.ir.helpers import F

from .helpers import assert_graph_matches, graph_of, model


def _model():
    # x -> a = Relu(x) on 0; b = Neg(a), c = Exp(a) on 1 (a crosses once); y = Add(b, c) on 1 returns to 0.
    return model([helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["b"]),
                  helper.make_node("Exp", ["a"], ["c"]), helper.make_node("Add", ["b", "c"], ["y"])],
                 [("x", F, [2, 3])], [("y", F, [2, 3])])


def test_one_pair_per_tensor_and_destination():
    m = _model()
    graph = graph_of(m)
    relu, neg, exp, add = graph.nodes
    device = {relu.name: 0, neg.name: 1, exp.name: 1, add.name: 1}
    transfers = insert_transfers(graph, device)
    assert [(t, a, b) for t, a, b, _ in transfers.pairs] == [("a", 0, 1), ("y", 1, 0)]
    assert transfers.bytes == 2 * 2 * 3 * 4
    ops = [(n.op_type, node_device(n, device)) for n in graph.nodes]
    assert ops == [("Relu", 0), ("Send", 0), ("Recv", 1), ("Neg", 1), ("Exp", 1), ("Add", 1), ("Send", 1), ("Recv", 0)]
    # The model output keeps its name on device 0; every reader on device 1 reads the received copy.
    assert graph.outputs[0].name == "y" and graph.outputs[0].producer.op_type == "Recv"
    assert all(v.producer.op_type == "Recv" for n in (graph.nodes[3], graph.nodes[4]) for v in n.inputs)
    assert_graph_matches(m, graph, {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)})


def test_nothing_crosses_when_everything_is_on_one_device():
    graph = graph_of(_model())
    assert insert_transfers(graph, {n.name: 0 for n in graph.nodes}).pairs == []
    assert [n.op_type for n in graph.nodes] == ["Relu", "Neg", "Exp", "Add"]


def test_inputs_are_sent_from_device_zero():
    graph = graph_of(_model())
    device = {n.name: 1 for n in graph.nodes}
    transfers = insert_transfers(graph, device)
    assert [(t, a, b) for t, a, b, _ in transfers.pairs] == [("x", 0, 1), ("y", 1, 0)]
    assert graph.nodes[0].op_type == "Send" and node_device(graph.nodes[0], device) == 0
