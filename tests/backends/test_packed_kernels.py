"""The packed conv kernel (backends/cpu/packed_kernels.py): a Concat fused into it, its register tiles."""
from __future__ import annotations

import numpy as np
from onnx import helper

from tessel import ir
from tessel.backends.cpu.packing import CONV_BLOCKS
from tessel.backends.kernel import ALGORITHM
from tessel.backends.lower import schedule_kernel
from tessel.backends.target import parse_target
from tessel.backends.tvm_env import tvm
from tessel.compiler.api import compile
from tessel.compiler.pipeline import run_pipeline, select_passes
from tessel.compiler.program import build_program
from tests.conftest import assert_matches_onnxruntime, run_onnxruntime
from tests.ir.helpers import F, model
from tests.passes.test_conv_layout import pass_through_model

LLVM = parse_target("llvm")


def _lowered(spec) -> str:
    """The kernel's TIR after TVM's passes up to loop partitioning (as tvm.compile runs them), as text."""
    tvm_mod = tvm()
    s_tir, tirx = tvm_mod.s_tir, tvm_mod.tirx
    func, _ = schedule_kernel(spec, LLVM)
    passes = [s_tir.transform.CanonicalizeLoop(), s_tir.transform.LowerInitBlock(),
              s_tir.transform.PlanAndUpdateBufferAllocationLocation(), s_tir.transform.ConvertBlocksToOpaque(),
              s_tir.transform.CompactBufferAllocation(), s_tir.transform.LowerMatchBuffer(),
              s_tir.transform.StmtSimplify(), s_tir.transform.LowerOpaqueBlock(), tirx.transform.FlattenBuffer(),
              s_tir.transform.LoopPartition(), tirx.transform.StmtSimplify()]
    return tvm_mod.ir.transform.Sequential(passes)(tvm_mod.IRModule({"main": func}))["main"].script()


def test_a_conv_over_a_concat_of_blocks_reads_each_part_in_its_own_loop():
    # e: a 1 × 1 conv over the concat of c and its two pools (32 channels, two blocks, each), all kept blocked.
    graph, _ = run_pipeline(ir.from_onnx(pass_through_model()), select_passes([]))
    program = build_program(graph, LLVM)
    spec = next(spec for spec in program.kernels.values()
                if [m.spec.op_type for m in spec.members()][:2] == ["Concat", "Conv"])
    loops = [line.strip() for line in _lowered(spec).splitlines() if line.strip().startswith("for ico")]
    # One loop over each part's two input-channel blocks, none choosing its part per element (before: one loop
    # over all six blocks, an if_then_else per element read).
    assert loops == ["for ico, ici in T.grid(2, 16):"] * 3
    assert "if_then_else" not in _lowered(spec)


def test_rows_of_10_and_20_pixels_run_10_pixel_tiles_equal_onnxruntime(kernel_cache):
    rng = np.random.default_rng(4)
    for size in (10, 20):
        weight = (rng.standard_normal((32, 16, 3, 3)) / 12).astype(np.float32)
        conv = model([helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])],
                     [("x", F, [1, 16, size, size])], [("y", F, None)], [("w", weight)])
        graph, _ = run_pipeline(ir.from_onnx(conv), select_passes([]))
        (spec,) = build_program(graph, LLVM).kernels.values()
        # Tiles of 10 pixels (20 accumulators) cover the row exactly; 7 padded it to 14 or 21.
        assert "q_1 in T.unroll(10)" in schedule_kernel(spec, LLVM)[0].script()
        x = rng.standard_normal((1, 16, size, size)).astype(np.float32)
        assert_matches_onnxruntime(compile(conv, cache_dir=kernel_cache).run({"x": x}), run_onnxruntime(conv, {"x": x}))


def test_padded_convs_on_blocks_read_them_in_place_equal_onnxruntime(kernel_cache):
    # a (1 × 1, on the NCHW input: packed) keeps its result blocked for b (3 × 3 on 40-pixel rows: Winograd's default
    # on blocks) and c (3 × 3, stride 2, from b's 40-pixel rows to 20: two 10-pixel tiles), which runs direct on the
    # blocks, checking the padding only in its edge tiles and rows.
    rng = np.random.default_rng(6)
    shapes = {"a": (32, 16, 1, 1), "b": (32, 32, 3, 3), "c": (32, 32, 3, 3)}
    weights = [(f"w{n}", (rng.standard_normal(s) / np.sqrt(np.prod(s[1:]))).astype(np.float32))
               for n, s in shapes.items()]
    nodes = [helper.make_node("Conv", ["x", "wa"], ["a"]), helper.make_node("Relu", ["a"], ["ar"]),
             helper.make_node("Conv", ["ar", "wb"], ["b"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["b", "wc"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2])]
    convs = model(nodes, [("x", F, [1, 16, 40, 40])], [("c", F, None)], weights)
    graph, _ = run_pipeline(ir.from_onnx(convs), select_passes([]))
    chosen = sorted(str(dict(m.spec.attrs).get(ALGORITHM)) for spec in build_program(graph, LLVM).kernels.values()
                    for m in spec.members() if m.spec.op_type == "Conv")
    assert chosen == ["None", "direct", "winograd"]
    x = rng.standard_normal((1, 16, 40, 40)).astype(np.float32)
    assert_matches_onnxruntime(compile(convs, cache_dir=kernel_cache).run({"x": x}), run_onnxruntime(convs, {"x": x}))


def _odd_rows_model(size: int):
    """x (3 channels, size²) → a: 3 × 3 stride 2 + ReLU, kept blocked → b: 1 × 1 to 16 channels → c: 1 × 1 to 63
    channels, the output; with the kernels by their output channels (spec, conv attributes)."""
    rng = np.random.default_rng(7)
    shapes = {"a": (32, 3, 3, 3), "b": (16, 32, 1, 1), "c": (63, 16, 1, 1)}
    weights = [(f"w{n}", (rng.standard_normal(s) / np.sqrt(np.prod(s[1:]))).astype(np.float32))
               for n, s in shapes.items()]
    nodes = [helper.make_node("Conv", ["x", "wa"], ["a"], kernel_shape=[3, 3], strides=[2, 2]),
             helper.make_node("Relu", ["a"], ["ar"]), helper.make_node("Conv", ["ar", "wb"], ["b"]),
             helper.make_node("Conv", ["b", "wc"], ["c"])]
    convs = model(nodes, [("x", F, [1, 3, size, size])], [("c", F, None)], weights)
    graph, _ = run_pipeline(ir.from_onnx(convs), select_passes([]))
    specs = {}
    for spec in build_program(graph, LLVM).kernels.values():
        conv = next(m.spec for m in spec.members() if m.spec.op_type == "Conv")
        specs[int(conv.outputs[0].split(",")[1])] = (spec, dict(conv.attrs))
    return convs, specs


def test_odd_rows_unpack_blocks_by_vectors_run_direct_tiles_and_pad_channels_to_pairs_equal_onnxruntime(kernel_cache):
    # Rows of 13 pixels: a (packed, on the NCHW image) runs 13-pixel tiles, not 14 padding them, and writes them
    # straight to its blocks; b (1 × 1 on those blocks) runs direct in 13-pixel tiles (no tile of CONV_TILE_CHOICES
    # divides 13); c: 63 output channels, padded to two 32-channel tiles (64) instead of four 16-channel ones, in
    # 13-pixel tiles too.
    # Rows of 25 pixels (two 14-pixel tiles, 13 does not divide them): a unpacks each row from its tile buffer one
    # 16-channel vector per pixel (along the pixels: a gather and a scatter).
    rng = np.random.default_rng(8)
    for size in (27, 51):
        convs, specs = _odd_rows_model(size)
        (a, _), (b, b_attrs), (c, c_attrs) = specs[32], specs[16], specs[63]
        if size == 27:
            assert all("q_1 in T.unroll(13)" in schedule_kernel(k, LLVM)[0].script() for k in (a, b, c))
            assert b_attrs.get(ALGORITHM) == "direct" and c_attrs[CONV_BLOCKS][1] == 32
        else:
            unpack = [line.strip() for line in _lowered(a).splitlines() if "T.vectorized" in line][-1]
            assert unpack == "for ax0_1 in T.vectorized(16):"
        x = rng.standard_normal((1, 3, size, size)).astype(np.float32)
        assert_matches_onnxruntime(compile(convs, cache_dir=kernel_cache).run({"x": x}),
                                   run_onnxruntime(convs, {"x": x}))
