"""The driver: the ordered pipeline, artifact packaging, reports, the CLI and the Python API.

`tessel.compile(model, **options)` returns an `Artifact`; `tessel.load(dir)` reads a saved one.
"""
from __future__ import annotations

__all__ = ["Artifact", "CompileError", "CompileOptions", "compile", "load"]


def __getattr__(name: str):
    # Imported on first use: the API pulls in TVM, which the CLI's quick commands do not need.
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'compiler' has no attribute {name!r}")
