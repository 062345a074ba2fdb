"""CUDA kernels: dlight's default GPU schedules, then CUDA code generation."""
from __future__ import annotations

from ..target import TargetSpec, tvm_target
from ..tvm_env import tvm


class GpuScheduleError(RuntimeError):
    """dlight left a kernel without any GPU thread binding."""


def compile(func, target: TargetSpec, scheduled: bool = False):
    """Schedule `func` with dlight (unless it binds its own GPU threads) and compile it for CUDA.

    The Executable imports a CUDA module.
    """
    tvm_mod = tvm()
    dl = tvm_mod.s_tir.dlight
    cuda = tvm_target(target)
    mod = tvm_mod.IRModule({"main": func})
    with cuda:  # nvcc reads the architecture from the current target
        if not scheduled:
            mod = dl.ApplyDefaultSchedule(
                dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()
            )(mod)
        executable = tvm_mod.compile(mod, target=cuda)
    if not any(m.kind == "cuda" for m in executable.mod.imports):
        # An unscheduled PrimFunc silently becomes host code that would read GPU memory on the CPU.
        raise GpuScheduleError("no CUDA kernel was generated (the schedule bound no GPU threads)")
    return executable


def cuda_source(executable) -> str:
    """The CUDA C source of a compiled CUDA kernel."""
    return next(m for m in executable.mod.imports if m.kind == "cuda").inspect_source()
