"""The generic CPU schedule's row reductions: lanes split each row (rfactor), and the results equal onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tessel.backends.cpu import schedule as cpu_schedule
from tessel.backends.tvm_env import tvm
from tessel.compiler.api import compile
from tests.conftest import run_onnxruntime
from tests.ir.helpers import model

ROWS = 5


def _reduce_model(op: str, cols: int, axis: int) -> onnx.ModelProto:
    shape = [ROWS, 3, cols]
    if op in ("Softmax", "LogSoftmax"):
        node = helper.make_node(op, ["x"], ["y"], axis=axis)
        out_shape = shape
        initializers = []
    elif op == "GlobalMaxPool":
        node = helper.make_node(op, ["x"], ["y"])
        out_shape = shape[:2] + [1]
        initializers = []
    else:
        node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=1)
        out_shape = [1 if k == axis % 3 else d for k, d in enumerate(shape)]
        initializers = [("axes", np.array([axis], np.int64))]
    return model([node], [("x", TensorProto.FLOAT, shape)], [("y", TensorProto.FLOAT, out_shape)], initializers)


# Row lengths: no lane count divides 6625 or 1001 (a partial last vector), 16 divides 1024; 64 is the shortest row
# that takes the lanes. axis 1 is not a row (its elements are `cols` apart): the old schedule serves it.
ROW_SHAPES = [(6625, -1), (1001, -1), (1024, -1), (64, -1), (1001, 1)]
ROW_CASES = [(op, cols, axis) for op in ("ReduceSum", "ReduceMax", "ReduceMin", "ReduceMean", "ReduceLogSumExp",
                                         "Softmax", "LogSoftmax", "GlobalMaxPool")
             for cols, axis in ROW_SHAPES if op != "GlobalMaxPool" or axis == -1]  # it pools the last axis


@pytest.mark.parametrize("op,cols,axis", ROW_CASES)
def test_row_reductions_equal_onnxruntime(op, cols, axis, tmp_path, kernel_cache):
    path = tmp_path / "reduce.onnx"
    onnx.save(_reduce_model(op, cols, axis), path)
    x = np.random.default_rng(cols).standard_normal((ROWS, 3, cols)).astype(np.float32) * 4
    x[1, 2, cols // 2] = 30.0  # one large value: the max and the softmax see it from inside a lane
    artifact = compile(str(path), cache_dir=kernel_cache)
    got = artifact.executor().run({"x": x})["y"]
    # Sums that cancel keep the rounding of their order (lanes here, onnxruntime's own there): held to the terms'
    # magnitude.
    atol = 1e-6 * float(np.abs(x).sum(axis).max()) if op == "ReduceSum" else 1e-6
    np.testing.assert_allclose(got, run_onnxruntime(str(path), {"x": x})[0], rtol=2e-5, atol=atol)


# ReduceMax, ReduceMin and GlobalMaxPool keep NaNs by a select TVM's rfactor does not know: they split their lanes
# in the lowering (lowering/reduce.py); the sum splits them in the schedule.
@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin", "GlobalMaxPool", "ReduceSum"])
def test_a_nan_anywhere_in_a_row_reaches_its_result(op, tmp_path, kernel_cache):
    path = tmp_path / "reduce.onnx"
    onnx.save(_reduce_model(op, 1001, -1), path)
    x = np.ones((ROWS, 3, 1001), np.float32)
    x[0, 0, 5], x[2, 1, 1000] = np.nan, np.nan  # one in a whole vector, one in the partial last vector
    got = compile(str(path), cache_dir=kernel_cache).executor().run({"x": x})["y"]
    assert np.isnan(got[0, 0, 0]) and np.isnan(got[2, 1, 0])
    assert np.isfinite(np.delete(got.reshape(-1), [0, 2 * 3 + 1])).all()


def _scheduled_script(cols: int, axis: int) -> str:
    mod = tvm()
    x = mod.te.placeholder((ROWS, cols), "float32", name="x")
    func = mod.te.create_prim_func([x, mod.topi.sum(x, axis, True)])
    return cpu_schedule.schedule(func).script()


def test_a_row_sum_accumulates_in_vector_lanes_and_a_column_sum_does_not():
    row = _scheduled_script(6625, 1)
    assert f"x_red_rf = T.sblock_alloc_buffer(({ROWS}, 1, {cpu_schedule.REDUCTION_LANES}))" in row
    assert f"T.grid({6625 // cpu_schedule.REDUCTION_LANES}, {cpu_schedule.REDUCTION_LANES})" in row  # no tail in it
    assert "_rf" not in _scheduled_script(6625, 0)
    assert "_rf" not in _scheduled_script(cpu_schedule.ROW_REDUCTION_MIN - 1, 1)


def test_a_fused_bias_and_softmax_over_an_odd_row_equals_onnxruntime(tmp_path, kernel_cache):
    cols = 1001
    nodes = [helper.make_node("Add", ["x", "bias"], ["s"]), helper.make_node("Softmax", ["s"], ["y"], axis=-1)]
    rng = np.random.default_rng(3)
    path = tmp_path / "bias_softmax.onnx"
    onnx.save(model(nodes, [("x", TensorProto.FLOAT, [1, 40, cols])], [("y", TensorProto.FLOAT, [1, 40, cols])],
                    [("bias", rng.standard_normal(cols).astype(np.float32))]), path)
    x = rng.standard_normal((1, 40, cols)).astype(np.float32) * 4
    got = compile(str(path), cache_dir=kernel_cache).executor().run({"x": x})["y"]
    np.testing.assert_allclose(got, run_onnxruntime(str(path), {"x": x})[0], rtol=2e-5, atol=1e-6)


def test_an_elementwise_row_no_lane_count_divides_runs_whole_vectors_then_its_tail():
    mod = tvm()
    x = mod.te.placeholder((ROWS, 1001), "float32", name="x")
    b = mod.te.placeholder((1001,), "float32", name="b")
    script = cpu_schedule.schedule(mod.te.create_prim_func([x, b, mod.topi.add(x, b)])).script()
    assert "in T.vectorized(16)" in script and "range(992, 1001)" in script  # 62 vectors of 16, then 9


def test_a_reduction_over_several_axes_keeps_its_lane_partials_across_the_outer_ones(tmp_path, kernel_cache):
    mod = tvm()
    x = mod.te.placeholder((ROWS, 7, 1001), "float32", name="x")
    script = cpu_schedule.schedule(mod.te.create_prim_func([x, mod.topi.sum(x, [1, 2], True)])).script()
    init, outer = script.index("x_red_rf_init"), script.index("for k1 in range(7)")
    assert init < outer and "for k2_1_init in T.vectorized(16)" in script  # partials start once, above axis 1
    path = tmp_path / "sum12.onnx"
    onnx.save(model([helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)],
                    [("x", TensorProto.FLOAT, [ROWS, 7, 1001])], [("y", TensorProto.FLOAT, [ROWS, 1, 1])],
                    [("axes", np.array([1, 2], np.int64))]), path)
    data = np.random.default_rng(5).standard_normal((ROWS, 7, 1001)).astype(np.float32)
    got = compile(str(path), cache_dir=kernel_cache).executor().run({"x": data})["y"]
    np.testing.assert_allclose(got, data.astype(np.float64).sum((1, 2), keepdims=True), rtol=0,
                               atol=1e-6 * float(np.abs(data).sum((1, 2)).max()))


def _layer_norm_script(rows: int, cols: int, axis: int = 1) -> str:
    mod = tvm()
    te, topi = mod.te, mod.topi
    x = te.placeholder((rows, cols), "float32", name="x")
    count = mod.tirx.const(float(rows if axis == 0 else cols), "float32")
    centered = topi.subtract(x, topi.divide(topi.sum(x, axis, True), count))
    inv_std = topi.rsqrt(topi.divide(topi.sum(topi.multiply(centered, centered), axis, True), count))
    return cpu_schedule.schedule(te.create_prim_func([x, topi.multiply(centered, inv_std)])).script()


def _outer_loops(script: str) -> int:
    """Outermost loops of a scheduled kernel (one per block, or one for all)."""
    return sum(1 for line in script.splitlines() if line.startswith("    for "))


def test_a_row_normalization_runs_every_block_in_one_parallel_loop_over_the_rows():
    script = _layer_norm_script(64, 256)
    assert _outer_loops(script) == 1 and script.count("T.parallel(") == 1 and "T.parallel(64)" in script
    assert script.count("_rf_update") == 2 and script.count("in T.vectorized(16)") >= 5  # sums in lanes, maps in vectors


def test_statistics_over_the_rows_or_few_rows_keep_a_loop_per_block():
    assert _outer_loops(_layer_norm_script(256, 64, axis=0)) > 1  # a column's mean needs every row first
    assert _outer_loops(_layer_norm_script(cpu_schedule.ROWS_TOGETHER_MIN - 1, 4096)) > 1
    mod = tvm()
    a, b = mod.te.placeholder((64, 256), "float32", name="a"), mod.te.placeholder((256, 64), "float32", name="b")
    product = mod.topi.add(mod.topi.matmul(a, b), mod.tirx.const(1.0, "float32"))
    # A product reads b across rows: it keeps its register tiles, not row by row.
    assert "_rf" not in cpu_schedule.schedule(mod.te.create_prim_func([a, b, product])).script()


@pytest.mark.parametrize("op,shape", [("LayerNormalization", [64, 256]), ("Softmax", [4, 64, 64]),
                                      ("LayerNormalization", [8, 3, 1024])])
def test_row_normalizations_run_row_by_row_equal_onnxruntime(op, shape, tmp_path, kernel_cache):
    rng = np.random.default_rng(11)
    cols = shape[-1]
    if op == "Softmax":
        node, initializers = helper.make_node(op, ["x"], ["y"], axis=-1), []
    else:
        node = helper.make_node(op, ["x", "scale", "bias"], ["y"], axis=-1, epsilon=1e-5)
        initializers = [("scale", rng.standard_normal(cols).astype(np.float32)),
                        ("bias", rng.standard_normal(cols).astype(np.float32))]
    path = tmp_path / "rows.onnx"
    onnx.save(model([node], [("x", TensorProto.FLOAT, shape)], [("y", TensorProto.FLOAT, shape)], initializers), path)
    x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    got = compile(str(path), cache_dir=kernel_cache).executor().run({"x": x})["y"]
    np.testing.assert_allclose(got, run_onnxruntime(str(path), {"x": x})[0], rtol=2e-5, atol=2e-5)
