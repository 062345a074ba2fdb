"""DCE: nodes and constants nothing reads are removed."""
from __future__ import annotations

import numpy as np
from onnx import helper

from tessel.passes.dce import dce
from tests.conftest import POSITIVE
from tests.ir.helpers import F

from .helpers import assert_graph_matches, corpus_after, graph_of, model, ops


def _model_with_dead_branch():
    return model([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Exp", ["x"], ["dead1"]),
                  helper.make_node("Add", ["dead1", "w"], ["dead2"])],
                 [("x", F, [4])], [("y", F, [4])], [("w", np.ones(4, np.float32))])


def test_dead_chain_and_its_constant_are_removed():
    m = _model_with_dead_branch()
    graph = graph_of(m)
    # Import keeps nodes as written; the dead chain is still there.
    assert ops(graph) == ["Relu", "Exp", "Add"]
    result = dce(graph)
    assert ops(graph) == ["Relu"] and result.stats == {"nodes_removed": 2, "constants_removed": 1}
    assert_graph_matches(m, graph, {"x": np.arange(4, dtype=np.float32) - 2})


def test_nodes_feeding_outputs_stay():
    m = model([helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["y"])],
              [("x", F, [4])], [("y", F, [4]), ("a", F, [4])])
    graph = graph_of(m)
    assert not dce(graph).changed and ops(graph) == ["Relu", "Neg"]


def test_corpus_model_after_dce():
    corpus_after(next(m for m in POSITIVE if m.name == "silero_vad"), "dce")
