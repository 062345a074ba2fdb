"""Errors the runtime raises on purpose."""
from __future__ import annotations

from ir.errors import TesselError


class ArtifactError(TesselError):
    """An artifact directory is missing, incomplete, corrupt or from another format version."""


class InputError(TesselError):
    """Inputs given to a run do not match the compiled model's inputs."""


class ExecutionError(TesselError):
    """The model failed while running (e.g. an If took a branch that cannot run at these shapes)."""
