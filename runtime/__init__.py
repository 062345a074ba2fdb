"""Executing compiled artifacts: per-device executors (the distributed launcher comes later)."""
from .errors import ArtifactError, ExecutionError, InputError
from .executor import Executor

__all__ = ["ArtifactError", "ExecutionError", "Executor", "InputError"]
