"""CSE: nodes computing the same values and constants holding the same data are merged."""
from __future__ import annotations

import numpy as np
from onnx import helper

from tessel.passes.cse import cse
from tests.conftest import POSITIVE
from tests.ir.helpers import F

from .helpers import assert_graph_matches, corpus_after, graph_of, model, ops

RNG = np.random.default_rng(2)


def test_duplicate_nodes_and_commuted_inputs_merge():
    m = model([helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Relu", ["x"], ["b"]),
               helper.make_node("Add", ["a", "z"], ["c"]), helper.make_node("Add", ["z", "b"], ["d"]),
               helper.make_node("Mul", ["c", "d"], ["y"])],
              [("x", F, [3]), ("z", F, [3])], [("y", F, [3])])
    graph = graph_of(m)
    result = cse(graph)
    assert ops(graph) == ["Relu", "Add", "Mul"] and result.stats["nodes_merged"] == 2
    assert_graph_matches(m, graph, {"x": RNG.standard_normal(3).astype(np.float32), "z": RNG.standard_normal(3).astype(np.float32)})


def test_equal_constants_merge():
    w = RNG.standard_normal((3, 3)).astype(np.float32)
    m = model([helper.make_node("MatMul", ["x", "w1"], ["a"]), helper.make_node("MatMul", ["x", "w2"], ["b"]),
               helper.make_node("Sub", ["a", "b"], ["y"])],
              [("x", F, [2, 3])], [("y", F, [2, 3])], [("w1", w), ("w2", w.copy())])
    graph = graph_of(m)
    result = cse(graph)
    assert result.stats == {"nodes_merged": 1, "constants_merged": 1}
    assert ops(graph) == ["MatMul", "Sub"]
    assert_graph_matches(m, graph, {"x": RNG.standard_normal((2, 3)).astype(np.float32)})


def test_different_attributes_or_operand_order_do_not_merge():
    m = model([helper.make_node("Transpose", ["x"], ["a"], perm=[1, 0, 2]),
               helper.make_node("Transpose", ["x"], ["b"], perm=[1, 0, 2]),
               helper.make_node("Sub", ["x", "z"], ["c"]), helper.make_node("Sub", ["z", "x"], ["d"]),
               helper.make_node("Softmax", ["c"], ["e"], axis=0), helper.make_node("Softmax", ["c"], ["f"], axis=1)],
              [("x", F, [2, 2, 2]), ("z", F, [2, 2, 2])],
              [("a", F, [2, 2, 2]), ("b", F, [2, 2, 2]), ("d", F, [2, 2, 2]), ("e", F, [2, 2, 2]), ("f", F, [2, 2, 2])])
    graph = graph_of(m)
    result = cse(graph)
    # The two Transposes are equal, but both are graph outputs with their own names: nothing merges.
    assert not result.changed and len(graph.nodes) == 6


def test_corpus_model_after_cse():
    """inception_v2: repeated subexpressions and duplicated constants."""
    corpus_after(next(m for m in POSITIVE if m.name == "topology_inception_v2"), "cse")
