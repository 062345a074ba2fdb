"""NaN and infinities follow IEEE 754 as ONNX defines them: compared with onnxruntime, NaN equal to NaN at the same position."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tessel.compiler.api import compile
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


def _pool_model(node, in_shape, out_shape):
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _windowed_max(x, kernel, strides, pads):
    """NumPy MaxPool over (N, C, H, W) padded with -inf: NaN wherever the window holds a NaN."""
    padded = np.pad(x, [(0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])], constant_values=-np.inf)
    oh = (padded.shape[2] - kernel[0]) // strides[0] + 1
    ow = (padded.shape[3] - kernel[1]) // strides[1] + 1
    out = np.empty(x.shape[:2] + (oh, ow), np.float32)
    for i in range(oh):
        for j in range(ow):
            window = padded[:, :, i * strides[0]:i * strides[0] + kernel[0], j * strides[1]:j * strides[1] + kernel[1]]
            out[:, :, i, j] = np.max(window, axis=(2, 3))  # np.max propagates NaN
    return out


def _nan_image():
    x = np.random.default_rng(3).standard_normal((1, 3, 8, 8)).astype(np.float32)
    x[0, 0, 6, 5] = np.nan  # the fuzzer's case 960: one NaN in the middle of a window
    x[0, 1, 0, 0] = np.nan  # a window's first element
    x[0, 1, 3, 3] = np.nan  # a window's last element
    x[0, 2, 4:6, 4:6] = np.nan  # a whole window
    x[0, 2, 0, 7] = np.inf
    x[0, 2, 7, 0] = -np.inf
    return x


@pytest.mark.parametrize("kernel,strides,pads", [([2, 2], [2, 2], [0, 0, 0, 0]), ([3, 3], [1, 1], [1, 1, 1, 1]),
                                                 ([3, 2], [2, 1], [1, 0, 0, 1])])
def test_max_pool_window_with_nan_is_nan(kernel, strides, pads, kernel_cache):
    """A NaN anywhere in a MaxPool window makes that output NaN, whatever its place (onnxruntime's MLAS pooling keeps
    or drops it depending on the lane it lands in, so NumPy is the reference); padding never wins."""
    x = _nan_image()
    want = _windowed_max(x, kernel, strides, pads)
    model = _pool_model(helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=kernel, strides=strides, pads=pads),
                        list(x.shape), list(want.shape))
    artifact = compile(model, input_shapes={"x": x.shape}, cache_dir=kernel_cache)
    assert_ieee_equal(artifact.run({"x": x})["y"], want)


def test_max_pool_without_nan_matches_onnxruntime(kernel_cache):
    x = np.random.default_rng(4).standard_normal((1, 3, 7, 7)).astype(np.float32)
    x[0, 1, 2, 2] = np.inf
    model = _pool_model(helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
                        [1, 3, 7, 7], [1, 3, 3, 3])
    artifact = compile(model, input_shapes={"x": x.shape}, cache_dir=kernel_cache)
    assert_ieee_equal(artifact.run({"x": x})["y"], run_onnxruntime(model, {"x": x})[0])


def test_max_pool_1d_window_with_nan_is_nan(kernel_cache):
    x = np.array([[[1.0, np.nan, 3.0, 2.0, 5.0, -np.inf]]], np.float32)
    model = _pool_model(helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2], strides=[2]), [1, 1, 6], [1, 1, 3])
    artifact = compile(model, input_shapes={"x": x.shape}, cache_dir=kernel_cache)
    assert_ieee_equal(artifact.run({"x": x})["y"], np.array([[[np.nan, 3.0, 5.0]]], np.float32))


def test_global_max_pool_with_nan_is_nan(kernel_cache):
    x = _nan_image()
    model = _pool_model(helper.make_node("GlobalMaxPool", ["x"], ["y"]), list(x.shape), [1, 3, 1, 1])
    artifact = compile(model, input_shapes={"x": x.shape}, cache_dir=kernel_cache)
    assert_ieee_equal(artifact.run({"x": x})["y"], np.max(x, axis=(2, 3), keepdims=True))


ROWS = np.array([[1.0, np.nan, 3.0, 2.0, 0.5, -1.0, 4.0, 0.0],
                 [np.nan, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
                 [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, np.nan],
                 [-np.inf, -np.inf, -np.inf, -np.inf, -np.inf, -np.inf, -np.inf, -np.inf],
                 [1.0, 2.0, np.inf, 4.0, 5.0, 6.0, 7.0, 8.0]], np.float32)


@pytest.mark.parametrize("op,reference", [("ReduceMax", np.max), ("ReduceMin", np.min)])
@pytest.mark.parametrize("axes,keepdims", [([1], 0), ([0], 1), (None, 0)])
def test_reduce_max_min_with_nan_is_nan(op, reference, axes, keepdims, kernel_cache):
    """A NaN anywhere in what ReduceMax or ReduceMin reduces makes the result NaN, wherever it lies (NumPy is the
    reference: onnxruntime's vectorized reductions keep or drop it depending on its lane)."""
    want = reference(ROWS, axis=None if axes is None else tuple(axes), keepdims=bool(keepdims)).astype(np.float32)
    inputs = ["x", "axes"] if axes is not None else ["x"]
    initializers = [numpy_helper.from_array(np.array(axes, np.int64), "axes")] if axes is not None else []
    graph = helper.make_graph([helper.make_node(op, inputs, ["y"], keepdims=keepdims)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(ROWS.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(want.shape))], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    artifact = compile(model, input_shapes={"x": ROWS.shape}, cache_dir=kernel_cache)
    assert_ieee_equal(np.asarray(artifact.run({"x": ROWS})["y"]), want)


def test_reduce_max_of_integers_is_unchanged(kernel_cache):
    x = np.array([[3, -7, 9], [-(1 << 31), 0, 5]], np.int32)
    graph = helper.make_graph([helper.make_node("ReduceMax", ["x", "axes"], ["y"], keepdims=0)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.INT32, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, [2])],
                              [numpy_helper.from_array(np.array([1], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    artifact = compile(model, input_shapes={"x": x.shape}, cache_dir=kernel_cache)
    np.testing.assert_array_equal(artifact.run({"x": x})["y"], np.array([9, 5], np.int32))


def test_max_pool_of_negative_infinities_next_to_padding_is_negative_infinity(kernel_cache):
    """Padding never takes part in a MaxPool window (onnxruntime's edge windows give the finite minimum here)."""
    x = np.full((1, 1, 4, 4), -np.inf, np.float32)
    model = _pool_model(helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
                        [1, 1, 4, 4], [1, 1, 4, 4])
    artifact = compile(model, input_shapes={"x": x.shape}, cache_dir=kernel_cache)
    assert_ieee_equal(artifact.run({"x": x})["y"], np.full((1, 1, 4, 4), -np.inf, np.float32))
