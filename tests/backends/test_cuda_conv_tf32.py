"""The TF32 tensor-core conv (backends/cuda/conv_tf32.py, cuda/mma.py) on the CPU: its fragment layouts, its
arithmetic (the unscheduled kernel on llvm, TF32 rounding included) and its CUDA code; the GPU runs it in
bench/gpu_tune.py and bench/gpu_check.py."""
from __future__ import annotations

import re

import numpy as np
import pytest

from tessel.backends.cuda import mma
from tessel.backends.cuda.conv_tf32 import MmaConfig, heuristic_mma_config
from tessel.backends.target import TargetError, TargetSpec, parse_target, tvm_target
from tessel.backends.tvm_env import tvm
from tessel.compiler.options import CompileError, CompileOptions

from .test_cuda_conv import SHAPES, _conv, _reference


def _bijection(layout, rows: int, cols: int, registers: int) -> dict:
    seen = {layout(r, c): (r, c) for r in range(rows) for c in range(cols)}
    assert set(seen) == {(lane, reg) for lane in range(32) for reg in range(registers)}
    return seen


def test_fragment_layouts_are_the_ptx_m16n8k8_tf32_ones():
    a = _bijection(mma.a_layout, 16, 8, 4)
    b = _bijection(mma.b_layout, 8, 16, 4)
    c = _bijection(mma.c_layout, 16, 16, 8)
    for lane in range(32):
        group, member = lane // 4, lane % 4
        # PTX ISA, m16n8k8 .tf32: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4); b0 (t, g), b1 (t + 4, g)
        assert [a[(lane, r)] for r in range(4)] == [(group, member), (group + 8, member), (group, member + 4),
                                                    (group + 8, member + 4)]
        assert [b[(lane, r)] for r in range(2)] == [(member, group), (member + 4, group)]
        assert [b[(lane, r)] for r in (2, 3)] == [(member, group + 8), (member + 4, group + 8)]
        # c0 c1 (g, 2t and 2t + 1), c2 c3 (g + 8, ...); registers 4-7 the same for columns 8-15
        assert [c[(lane, r)] for r in range(4)] == [(group, 2 * member), (group, 2 * member + 1),
                                                    (group + 8, 2 * member), (group + 8, 2 * member + 1)]
        for register in range(4):
            assert mma.a_element(lane, register) == a[(lane, register)]
            assert mma.b_element(lane, register) == b[(lane, register)]


# Importing TVM's CUDA tensor intrinsics parses every one of them (20 s to a minute on two cores): the tests that
# need them run with `pytest -m slow`.
@pytest.mark.slow
def test_accumulator_layout_is_the_one_tvms_fill_and_store_use():
    from tvm.s_tir.tensor_intrin.cuda import shared_16x16_to_ldmatrix_32x8_layout

    assert all(tuple(int(v) for v in shared_16x16_to_ldmatrix_32x8_layout(r, c)) == mma.c_layout(r, c)
               for r in range(16) for c in range(16))


def _round_tf32(a: np.ndarray) -> np.ndarray:
    bits = a.astype(np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


@pytest.mark.parametrize("name,config", [("3x3_odd_sizes", MmaConfig(32, 32, 16, 1, 1, 1)),
                                         ("dilated_uneven_pads", MmaConfig(32, 64, 8, 1, 2, 4))])
def test_unscheduled_kernel_is_the_conv_of_tf32_rounded_inputs(name, config):
    mod = tvm()
    tensors, _, out_type = _conv(SHAPES[name], config)
    executable = mod.compile(mod.te.create_prim_func(tensors), target="llvm")
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal([int(d) for d in t.shape]).astype(np.float32) for t in tensors[:3])
    out = mod.runtime.tensor(np.zeros(out_type.shape, np.float32))
    executable["main"](*(mod.runtime.tensor(a) for a in (x, w, b)), out)
    _, _, _, _, _, _, stride, dilation, pads = SHAPES[name]
    np.testing.assert_allclose(out.numpy(), _reference(_round_tf32(x), _round_tf32(w), b, stride, dilation, pads),
                               rtol=1e-5, atol=1e-5)
    assert not np.allclose(_round_tf32(x), x)  # the rounding is there to be seen


@pytest.mark.slow  # imports TVM's CUDA tensor intrinsics, as above
def test_schedule_compiles_to_tf32_mma_with_every_fragment_in_registers():
    config = MmaConfig(128, 128, 32, 2, 2, 2)
    mod = tvm()
    tensors, result, _ = _conv((2, 64, 14, 14, 128, (3, 3), 1, 1, (1, 1, 1, 1)), config, with_relu=True)
    sch = mod.s_tir.Schedule(mod.te.create_prim_func(tensors))
    result.schedule(sch)
    func = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    pipeline, options = mma.compile_options(func)
    target = TargetSpec("cuda", "sm_90", tf32=True)
    with tvm_target(target), mod.transform.PassContext(config=options):
        executable = mod.compile(mod.IRModule({"main": func}), target=tvm_target(target), tir_pipeline=pipeline)
    source = next(m for m in executable.mod.imports if m.kind == "cuda").inspect_source()
    assert source.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32") == 2
    assert source.count("__global__") == 4  # the tiles, then the sum with the bias and the ReLU
    # Every warp buffer became per-lane registers: a warp's fragments divided by its 32 lanes.
    warp_m, warp_n = config.bm // config.warps_m, config.bn // config.warps_n
    sizes = {name: int(size) for name, size in re.findall(r"float (\w+_warp_ptr)\[(\d+)\]", source)}
    assert sizes == {"conv_gemm_partial_warp_ptr": warp_m * warp_n // 32,
                     "conv_weights_shared_warp_ptr": warp_m * 8 // 32, "conv_columns_shared_warp_ptr": warp_n * 8 // 32}
    assert "max(" in source.split("main_kernel_1")[-1]


def test_heuristic_mma_config_fills_the_gpu():
    small = heuristic_mma_config(512, 49, 4608)
    assert small.split_k > 1 and small.threads <= 1024
    big = heuristic_mma_config(64, 200704, 147)
    assert big.split_k == 1
    for m, n, k in [(16, 12, 27), (1, 1, 1), (1024, 3, 9)]:
        config = heuristic_mma_config(m, n, k)
        assert config.threads <= 1024 and config.bk % 8 == 0
    with pytest.raises(ValueError):
        MmaConfig(64, 64, 12, 2, 2)


def test_tf32_is_a_target_feature_of_cuda_from_sm_80():
    spec = parse_target("cuda:sm_90+tf32")
    assert spec == TargetSpec("cuda", "sm_90", tf32=True) and str(spec) == "cuda:sm_90+tf32"
    assert parse_target(str(spec)) == spec and not parse_target("cuda:sm_90").tf32
    with pytest.raises(TargetError, match="sm_80"):
        parse_target("cuda:sm_75+tf32")
    assert CompileOptions(target="cuda:sm_80", allow_tf32=True).target == "cuda:sm_80+tf32"
    with pytest.raises(CompileError, match="--allow-tf32"):
        CompileOptions(target="llvm", allow_tf32=True)


def test_tf32_takes_the_faster_of_the_timed_tensor_core_and_simt_tiles(tmp_path, monkeypatch):
    from tessel.backends.cuda import conv as cuda_conv
    from tessel.backends.cuda.conv import ConvShape, GemmConfig, chosen_config

    small, big, untimed = (ConvShape(b, 64, 56, 56, 64, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)) for b in (1, 16, 2))
    simt, tensor = GemmConfig(32, 32, 16, 2, 2, 1), MmaConfig(128, 128, 16, 2, 4, 1)
    table = {"sm_90": {s.key(): {"config": simt.to_json(), "ms": 0.04} for s in (small, big)},
             "sm_90+tf32": {small.key(): {"config": tensor.to_json(), "ms": 0.10},
                            big.key(): {"config": tensor.to_json(), "ms": 0.03}}}
    (tmp_path / "conv_configs.json").write_text(__import__("json").dumps({"archs": table}))
    monkeypatch.setattr(cuda_conv, "TUNED_CONFIGS", tmp_path / "conv_configs.json")
    cuda_conv._tuned.cache_clear()
    try:
        assert chosen_config(small, "sm_90", tf32=True) == (simt, True)  # the SIMT tiles were faster here
        assert chosen_config(big, "sm_90", tf32=True) == (tensor, True)
        assert chosen_config(big, "sm_90") == (simt, True)  # without TF32 allowed, never tensor cores
        assert chosen_config(untimed, "sm_90", tf32=True) == (heuristic_mma_config(*untimed.gemm), False)
    finally:
        cuda_conv._tuned.cache_clear()
