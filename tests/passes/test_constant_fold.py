"""Constant folding: nodes on constants are computed at compile time, up to the size cap."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from tessel.passes.constant_fold import DEFAULT_LIMIT_BYTES, constant_fold, feeds_weight
from tests.conftest import POSITIVE
from tests.ir.helpers import F

from .helpers import assert_graph_matches, corpus_after, graph_of, model, ops

RNG = np.random.default_rng(1)


def _transposed_weight_model(rows: int, cols: int):
    # Import folds only small tensors (65,536 elements); this weight is larger.
    weight = RNG.standard_normal((cols, rows)).astype(np.float32)
    return model([helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "wt"], ["y"])],
                 [("x", F, [2, rows])], [("y", F, [2, cols])], [("w", weight)])


def test_large_weight_transpose_is_folded():
    m = _transposed_weight_model(400, 250)
    graph = graph_of(m)
    assert ops(graph) == ["Transpose", "MatMul"]
    result = constant_fold(graph)
    assert ops(graph) == ["MatMul"]
    assert result.stats["nodes_folded"] == 1 and result.stats["bytes_folded"] == 400 * 250 * 4
    assert_graph_matches(m, graph, {"x": RNG.standard_normal((2, 400)).astype(np.float32)})


def test_tensors_over_the_cap_are_not_folded():
    """A 2 MiB constant added to an activation is not a weight: it is computed at load, the artifact stays small."""
    weight = RNG.standard_normal((512, 1024)).astype(np.float32)
    m = model([helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("Add", ["x", "wt"], ["y"])],
              [("x", F, [1024, 512])], [("y", F, [1024, 512])], [("w", weight)])
    graph = graph_of(m)
    result = constant_fold(graph)
    assert ops(graph) == ["Transpose", "Add"] and not result.changed
    assert 1024 * 512 * 4 > DEFAULT_LIMIT_BYTES
    assert constant_fold(graph, limit_bytes=4 << 20).stats["nodes_folded"] == 1


def test_weights_over_the_cap_are_folded():
    """A 2 MiB MatMul weight is folded whatever its size: the matmul packs it for its fast kernel."""
    m = _transposed_weight_model(1024, 512)
    graph = graph_of(m)
    result = constant_fold(graph)
    assert ops(graph) == ["MatMul"] and result.stats["bytes_folded"] == 1024 * 512 * 4


def test_feeds_weight_follows_foldable_nodes():
    """Cast → Transpose → Conv weight: both feed the weight; a Cast feeding the conv's data input does not."""
    half = RNG.standard_normal((64, 128, 3, 3)).astype(np.float16)  # over what import folds
    m = model([helper.make_node("Cast", ["w16"], ["w32"], to=F), helper.make_node("Transpose", ["w32"], ["w"], perm=[1, 0, 2, 3]),
               helper.make_node("Cast", ["x16"], ["x"], to=F), helper.make_node("Conv", ["x", "w"], ["y"])],
              [("x16", TensorProto.FLOAT16, [1, 64, 5, 5])], [("y", F, [1, 128, 3, 3])], [("w16", half)])
    graph = graph_of(m)
    values = {v.name: v for v in graph.values()}
    assert feeds_weight(values["w32"]) and feeds_weight(values["w"]) and not feeds_weight(values["x"])


def test_folded_graph_output_keeps_its_name():
    m = _transposed_weight_model(400, 250)
    m.graph.output.append(helper.make_tensor_value_info("wt", F, [400, 250]))
    graph = graph_of(m)
    constant_fold(graph)
    assert [v.name for v in graph.outputs] == ["y", "wt"] and graph.outputs[1].is_constant


def test_corpus_model_after_constant_fold():
    """lstm_tagger: its transposed weight matrices fold."""
    corpus_after(next(m for m in POSITIVE if m.name == "lstm_tagger"), "constant_fold")
