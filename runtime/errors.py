"""Errors the runtime raises on purpose."""
from __future__ import annotations

from tessel.ir.errors import TesselError

# How a worker prints its failure on stderr, for the launcher to pick the line that explains a failed run.
WORKER_PREFIX = "tessel worker: "
PEER_PREFIX = "tessel worker, after a peer failed: "


class ArtifactError(TesselError):
    """An artifact directory is missing, incomplete, corrupt or from another format version."""


class InputError(TesselError):
    """Inputs given to a run do not match the compiled model's inputs."""


class SettingError(TesselError, ValueError):
    """An environment variable the runtime reads holds a value it does not know."""


class ExecutionError(TesselError):
    """The model failed while running (e.g. an If took a branch that cannot run at these shapes)."""


class PeerError(ExecutionError):
    """A transfer failed because another worker stopped, or did not answer within the timeout: that worker's
    own error, where it printed one, says more."""
