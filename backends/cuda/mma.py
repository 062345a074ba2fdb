"""TF32 tensor-core intrinsics for TVM schedules: `mma.sync.m16n8k8` on 16 x 16 x 8 warp tiles.

TVM ships MMA intrinsics for float16 and int8 only, and its WMMA code
generator refuses float32 fragments, so the TF32 ones are defined here the
same way: a warp holds a 16 x 8 tile of A, an 8 x 16 tile of B and a 16 x 16
tile of C in "warp" memory, laid out (lane, register) as the PTX ISA gives
the m16n8k8 .tf32 fragments (9.7.14.5.7: with g = lane / 4 and t = lane % 4,
A's registers hold rows g, g + 8 at columns t, t + 4; B's hold rows t, t + 4
of column g; C's rows g, g + 8 at columns 2t, 2t + 1). One 16 x 16 x 8 step is
two instructions, one per 8-column half of B and C. The loads from shared
memory are plain per-lane reads (ldmatrix moves 16-bit elements only).

Two things TVM 0.27 needs beside a schedule that uses them (`compile_options`):
its LowerWarpMemory rewrites only the first warp buffer of a statement
sequence, so the pass is repeated (once per warp buffer); and the pass cannot
read a store index that common-subexpression elimination has hidden in a
variable, so CSE is off for these kernels (nvcc does its own).
"""
from __future__ import annotations

import functools

from ..tvm_env import tvm

LOAD_A, LOAD_B, MMA_SYNC = "tessel_tf32_load_a", "tessel_tf32_load_b", "tessel_tf32_mma_16x16x8"
FILL, STORE = "tessel_f32_fill_16x16", "tessel_f32_store_16x16_global"
PIPELINE = "tessel_warp_mma"
WARP_SIZE = 32
# Warp buffers in one kernel: C, A and B (LowerWarpMemory runs once for each).
WARP_BUFFERS = 3


def a_layout(row, col):
    """(lane, register) of element (row, col) of a 16 x 8 A tile."""
    return 4 * (row % 8) + col % 4, row // 8 + 2 * (col // 4)


def a_element(lane, register):
    """The (row, col) of A that `lane` holds in `register` (the inverse of a_layout)."""
    return lane // 4 + 8 * (register % 2), lane % 4 + 4 * (register // 2)


def b_layout(row, col):
    """(lane, register) of element (row, col) of an 8 x 16 B tile (registers 0-1: columns 0-7, 2-3: 8-15)."""
    return 4 * (col % 8) + row % 4, 2 * (col // 8) + row // 4


def b_element(lane, register):
    """The (row, col) of B that `lane` holds in `register` (the inverse of b_layout)."""
    return lane % 4 + 4 * (register % 2), lane // 4 + 8 * (register // 2)


def c_layout(row, col):
    """(lane, register) of element (row, col) of a 16 x 16 C tile (registers 0-3: columns 0-7, 4-7: 8-15)."""
    return 4 * (row % 8) + (col % 8) // 2, 4 * (col // 8) + 2 * (row // 8) + col % 2


@functools.lru_cache(maxsize=1)
def register() -> None:
    """Register the intrinsics and the build pipeline with TVM (once per process)."""
    mod = tvm()
    from tvm.s_tir import TensorIntrin
    from tvm.s_tir.tensor_intrin.cuda import get_mma_fill_intrin, get_mma_store_intrin

    TensorIntrin.register(LOAD_A, *_load(16, 8, a_layout, a_element))
    TensorIntrin.register(LOAD_B, *_load(8, 16, b_layout, b_element))
    TensorIntrin.register(MMA_SYNC, *_mma_sync())
    TensorIntrin.register(FILL, *get_mma_fill_intrin("float32", 8))
    TensorIntrin.register(STORE, *get_mma_store_intrin("float32", 8, "global", False))
    mod.tirx.compilation_pipeline.register_tir_pipeline(PIPELINE, _pipeline)


def compile_options(func) -> tuple[str | None, dict]:
    """(TIR pipeline, pass-context config) to compile `func`: the warp-MMA ones when it has warp buffers."""
    if 'scope="warp"' not in func.script():
        return None, {}
    register()
    return PIPELINE, {"tirx.disable_cse_tir": True}


def _pipeline():
    mod = tvm()
    from tvm.s_tir.pipeline import default_s_tir_pipeline

    main, host, _ = default_s_tir_pipeline()
    passes = mod.tirx.transform

    def device():
        return mod.ir.transform.Sequential([passes.LowerWarpMemory()] * WARP_BUFFERS
                                           + [passes.StmtSimplify(), passes.LowerIntrin()])

    return main, host, device


def _load(rows: int, cols: int, layout, element):
    """Shared memory (rows x cols) → warp fragment (32 lanes x 4 registers)."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def desc(warp_handle: T.handle, shared_handle: T.handle) -> None:
        shared = T.match_buffer(shared_handle, (rows, cols), "float32", align=64, offset_factor=1, scope="shared")
        warp = T.match_buffer(warp_handle, (WARP_SIZE, 4), "float32", align=64, offset_factor=1, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:rows, 0:cols])
            T.writes(warp[0:WARP_SIZE, 0:4])
            for r, c in T.grid(rows, cols):
                with T.sblock("shared_warp"):
                    vr, vc = T.axis.remap("SS", [r, c])
                    lane, reg = T.meta_var(layout(vr, vc))
                    T.reads(shared[vr, vc])
                    T.writes(warp[lane, reg])
                    warp[lane, reg] = shared[vr, vc]

    @T.prim_func(s_tir=True)
    def impl(warp_handle: T.handle, shared_handle: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        shared = T.match_buffer(shared_handle, (rows, cols), "float32", align=64, offset_factor=1, scope="shared",
                                strides=[s0, s1])
        warp = T.match_buffer(warp_handle, (WARP_SIZE, 4), "float32", align=64, offset_factor=1, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:rows, 0:cols])
            T.writes(warp[0:WARP_SIZE, 0:4])
            for lane in T.thread_binding(0, WARP_SIZE, "threadIdx.x"):
                for reg in T.unroll(4):
                    r, c = T.meta_var(element(lane, reg))
                    warp[lane, reg] = shared[r, c]

    return desc, impl


def _mma_sync():
    """C (16 x 16) += A (16 x 8) B (8 x 16) in warp fragments: two m16n8k8 TF32 instructions."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP_SIZE, 4), "float32", align=64, offset_factor=1, scope="warp")
        B = T.match_buffer(b, (WARP_SIZE, 4), "float32", align=64, offset_factor=1, scope="warp")
        C = T.match_buffer(c, (WARP_SIZE, 8), "float32", align=64, offset_factor=1, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:WARP_SIZE, 0:8], A[0:WARP_SIZE, 0:4], B[0:WARP_SIZE, 0:4])
            T.writes(C[0:WARP_SIZE, 0:8])
            for i, j, k in T.grid(16, 16, 8):
                with T.sblock("C"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    lane_c, reg_c = T.meta_var(c_layout(vi, vj))
                    lane_a, reg_a = T.meta_var(a_layout(vi, vk))
                    lane_b, reg_b = T.meta_var(b_layout(vk, vj))
                    T.reads(C[lane_c, reg_c], A[lane_a, reg_a], B[lane_b, reg_b])
                    T.writes(C[lane_c, reg_c])
                    C[lane_c, reg_c] = C[lane_c, reg_c] + A[lane_a, reg_a] * B[lane_b, reg_b]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP_SIZE, 4), "float32", align=64, offset_factor=1, scope="warp")
        B = T.match_buffer(b, (WARP_SIZE, 4), "float32", align=64, offset_factor=1, scope="warp")
        C = T.match_buffer(c, (WARP_SIZE, 8), "float32", align=64, offset_factor=1, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:WARP_SIZE, 0:8], A[0:WARP_SIZE, 0:4], B[0:WARP_SIZE, 0:4])
            T.writes(C[0:WARP_SIZE, 0:8])
            for lane in T.thread_binding(0, WARP_SIZE, "threadIdx.x"):
                T.evaluate(T.ptx_legacy.mma("m16n8k8", "row", "col", "tf32", "tf32", "fp32",
                                            A.data, A.elem_offset + lane * 4, B.data, B.elem_offset + lane * 4,
                                            C.data, C.elem_offset + lane * 8, False, dtype="float32"))
                T.evaluate(T.ptx_legacy.mma("m16n8k8", "row", "col", "tf32", "tf32", "fp32",
                                            A.data, A.elem_offset + lane * 4, B.data, B.elem_offset + lane * 4 + 2,
                                            C.data, C.elem_offset + lane * 8 + 4, False, dtype="float32"))

    return desc, impl
