"""Depthwise and grouped convs: their CPU kernels (depthwise_conv.py, grouped_conv.py) and the generic rule equal
onnxruntime, whole-batch and per micro-batch; a depthwise conv between dense convs keeps their NCHW[16]c."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tessel import ir
from tessel.backends.cpu.grouped_tiles import TILE_REGISTERS, flat_tile, pointwise_rows, row_tile
from tessel.compiler.algo import find_layers
from tessel.compiler.api import compile as compile_model
from tessel.compiler.pipeline import run_pipeline, select_passes
from tessel.passes.conv_layout import blocked_values
from tests.backends.test_algorithms import BATCH, run_layer
from tests.conftest import assert_matches_onnxruntime, run_onnxruntime
from tests.ir.helpers import F, model

RNG = np.random.default_rng(7)

# (in channels, out channels, group, kernel, size, pads, strides, dilations)
CONVS = {
    "dw3x3_s1": (16, 16, 16, 3, 16, (1, 1, 1, 1), (1, 1), (1, 1)),
    "dw3x3_s1_w7": (40, 40, 40, 3, 7, (1, 1, 1, 1), (1, 1), (1, 1)),
    "dw3x3_s2_c20": (20, 20, 20, 3, 11, (1, 1, 1, 1), (2, 2), (1, 1)),
    "dw3x3_s2_w14": (24, 24, 24, 3, 28, (1, 1, 1, 1), (2, 2), (1, 1)),
    "dw5x5_s2_c16": (16, 16, 16, 5, 23, (2, 1, 2, 2), (2, 2), (1, 1)),
    "dw3x3_dilated_c24": (24, 24, 24, 3, 12, (2, 1, 2, 0), (1, 1), (2, 2)),
    "dw5x5_c8": (8, 8, 8, 5, 10, (2, 2, 2, 2), (1, 1), (1, 1)),
    "grouped2_1x1": (12, 20, 2, 1, 8, (0, 0, 0, 0), (1, 1), (1, 1)),
    "grouped3_3x3_s2": (9, 15, 3, 3, 9, (1, 0, 1, 1), (2, 2), (1, 1)),
    "grouped4_1x1_k34": (24, 136, 4, 1, 7, (0, 0, 0, 0), (1, 1), (1, 1)),
    "grouped4_1x1_k34_p64": (24, 136, 4, 1, 8, (0, 0, 0, 0), (1, 1), (1, 1)),
    "grouped4_1x1_k34_w14": (24, 136, 4, 1, 14, (0, 0, 0, 0), (1, 1), (1, 1)),
    "multiplier2": (6, 12, 6, 3, 8, (1, 1, 1, 1), (1, 1), (1, 1)),
}


def conv_relu_model(cin, cout, group, kernel, size, pads, strides, dilations):
    """Conv (with bias) then Relu on a BATCH × cin × size × size input."""
    weight = RNG.standard_normal((cout, cin // group, kernel, kernel)).astype(np.float32)
    bias = RNG.standard_normal(cout).astype(np.float32)
    conv = helper.make_node("Conv", ["x", "w", "b"], ["c"], group=group, pads=list(pads), strides=list(strides),
                            dilations=list(dilations))
    relu = helper.make_node("Relu", ["c"], ["y"])
    return model([conv, relu], [("x", F, [BATCH, cin, size, size])], [("y", F, None)], [("w", weight), ("b", bias)])


@pytest.mark.parametrize("case", sorted(CONVS))
def test_grouped_convs_equal_onnxruntime(case):
    onnx_model = conv_relu_model(*CONVS[case])
    cin, size = CONVS[case][0], CONVS[case][4]
    graph, _ = run_pipeline(ir.from_onnx(onnx_model), select_passes([]))
    (layer,) = find_layers(graph, "llvm", "all")
    depthwise = case.startswith("dw")
    assert layer.algorithms == ("nchwc" if depthwise else "grouped_gemm", "generic")
    x = RNG.standard_normal((BATCH, cin, size, size)).astype(np.float32)
    (want,) = run_onnxruntime(onnx_model, {"x": x})
    np.testing.assert_allclose(run_layer(onnx_model, layer.algorithms[0], BATCH, x), want, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(run_layer(onnx_model, layer.algorithms[0], 1, x), want, rtol=1e-3, atol=1e-4)
    if case == "dw3x3_s1":
        np.testing.assert_allclose(run_layer(onnx_model, "generic", BATCH, x), want, rtol=1e-3, atol=1e-4)


def test_depthwise_conv_after_a_channel_shuffle_equals_onnxruntime():
    """ShuffleNet's channel shuffle (Reshape, Transpose, Reshape) fused into the depthwise conv's kernel."""
    shape = np.array([BATCH, 4, 6, 10, 10], np.int64)
    flat = np.array([BATCH, 24, 10, 10], np.int64)
    nodes = [helper.make_node("Reshape", ["x", "split"], ["s"]),
             helper.make_node("Transpose", ["s"], ["t"], perm=[0, 2, 1, 3, 4]),
             helper.make_node("Reshape", ["t", "flat"], ["u"]),
             helper.make_node("Conv", ["u", "w", "b"], ["c"], group=24, pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    weights = [("split", shape), ("flat", flat), ("w", RNG.standard_normal((24, 1, 3, 3)).astype(np.float32)),
               ("b", RNG.standard_normal(24).astype(np.float32))]
    onnx_model = model(nodes, [("x", F, [BATCH, 24, 10, 10])], [("y", F, None)], weights)
    x = RNG.standard_normal((BATCH, 24, 10, 10)).astype(np.float32)
    (want,) = run_onnxruntime(onnx_model, {"x": x})
    np.testing.assert_allclose(run_layer(onnx_model, "nchwc", BATCH, x), want, rtol=1e-3, atol=1e-4)


def test_depthwise_conv_keeps_blocks_between_dense_convs(kernel_cache):
    """1×1 conv → depthwise 3×3 → 1×1 conv (with ReLUs): the depthwise conv reads and writes NCHW[16]c (its
    channel-blocked kernel) and the compiled model matches onnxruntime."""
    weights = [("w1", RNG.standard_normal((32, 8, 1, 1)).astype(np.float32)),
               ("w2", RNG.standard_normal((32, 1, 3, 3)).astype(np.float32)),
               ("w3", RNG.standard_normal((16, 32, 1, 1)).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"]), helper.make_node("Relu", ["a"], ["ar"]),
             helper.make_node("Conv", ["ar", "w2"], ["d"], group=32, pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["d"], ["dr"]), helper.make_node("Conv", ["dr", "w3"], ["y"])]
    onnx_model = model(nodes, [("x", F, [1, 8, 14, 14])], [("y", F, None)], weights)
    graph, _ = run_pipeline(ir.from_onnx(onnx_model), select_passes([]))
    assert len(blocked_values(graph)) == 2
    compiled = compile_model(onnx_model, cache_dir=kernel_cache)
    x = RNG.standard_normal((1, 8, 14, 14)).astype(np.float32)
    assert_matches_onnxruntime(compiled.run({"x": x}), run_onnxruntime(onnx_model, {"x": x}))


@pytest.mark.parametrize("out_per_group,pixels", [(34, 784), (28, 3136), (68, 64), (7, 48), (1, 16)])
def test_flat_tile_is_whole_and_fits_the_registers(out_per_group, pixels):
    rows, width = flat_tile(out_per_group, pixels)
    assert out_per_group % rows == 0 and pixels % width == 0 and width % 16 == 0
    assert rows * width // 16 <= TILE_REGISTERS


@pytest.mark.parametrize("out_per_group,oh,ow", [(68, 14, 14), (34, 10, 12), (5, 9, 20), (1, 3, 9)])
def test_row_tile_is_whole_and_fits_the_registers(out_per_group, oh, ow):
    rows, image_rows = row_tile(out_per_group, oh, ow)
    assert out_per_group % rows == 0 and oh % image_rows == 0
    assert rows * image_rows * -(-ow // 16) <= TILE_REGISTERS


def test_pointwise_tiles_need_whole_vectors_or_rows_over_8_pixels():
    assert flat_tile(68, 196) is None and flat_tile(136, 49) is None
    assert row_tile(136, 7, 7) is None and pointwise_rows(136, 7, 7) is None
    assert pointwise_rows(68, 14, 14) == row_tile(68, 14, 14)[0]


def test_grouped_pointwise_conv_with_a_residual_equals_onnxruntime():
    """ShuffleNet's unit end: a grouped 1×1 conv (the pointwise kernel), plus a residual, then Relu, in one kernel."""
    weight = RNG.standard_normal((32, 8, 1, 1)).astype(np.float32)
    bias = RNG.standard_normal(32).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=4),
             helper.make_node("Add", ["c", "x"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    onnx_model = model(nodes, [("x", F, [BATCH, 32, 8, 12])], [("y", F, None)], [("w", weight), ("b", bias)])
    x = RNG.standard_normal((BATCH, 32, 8, 12)).astype(np.float32)
    (want,) = run_onnxruntime(onnx_model, {"x": x})
    np.testing.assert_allclose(run_layer(onnx_model, "grouped_gemm", BATCH, x), want, rtol=1e-3, atol=1e-4)
