"""LSTM and GRU kernels equal onnxruntime in both forms of their products (few steps: row dot products of 16 lanes
and a tail; many: transposed weights, at compile time when they are constants, else in the kernel), at vectorized
sizes, and at sizes that no vector block divides with gates driven into saturation."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tessel.compiler.api import compile
from tests.conftest import assert_matches_onnxruntime, run_onnxruntime

BATCH, WIDTH, HIDDEN = 2, 40, 16  # a width of 2 vectors and a tail of 8


def _recurrent_model(op: str, direction: str, steps: int, hidden: int = HIDDEN, width: int = WIDTH, **attrs):
    gates = 4 if op == "LSTM" else 3
    dirs = 2 if direction == "bidirectional" else 1
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name) for name, shape in
               (("W", (dirs, gates * hidden, width)), ("R", (dirs, gates * hidden, hidden)), ("B", (dirs, 2 * gates * hidden)))]
    node = helper.make_node(op, ["x", "W", "R", "B"], ["y", "y_h"], hidden_size=hidden, direction=direction, **attrs)
    graph = helper.make_graph([node], "rnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [steps, BATCH, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("y_h", TensorProto.FLOAT, None)], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("op,direction,attrs", [
    ("LSTM", "bidirectional", {}),
    ("GRU", "forward", {}),
    ("GRU", "reverse", {"linear_before_reset": 1}),
])
@pytest.mark.parametrize("steps", [1, 6])  # 2 and 12 rows of steps × batch: below and above RNN_TRANSPOSE_MIN_ROWS
def test_vectorized_recurrences_equal_onnxruntime(op, direction, attrs, steps, kernel_cache):
    from tessel.backends.cpu.packing import RNN_TRANSPOSE_MIN_ROWS

    assert BATCH < RNN_TRANSPOSE_MIN_ROWS <= 6 * BATCH
    original = _recurrent_model(op, direction, steps, **attrs)
    feeds = {"x": np.random.default_rng(1).standard_normal((steps, BATCH, WIDTH)).astype(np.float32)}
    outputs = compile(original, cache_dir=kernel_cache).run(feeds)
    assert_matches_onnxruntime(outputs, run_onnxruntime(original, feeds))


@pytest.mark.parametrize("op,attrs", [("LSTM", {}), ("GRU", {"linear_before_reset": 1})])
def test_unblocked_rows_and_saturated_gates_equal_onnxruntime(op, attrs, kernel_cache):
    # 5 hidden units: gate rows that no vector block divides, weight tiles with tails; inputs ×10 drive the
    # gates past the ±9 where the rational tanh saturates.
    original = _recurrent_model(op, "forward", 6, hidden=5, **attrs)
    feeds = {"x": 10 * np.random.default_rng(2).standard_normal((6, BATCH, WIDTH)).astype(np.float32)}
    outputs = compile(original, cache_dir=kernel_cache).run(feeds)
    assert_matches_onnxruntime(outputs, run_onnxruntime(original, feeds))


@pytest.mark.parametrize("op,hidden", [("GRU", HIDDEN), ("LSTM", 32)])
def test_input_projection_in_register_tiles_equals_onnxruntime(op, hidden, kernel_cache):
    from tessel.backends.lowering.rnn import PROJECTION_LANES, PROJECTION_ROWS, PROJECTION_TILE_K

    # 7 steps × 2 batch rows: whole register tiles of rows, then 14 % PROJECTION_ROWS rows one by one; a full tile of
    # Wᵀ columns, then a partial one adding into the first's sums; the LSTM's 128 gate rows in two blocks of lanes.
    steps, width = 7, PROJECTION_TILE_K + 8
    assert steps * BATCH % PROJECTION_ROWS and (4 * 32) // PROJECTION_LANES == 2
    original = _recurrent_model(op, "forward", steps, hidden=hidden, width=width)
    feeds = {"x": np.random.default_rng(3).standard_normal((steps, BATCH, width)).astype(np.float32)}
    outputs = compile(original, cache_dir=kernel_cache).run(feeds)
    assert_matches_onnxruntime(outputs, run_onnxruntime(original, feeds))


@pytest.mark.parametrize("steps,transposed", [(1, False), (6, True)])
def test_constant_weights_are_transposed_at_compile_time(steps, transposed):
    from tessel.backends.cpu.packing import RNN_TRANSPOSED, plan_packing
    from tessel.ir.types import TensorType

    model = _recurrent_model("LSTM", "bidirectional", steps)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    constants = [None, weights["W"], weights["R"], weights["B"]]
    types = [TensorType.of(np.zeros((steps, BATCH, WIDTH), np.float32))] + [TensorType.of(c) for c in constants[1:]]
    packing = plan_packing("LSTM", {"hidden_size": HIDDEN}, types, constants)
    if not transposed:
        assert packing is None
        return
    assert packing.attrs == ((RNN_TRANSPOSED, 1),)
    rows = weights["R"].shape[1]
    np.testing.assert_array_equal(packing.arrays[2][1, :, :rows], weights["R"][1].T)
    assert not packing.arrays[2][:, :, rows:].any()  # the row pad


def test_runtime_weights_transposed_in_the_kernel_equal_onnxruntime(kernel_cache):
    # W and R as graph inputs: no compile-time transpose, the kernel transposes them on every call.
    original = _recurrent_model("LSTM", "forward", 6)
    weights = {t.name: numpy_helper.to_array(t) for t in original.graph.initializer if t.name in ("W", "R")}
    del original.graph.initializer[:2]
    original.graph.input.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(array.shape))
                                for name, array in weights.items())
    feeds = {"x": np.random.default_rng(4).standard_normal((6, BATCH, WIDTH)).astype(np.float32), **weights}
    outputs = compile(original, cache_dir=kernel_cache).run(feeds)
    assert_matches_onnxruntime(outputs, run_onnxruntime(original, feeds))
