"""Tessel: a DNN compiler for ONNX models with distributed code generation.

`tessel.compile(model, **options)` returns an `Artifact` to run or save;
`tessel.load(dir)` reads a saved one; `tessel.compile_training(model, loss=...,
optimizer=...)` returns a `Trainer` (`tessel.load_training(dir)` resumes one); `tessel.InferenceSession(dir)` loads
one to run many times (its workers stay up); `tessel.ir.from_onnx` imports a
model into the graph IR. Subpackages: `tessel.ir` (graph IR), `tessel.passes`
(graph passes and planners), `tessel.backends` (TVM lowering and kernels),
`tessel.runtime` (executor, workers, artifact checks), `tessel.compiler`
(pipeline, packaging, reports, CLI).
"""
from __future__ import annotations

from pathlib import Path

__version__ = "0.2.0"

# Installed, the subpackages sit inside this folder; in a source checkout (the repository's layout is
# fixed) they sit beside it, so Python also looks there for `tessel.<name>`.
_HERE = Path(__file__).resolve().parent
if not (_HERE / "ir").is_dir():
    __path__.append(str(_HERE.parent))  # noqa: F821 - a package's own __path__

# The directory `import tessel` finds this package from: the working directory of Tessel's own subprocesses.
IMPORT_ROOT = _HERE.parent

_API = ("Artifact", "CompileError", "CompileOptions", "compile", "load")
_TRAINING = ("Trainer", "compile_training", "load_training")
__all__ = [*_API, *_TRAINING, "InferenceSession", "__version__", "ir"]


def __getattr__(name: str):
    # Imported on first use: the compiler pulls in TVM, which `import tessel` and the CLI's quick commands
    # do not need.
    if name in _API:
        from .compiler import api

        return getattr(api, name)
    if name in _TRAINING:
        from .compiler import trainer

        return getattr(trainer, name)
    if name == "InferenceSession":
        from .runtime.session import InferenceSession

        return InferenceSession
    if name in ("ir", "optim"):
        import importlib

        return importlib.import_module(f"tessel.{name}")
    raise AttributeError(f"module 'tessel' has no attribute {name!r}")
