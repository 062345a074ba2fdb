"""Simplify: identity removal, BatchNorm folding, chain collapsing, MatMul+Add, GELU and LayerNorm recognition."""
from __future__ import annotations

import math

import numpy as np
from onnx import helper

from tessel import ir
from tessel.passes.simplify import simplify
from tessel.passes.dce import dce
from tests.conftest import POSITIVE
from tests.ir.helpers import F

from .helpers import assert_graph_matches, corpus_after, graph_of, model, ops

RNG = np.random.default_rng(0)


def _simplified(m):
    graph = graph_of(m)
    result = simplify(graph)
    dce(graph)
    return graph, result


def _rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def test_identity_and_dropout_are_removed():
    m = model([helper.make_node("Identity", ["x"], ["a"]), helper.make_node("Dropout", ["a"], ["b"]),
               helper.make_node("Relu", ["b"], ["y"])], [("x", F, [2, 3])], [("y", F, [2, 3])])
    graph, result = _simplified(m)
    assert ops(graph) == ["Relu"] and result.stats == {"identity_removed": 1, "dropout_removed": 1}
    assert_graph_matches(m, graph, {"x": _rand(2, 3)})


def test_identity_between_input_and_output_stays():
    m = model([helper.make_node("Identity", ["x"], ["y"])], [("x", F, [2])], [("y", F, [2])])
    graph, result = _simplified(m)
    assert ops(graph) == ["Identity"] and not result.changed


def _conv_bn(extra_reader: bool):
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "g", "beta", "mean", "var"], ["y"], epsilon=1e-3)]
    outputs = [("y", F, [1, 4, 5, 5])]
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["c"], ["z"]))
        outputs.append(("z", F, [1, 4, 5, 5]))
    inits = [("w", _rand(4, 3, 3, 3)), ("b", _rand(4)), ("g", _rand(4)), ("beta", _rand(4)), ("mean", _rand(4)),
             ("var", np.abs(_rand(4)) + 0.5)]
    return model(nodes, [("x", F, [1, 3, 5, 5])], outputs, inits)


def test_batchnorm_folds_into_conv():
    m = _conv_bn(extra_reader=False)
    graph, result = _simplified(m)
    assert ops(graph) == ["Conv"] and result.stats == {"batchnorm_folded_into_conv": 1}
    assert_graph_matches(m, graph, {"x": _rand(1, 3, 5, 5)})


def test_batchnorm_stays_when_conv_output_has_other_readers():
    graph, result = _simplified(_conv_bn(extra_reader=True))
    assert "BatchNormalization" in ops(graph) and not result.changed


def test_batchnorm_folds_into_gemm():
    m = model([helper.make_node("Gemm", ["x", "w", "c"], ["h"], transB=1, alpha=0.5, beta=2.0),
               helper.make_node("BatchNormalization", ["h", "g", "beta", "mean", "var"], ["y"])],
              [("x", F, [3, 6])], [("y", F, [3, 4])],
              [("w", _rand(4, 6)), ("c", _rand(4)), ("g", _rand(4)), ("beta", _rand(4)), ("mean", _rand(4)),
               ("var", np.abs(_rand(4)) + 0.5)])
    graph, _ = _simplified(m)
    assert ops(graph) == ["Gemm"]
    assert_graph_matches(m, graph, {"x": _rand(3, 6)})


def test_view_and_transpose_chains_collapse():
    m = model([helper.make_node("Flatten", ["x"], ["a"], axis=1),
               helper.make_node("Unsqueeze", ["a", "axes"], ["b"]),
               helper.make_node("Transpose", ["b"], ["c"], perm=[2, 0, 1]),
               helper.make_node("Transpose", ["c"], ["d"], perm=[0, 2, 1]),
               helper.make_node("Transpose", ["d"], ["e"], perm=[0, 2, 1])],
              [("x", F, [2, 3, 4])], [("e", F, [1, 2, 12])], [("axes", np.asarray([0], np.int64))])
    graph, result = _simplified(m)
    assert ops(graph) == ["Reshape", "Transpose"]
    assert result.stats["view_chains_collapsed"] == 1
    assert_graph_matches(m, graph, {"x": _rand(2, 3, 4)})


def test_matmul_add_becomes_gemm_with_views_around_it():
    m = model([helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["bias", "p"], ["y"])],
              [("x", F, [2, 5, 8])], [("y", F, [2, 5, 16])], [("w", _rand(8, 16)), ("bias", _rand(16))])
    graph, result = _simplified(m)
    assert ops(graph) == ["Reshape", "Gemm", "Reshape"] and result.stats == {"matmul_add_to_gemm": 1}
    assert_graph_matches(m, graph, {"x": _rand(2, 5, 8)})


def test_matmul_add_with_runtime_bias_stays():
    m = model([helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "z"], ["y"])],
              [("x", F, [5, 8]), ("z", F, [16])], [("y", F, [5, 16])], [("w", _rand(8, 16))])
    graph, result = _simplified(m)
    assert ops(graph) == ["MatMul", "Add"] and not result.changed


def _gelu_erf(divisor: float):
    return model([helper.make_node("Div", ["x", "s"], ["a"]), helper.make_node("Erf", ["a"], ["b"]),
                  helper.make_node("Add", ["b", "one"], ["c"]), helper.make_node("Mul", ["x", "c"], ["d"]),
                  helper.make_node("Mul", ["d", "half"], ["y"])],
                 [("x", F, [4, 8])], [("y", F, [4, 8])],
                 [("s", np.float32(divisor)), ("one", np.float32(1.0)), ("half", np.float32(0.5))])


def test_gelu_erf_form_is_recognized():
    m = _gelu_erf(math.sqrt(2.0))
    graph, result = _simplified(m)
    assert ops(graph) == ["Gelu"] and result.stats == {"gelu_none_recognized": 1}
    assert_graph_matches(m, graph, {"x": _rand(4, 8)})


def test_gelu_with_another_constant_is_left_alone():
    graph, result = _simplified(_gelu_erf(1.3))
    assert "Gelu" not in ops(graph) and not result.changed


def test_gelu_tanh_form_is_recognized():
    c = math.sqrt(2.0 / math.pi)
    m = model([helper.make_node("Pow", ["x", "three"], ["p"]), helper.make_node("Mul", ["p", "k"], ["q"]),
               helper.make_node("Add", ["x", "q"], ["r"]), helper.make_node("Mul", ["r", "c"], ["s"]),
               helper.make_node("Tanh", ["s"], ["t"]), helper.make_node("Add", ["t", "one"], ["u"]),
               helper.make_node("Mul", ["x", "half"], ["h"]), helper.make_node("Mul", ["h", "u"], ["y"])],
              [("x", F, [4, 8])], [("y", F, [4, 8])],
              [("three", np.float32(3.0)), ("k", np.float32(0.044715)), ("c", np.float32(c)),
               ("one", np.float32(1.0)), ("half", np.float32(0.5))])
    graph, result = _simplified(m)
    assert ops(graph) == ["Gelu"] and result.stats == {"gelu_tanh_recognized": 1}
    assert_graph_matches(m, graph, {"x": _rand(4, 8)})


def test_layer_norm_is_recognized():
    axes = np.asarray([-1], np.int64)
    m = model([helper.make_node("ReduceMean", ["x", "axes"], ["m"]), helper.make_node("Sub", ["x", "m"], ["d"]),
               helper.make_node("Pow", ["d", "two"], ["p"]), helper.make_node("ReduceMean", ["p", "axes"], ["v"]),
               helper.make_node("Add", ["v", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["s"]),
               helper.make_node("Div", ["d", "s"], ["n"]), helper.make_node("Mul", ["n", "g"], ["ng"]),
               helper.make_node("Add", ["ng", "b"], ["y"])],
              [("x", F, [2, 5, 16])], [("y", F, [2, 5, 16])],
              [("axes", axes), ("two", np.float32(2.0)), ("eps", np.float32(1e-5)), ("g", _rand(16)), ("b", _rand(16))])
    graph, result = _simplified(m)
    assert ops(graph) == ["LayerNormalization"] and result.stats == {"layer_norm_recognized": 1}
    assert_graph_matches(m, graph, {"x": _rand(2, 5, 16)})


def test_split_becomes_slices():
    m = model([helper.make_node("Split", ["x", "sizes"], ["a", "b"], axis=1),
               helper.make_node("Add", ["a", "b"], ["y"])],
              [("x", F, [2, 8])], [("y", F, [2, 4])], [("sizes", np.asarray([4, 4], np.int64))])
    graph, result = _simplified(m)
    assert ops(graph) == ["Slice", "Slice", "Add"] and result.stats == {"splits_to_slices": 1}
    assert_graph_matches(m, graph, {"x": _rand(2, 8)})


def test_corpus_model_after_simplify():
    """ppocr_v4_rec: BatchNorm folding, LayerNorm recognition, MatMul+Add to Gemm, view chains."""
    corpus_after(next(m for m in POSITIVE if m.name == "ppocr_v4_rec"), "simplify")


def test_a_peephole_lstm_compiles_unrolled_and_equals_onnxruntime(kernel_cache):
    """The LSTM kernel has no peephole terms: simplify unrolls such an LSTM into primitive ops."""
    import onnxruntime

    import tessel
    from tests.passes.test_training_mode import _onnx_rnn

    onnx_model = _onnx_rnn("LSTM", "bidirectional", {}, True, True, np.random.default_rng(0))
    graph = simplify(ir.from_onnx(onnx_model)).graph
    assert "LSTM" not in {node.op_type for node in graph.nodes}
    x = np.random.default_rng(1).standard_normal((3, 2, 2)).astype(np.float32)
    got = tessel.compile(onnx_model, cache_dir=kernel_cache).run({"x": x})
    want = onnxruntime.InferenceSession(onnx_model.SerializeToString()).run(None, {"x": x})
    for name, expected in zip(["y", "y_h", "y_c"], want):
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-5)
