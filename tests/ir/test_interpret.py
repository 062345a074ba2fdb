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
