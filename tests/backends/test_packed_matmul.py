"""Constant matmul weights whose columns do not fill whole 16-wide panels are packed (the last panel zero-padded)
and run the packed kernel, equal to onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tessel.backends.cpu.packing import MATMUL_BLOCK, MATMUL_PANEL, plan_packing
from tessel.compiler.api import compile as compile_model
from tessel.ir.types import TensorType
from tests.conftest import assert_matches_onnxruntime, run_onnxruntime
from tests.ir.helpers import F, model

RNG = np.random.default_rng(5)
ROWS, DEPTH = 6, 24


def _matmul_bias(columns: int):
    """x (2, 3, 24) · w (24, N) + b, then Relu: the packed kernel with a fused epilogue."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    return model(nodes, [("x", F, [2, 3, DEPTH])], [("y", F, None)],
                 [("w", RNG.standard_normal((DEPTH, columns)).astype(np.float32)),
                  ("b", RNG.standard_normal(columns).astype(np.float32))])


def _gemm_trans_b(columns: int):
    node = helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1, alpha=0.5, beta=2.0)
    return model([node], [("x", F, [ROWS, DEPTH])], [("y", F, None)],
                 [("w", RNG.standard_normal((columns, DEPTH)).astype(np.float32)),
                  ("b", RNG.standard_normal(columns).astype(np.float32))])


def test_partial_panels_are_packed_narrow_weights_are_not():
    def packing(columns):
        weight = np.zeros((DEPTH, columns), np.float32)
        types = [TensorType("float32", (ROWS, DEPTH)), TensorType.of(weight)]
        return plan_packing("MatMul", {}, types, [None, weight])

    packed = packing(2 * MATMUL_PANEL + 8)
    assert packed.attrs == ((MATMUL_BLOCK, MATMUL_PANEL),)
    assert packed.arrays[1].shape == (3, DEPTH, MATMUL_PANEL) and not packed.arrays[1][2, :, 8:].any()
    assert packing(MATMUL_PANEL - 4) is None


@pytest.mark.parametrize("make,columns,x_shape", [(_matmul_bias, 40, (2, 3, DEPTH)), (_gemm_trans_b, 20, (ROWS, DEPTH))],
                         ids=["matmul_40", "gemm_trans_b_20"])
def test_partial_panel_matmul_equals_onnxruntime(make, columns, x_shape, kernel_cache):
    original = make(columns)
    x = RNG.standard_normal(x_shape).astype(np.float32)
    outputs = compile_model(original, cache_dir=kernel_cache).run({"x": x})
    assert_matches_onnxruntime(outputs, run_onnxruntime(original, {"x": x}))


def _rows_matmul(rows: int, columns: int):
    """x (rows, 24) · w (24, N) + b: few rows, the panels grouped in one tile (INDEPENDENT_ACCUMULATORS)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    return model(nodes, [("x", F, [rows, DEPTH])], [("y", F, None)],
                 [("w", RNG.standard_normal((DEPTH, columns)).astype(np.float32)),
                  ("b", RNG.standard_normal(columns).astype(np.float32))])


@pytest.mark.parametrize("rows,columns", [(1, 128), (1, 40), (2, 96), (4, 100), (3, 7 * MATMUL_PANEL)],
                         ids=["vector_8_panels", "vector_3_panels", "2_rows_6_panels", "4_rows_7_panels",
                              "3_rows_7_panels"])
def test_few_row_products_group_panels_and_equal_onnxruntime(rows, columns, kernel_cache):
    original = _rows_matmul(rows, columns)
    x = RNG.standard_normal((rows, DEPTH)).astype(np.float32)
    outputs = compile_model(original, cache_dir=kernel_cache).run({"x": x})
    assert_matches_onnxruntime(outputs, run_onnxruntime(original, {"x": x}))
