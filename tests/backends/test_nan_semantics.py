"""NaN and infinities follow IEEE 754 as ONNX defines them: compared with onnxruntime, NaN equal to NaN at the same position."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.api import compile
from tests.conftest import run_onnxruntime

X = np.array([[np.nan, np.inf, -np.inf, 1.5, -2.0, 0.0, -0.0, np.nan]], np.float32)
Z = np.array([[0.5, np.nan, 1.0, np.inf, np.nan, -np.inf, 1.0, np.nan]], np.float32)


def _scalar(name, value):
    return numpy_helper.from_array(np.array(value, np.float32), name)


def _model(nodes, initializers=(), two_inputs=False):
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])]
    if two_inputs:
        inputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 8]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
                              list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


CASES = {
    "mul_by_constant_zero": _model([helper.make_node("Mul", ["x", "zero"], ["y"])], [_scalar("zero", 0.0)]),
    "mul_by_constant_negative_zero": _model([helper.make_node("Mul", ["zero", "x"], ["y"])], [_scalar("zero", -0.0)]),
    "mul_by_zero_then_add": _model([helper.make_node("Mul", ["x", "zero"], ["t"]), helper.make_node("Add", ["t", "z"], ["y"])],
                                   [_scalar("zero", 0.0)], two_inputs=True),
    "mul": _model([helper.make_node("Mul", ["x", "z"], ["y"])], two_inputs=True),
    "relu": _model([helper.make_node("Relu", ["x"], ["y"])]),
    "clip": _model([helper.make_node("Clip", ["x", "low", "high"], ["y"])], [_scalar("low", -1.0), _scalar("high", 1.0)]),
    "clip_low_only": _model([helper.make_node("Clip", ["x", "low"], ["y"])], [_scalar("low", 0.0)]),
    "max": _model([helper.make_node("Max", ["x", "z"], ["y"])], two_inputs=True),
    "max_reversed": _model([helper.make_node("Max", ["z", "x"], ["y"])], two_inputs=True),
    "min": _model([helper.make_node("Min", ["x", "z"], ["y"])], two_inputs=True),
    "min_reversed": _model([helper.make_node("Min", ["z", "x"], ["y"])], two_inputs=True),
    "max_with_constant": _model([helper.make_node("Max", ["x", "zero"], ["y"])], [_scalar("zero", 0.0)]),
    "hard_sigmoid": _model([helper.make_node("HardSigmoid", ["x"], ["y"])]),
    "hard_swish": _model([helper.make_node("HardSwish", ["x"], ["y"])]),
    "leaky_relu": _model([helper.make_node("LeakyRelu", ["x"], ["y"])]),
}


def assert_ieee_equal(got: np.ndarray, want: np.ndarray) -> None:
    """Equal values, NaN where the reference has NaN, and the same infinities."""
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_nan_and_infinities_match_onnxruntime(name, kernel_cache):
    model = CASES[name]
    feeds = {"x": X, "z": Z} if len(model.graph.input) == 2 else {"x": X}
    artifact = compile(model, input_shapes={k: v.shape for k, v in feeds.items()}, cache_dir=kernel_cache)
    assert_ieee_equal(artifact.run(feeds)["y"], run_onnxruntime(model, feeds)[0])


def test_constant_folding_keeps_nan_times_zero(kernel_cache):
    """Mul of two constants folds at compile time and still gives NaN for NaN and infinity times zero."""
    nodes = [helper.make_node("Mul", ["c", "zero"], ["t"]), helper.make_node("Add", ["x", "t"], ["y"])]
    constant = numpy_helper.from_array(np.array([[np.nan, np.inf, -np.inf, 1, 2, 3, 4, 5]], np.float32), "c")
    model = _model(nodes, [constant, _scalar("zero", 0.0)])
    x = np.ones((1, 8), np.float32)
    artifact = compile(model, input_shapes={"x": (1, 8)}, cache_dir=kernel_cache)
    assert_ieee_equal(artifact.run({"x": x})["y"], run_onnxruntime(model, {"x": x})[0])
