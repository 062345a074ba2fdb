"""Importing Apache TVM with the thread count Tessel chose.

TVM reads TVM_NUM_THREADS once, at import, and otherwise uses half the cores:
every backend module imports TVM through `tvm()` so the variable is set first.
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
