"""Importing Apache TVM with the thread count Tessel chose.

TVM reads TVM_NUM_THREADS once, at import, and otherwise uses half the cores:
every backend module imports TVM through `tvm()` so the variable is set first.

Running an artifact needs only TVM's runtime library. With
`TVM_USE_RUNTIME_LIB=1` (or a runtime-only TVM package) `import tvm` loads
libtvm_runtime alone, and TVM then registers no device backend by itself:
`enable_cuda()` loads libtvm_runtime_cuda, which holds the loader of CUDA
kernel modules, before a CUDA artifact's kernels are loaded.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

_THREADS_VAR = "TVM_NUM_THREADS"


def set_threads(count: int) -> None:
    """Choose TVM's CPU thread count; must happen before TVM is first imported."""
    os.environ[_THREADS_VAR] = str(count)


def tvm() -> ModuleType:
    """The tvm module, imported with TVM_NUM_THREADS defaulting to every core."""
    os.environ.setdefault(_THREADS_VAR, str(os.cpu_count() or 1))
    return importlib.import_module("tvm")


def threads() -> int:
    """The thread count TVM runs (or will run) with."""
    return int(os.environ.get(_THREADS_VAR) or os.cpu_count() or 1)


def version() -> str:
    """Installed TVM's version string (read without importing TVM)."""
    from importlib.metadata import version as dist_version

    return dist_version("apache-tvm")


def enable_cuda() -> bool:
    """Make sure TVM can load CUDA kernel modules; False where its CUDA runtime cannot load (no driver)."""
    tvm_module = tvm()
    if tvm_module.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is not None:
        return True
    from pathlib import Path

    from tvm_ffi.libinfo import load_lib_ctypes

    loaded = tvm_module.base._LOADED_LIBS
    runtime_dir = Path(loaded["tvm_runtime"]._name).resolve().parent
    try:
        loaded["tvm_runtime_cuda"] = load_lib_ctypes(package="tvm", target_name="tvm_runtime_cuda",
                                                     extra_lib_paths=[runtime_dir], mode="RTLD_LOCAL")
    except (OSError, FileNotFoundError, RuntimeError):
        return False
    return tvm_module.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is not None
