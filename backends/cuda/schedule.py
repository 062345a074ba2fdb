"""CUDA kernels: dlight's default GPU schedules, then CUDA code generation."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from . import mma
from .binary import export_with_binary
from ..target import TargetSpec, tvm_target
from ..tvm_env import tvm


# The reduction block of a transposed convolution (backends/lowering/nn.py).
DECONV_BLOCK = "deconv_taps"


class GpuScheduleError(RuntimeError):
    """dlight left a kernel without any GPU thread binding."""


def compile(func, target: TargetSpec, scheduled: bool = False):
    """Schedule `func` with dlight (unless it binds its own GPU threads) and compile it for CUDA.

    The Executable imports a CUDA module.
    """
    tvm_mod = tvm()
    cuda = tvm_target(target)
    with cuda:  # nvcc reads the architecture from the current target
        error = None
        for candidate in [func] if scheduled else _dlight_schedules(func, cuda):
            # Only a kernel that brings its own schedule can hold tensor-core fragments (dlight's never do here).
            pipeline, config = mma.compile_options(candidate) if scheduled else (None, {})
            try:
                with tvm_mod.transform.PassContext(config=config) if config else contextlib.nullcontext():
                    executable = tvm_mod.compile(tvm_mod.IRModule({"main": candidate}), target=cuda,
                                                 tir_pipeline=pipeline or "default")
                break
            except Exception as exc:  # noqa: BLE001 - a schedule TVM cannot lower falls back to the next rule's
                # (dlight's cross-thread Reduction cannot lower a NaN-propagating max: no matching reducer)
                error = exc
        else:
            raise error
    if not any(m.kind == "cuda" for m in executable.mod.imports):
        # An unscheduled PrimFunc silently becomes host code that would read GPU memory on the CPU.
        raise GpuScheduleError("no CUDA kernel was generated (the schedule bound no GPU threads)")
    return CudaExecutable(executable, target)


class CudaExecutable:
    """A compiled CUDA kernel whose exported library carries the nvcc fatbin, ready to launch.

    Without the NVIDIA driver TVM exports only the CUDA source, which no GPU
    can load (backends/cuda/binary.py); where nvcc exists the source is
    compiled here, once, and the library carries the binary.
    """

    def __init__(self, executable, target: TargetSpec):
        self.executable = executable
        self.mod = executable.mod
        self.source = next(m for m in executable.mod.imports if m.kind == "cuda").inspect_source()
        self.fatbin: bytes | None = None
        if shutil.which("nvcc"):
            # IEEE arithmetic as ONNX defines it: --use_fast_math (TVM's default) makes powf(x, 2) NaN for x < 0
            # (oww_melspectrogram's power spectrum on an H100) and flushes denormals.
            os.environ["TVM_CUDA_NVCC_NO_FAST_MATH"] = "1"
            with tvm_target(target):
                self.fatbin = bytes(tvm().support.nvcc.compile_cuda(
                    self.source, target_format="fatbin", arch=target.arch, compiler="nvcc"))

    def export_library(self, path: str | Path) -> None:
        """Write the kernel library: host code plus the fatbin (or, without nvcc, TVM's own export)."""
        if self.fatbin is None:
            self.executable.export_library(str(path))
        else:
            export_with_binary(self.executable, path, self.source, self.fatbin)

    def __getitem__(self, name: str):
        return self.executable[name]


def schedule_around(func, anchor_schedule, anchor_blocks: frozenset[str]):
    """Schedule a fused kernel whose anchor (an implicit-GEMM conv, cuda/conv.py) brings its own schedule.

    The ops before the anchor are inlined into it (they become part of how its
    tiles are fetched), the anchor's schedule folds the ops after it into the
    block that writes its result, and a block left over (one whose result is
    also a kernel output) gets a flat one-thread-per-element schedule.
    """
    s_tir = tvm().s_tir
    sch = s_tir.Schedule(func)
    root = sch.get_sblock("root")
    for block in reversed(sch.get_child_blocks(root)):
        if sch.get(block).name_hint not in anchor_blocks:
            try:
                sch.compute_inline(block)
            except Exception:  # noqa: BLE001 - an op after the anchor (or a reduction) is not inlined forward
                continue
    anchor_schedule(sch)
    for block in sch.get_child_blocks(root):
        if not _thread_bound(sch, block):
            _schedule_flat(sch, block)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _thread_bound(sch, block) -> bool:
    return any(sch.get(loop).thread_binding is not None for loop in sch.get_loops(block))


def _schedule_flat(sch, block) -> None:
    """One GPU thread per element of a spatial block (its reductions, if any, run inside the thread)."""
    tirx = tvm().tirx
    spatial = [loop for loop, var in zip(sch.get_loops(block), sch.get(block).iter_vars)
               if var.iter_type == tirx.IterVar.DataPar]
    fused = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
    blocks, threads = sch.split(fused, [None, 256])
    sch.bind(blocks, "blockIdx.x")
    sch.bind(threads, "threadIdx.x")


def _dlight_schedules(func, cuda):
    """The kernel as each of dlight's GPU rules that applies schedules it, in the rules' order of preference;
    the kernel as it is when none applies (compile then finds it binds no GPU thread).

    A rule that fails on a fused kernel is skipped (dlight's own pass stops at
    the first rule that raises: its GEMV analysis asserts on a fused gather
    feeding a matrix-vector product).
    """
    dl = tvm().s_tir.dlight
    rules = (dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback())
    if _has_block(func, DECONV_BLOCK):
        # dlight's Matmul rule computes a transposed conv with one output channel wrong (ppocr_v4_det's last
        # ConvTranspose on an H100: most outputs lost their sum); the other rules are right.
        rules = rules[1:]
    applied = False
    for rule in rules:
        try:
            space = rule.apply(func, cuda, False)
        except Exception:  # noqa: BLE001 - a rule that cannot analyse this kernel does not apply to it
            continue
        if space is None:
            continue
        schedule = space[0] if isinstance(space, list) else space
        _scalar_bool_loads(schedule)
        applied = True
        yield schedule.mod["main"].with_attr("tirx.is_scheduled", True)
    if not applied:
        yield func


def _has_block(func, name: str) -> bool:
    try:
        schedule = tvm().s_tir.Schedule(func)
        return any(schedule.get(block).name_hint == name for block in _blocks(schedule, schedule.get_sblock("root")))
    except Exception:  # noqa: BLE001 - a hand-written kernel without the block tree TE makes has no such block
        return False


def _blocks(schedule, block):
    for child in schedule.get_child_blocks(block):
        yield child
        yield from _blocks(schedule, child)


def _scalar_bool_loads(schedule) -> None:
    """Unroll, instead of vectorize, every loop around a block that reads a bool buffer.

    TVM 0.27's CUDA code generator loads a vector of n bools as n 16-bit lanes
    (`*(ushort2*)(mask + i)` for two bools): each lane then holds two
    neighbouring bools and the mask reads true where either is (minigpt_small's
    causal mask on an H100). Scalar loads are right.
    """
    tirx = tvm().tirx
    for block in _blocks(schedule, schedule.get_sblock("root")):
        if not any(str(getattr(region.source, "dtype", "")) == "bool" for region in schedule.get(block).reads):
            continue
        for loop in schedule.get_loops(block):
            if schedule.get(loop).kind == tirx.ForKind.VECTORIZED:
                schedule.unroll(loop)
