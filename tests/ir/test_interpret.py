"""The IR interpreter against onnxruntime, in float32 and widened to float64."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tessel import ir
from tessel.ir.interpret import interpret
from tests.conftest import run_onnxruntime
from tests.ir.helpers import F, model


def _small_model():
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["hb"]),
        helper.make_node("Gelu", ["hb"], ["g"]),
        helper.make_node("LayerNormalization", ["g", "scale"], ["n"], axis=-1),
        helper.make_node("Softmax", ["n"], ["y"], axis=1),
        helper.make_node("Cast", ["y"], ["c"], to=F),
        helper.make_node("Erf", ["c"], ["z"]),
    ]
    initializers = [("w", rng.standard_normal((4, 5)).astype(np.float32)),
                    ("b", rng.standard_normal(5).astype(np.float32)),
                    ("scale", rng.standard_normal(5).astype(np.float32))]
    return model(nodes, [("x", F, [3, 4])], [("y", F, [3, 5]), ("z", F, [3, 5])], initializers)


def test_interpret_matches_onnxruntime_in_float32():
    onnx_model = _small_model()
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    got = interpret(ir.from_onnx(onnx_model), {"x": x})
    for have, want in zip(got.values(), run_onnxruntime(onnx_model, {"x": x})):
        assert have.dtype == np.float32
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)


def test_float64_feeds_compute_in_float64_throughout():
    onnx_model = _small_model()
    x = np.random.default_rng(1).standard_normal((3, 4))
    got = interpret(ir.from_onnx(onnx_model), {"x": x})
    for have, want in zip(got.values(), run_onnxruntime(onnx_model, {"x": x.astype(np.float32)})):
        assert have.dtype == np.float64  # the Cast to float32 and every constant are widened
        np.testing.assert_allclose(have, want, rtol=1e-4, atol=1e-5)


def test_a_missing_feed_is_named():
    with pytest.raises(ValueError, match="no feed for graph input"):
        interpret(ir.from_onnx(_small_model()), {})


@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((1, 4, 3, 3), (4, 3, 2, 3), {"group": 2, "dilations": [2, 1], "strides": [2, 1], "pads": [1, 0, 0, 1],
                                  "output_padding": [1, 0]}),
    ((2, 3, 3, 4), (3, 1, 3, 3), {"group": 3, "strides": [2, 2], "output_shape": [7, 9]}),
    ((1, 2, 5), (2, 3, 3), {"strides": [3], "auto_pad": "SAME_UPPER"}),
])
def test_conv_transpose_matches_onnxruntime(x_shape, w_shape, attrs):
    rng = np.random.default_rng(2)
    w = rng.standard_normal(w_shape).astype(np.float32)
    bias = rng.standard_normal(w_shape[1] * attrs.get("group", 1)).astype(np.float32)
    x = rng.standard_normal(x_shape).astype(np.float32)
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs)
    onnx_model = model([node], [("x", F, list(x_shape))], [("y", F, None)], [("w", w), ("b", bias)])
    want = run_onnxruntime(onnx_model, {"x": x})[0]
    got = interpret(ir.from_onnx(onnx_model), {"x": x})
    np.testing.assert_allclose(next(iter(got.values())), want, rtol=1e-5, atol=1e-5)


def test_lrn_matches_onnxruntime():
    x = np.random.default_rng(3).standard_normal((2, 5, 3, 2)).astype(np.float32)
    node = helper.make_node("LRN", ["x"], ["y"], size=3, alpha=0.3, beta=0.75, bias=1.5)
    onnx_model = model([node], [("x", F, [2, 5, 3, 2])], [("y", F, [2, 5, 3, 2])])
    got = interpret(ir.from_onnx(onnx_model), {"x": x})["y"]
    np.testing.assert_allclose(got, run_onnxruntime(onnx_model, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_fused_graph_interprets_like_the_unfused_one():
    from tessel.compiler.pipeline import run_pipeline

    graph = ir.from_onnx(_small_model())
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    expected = interpret(graph, {"x": x})
    fused, _ = run_pipeline(graph)
    assert any(node.op_type == "Fused" for node in fused.nodes)
    got = interpret(fused, {"x": x})
    for name, array in expected.items():
        np.testing.assert_allclose(got[name], array, rtol=1e-6, atol=1e-6)


def _all_reduce_graph(reduction: str):
    from tessel.ir.graph import Graph
    from tessel.ir.schema import TESSEL_DOMAIN
    from tessel.ir.types import TensorType
    from tessel.passes.base import add_op

    graph = Graph()
    x = graph.add_input("x", TensorType("float32", (2,)))
    graph.outputs = [add_op(graph, "AllReduce", [x], {"reduction": reduction}, domain=TESSEL_DOMAIN).outputs[0]]
    return graph


@pytest.mark.parametrize("reduction, want", [("sum", [6.0, 0.0]), ("mean", [2.0, 0.0]), ("max", [3.0, 2.0]),
                                             ("min", [1.0, -2.0])])
def test_replicas_all_reduce_together_and_one_interpreter_is_one_worker(reduction, want):
    from tessel.ir.interpret import interpret_replicas

    graph = _all_reduce_graph(reduction)
    feeds = [{"x": np.array(x, np.float32)} for x in ([1.0, 0.0], [2.0, 2.0], [3.0, -2.0])]
    for result in interpret_replicas(graph, feeds):
        np.testing.assert_allclose(result[graph.outputs[0].name], want)
    np.testing.assert_array_equal(interpret(graph, feeds[0])[graph.outputs[0].name], feeds[0]["x"])


def test_a_failing_replica_stops_the_others_with_its_own_error():
    from tessel.ir.interpret import interpret_replicas

    graph = _all_reduce_graph("sum")
    with pytest.raises(ValueError, match="no feed"):
        interpret_replicas(graph, [{"x": np.zeros(2, np.float32)}, {}], timeout_s=30)
