"""The compiled artifact: a directory with plan.json, kernels/, weights.npz, the model and reports/."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ir.types import TensorType, numpy_dtype
from runtime.artifact_files import PLAN_FILE, device_count, read_plan, verify_files
from runtime.errors import ArtifactError


class Artifact:
    """A compiled model; `run` executes it, `save` writes it to a directory of your choice."""

    def __init__(self, directory: str | Path, staging: tempfile.TemporaryDirectory | None = None):
        self.directory = Path(directory)
        self._staging = staging  # keeps a freshly compiled artifact's temporary directory alive
        self.plan: dict[str, Any] = read_plan(self.directory)
        self._executor = None

    @property
    def target(self) -> str:
        """The target the kernels were compiled for."""
        return self.plan["target"]

    @property
    def inputs(self) -> dict[str, str]:
        """Input name → type (e.g. "float32[1,3,224,224]")."""
        return {name: self.plan["values"][name] for name in self.plan["inputs"]}

    @property
    def outputs(self) -> dict[str, str]:
        """Output name → type."""
        return {name: self.plan["values"][name] for name in self.plan["outputs"]}

    def report(self) -> dict[str, Any]:
        """The compile report (reports/compile.json)."""
        return json.loads((self.directory / "reports" / "compile.json").read_text())

    def executor(self):
        """The executor that runs this (single-device) artifact, made on first use: profiling, arena inspection."""
        if self.devices > 1:
            raise ArtifactError(f"{self.directory}: a {self.devices}-device artifact runs on its workers; use run()")
        if self._executor is None:
            from runtime.executor import Executor

            self._executor = Executor(self.directory)
        return self._executor

    @property
    def devices(self) -> int:
        """Devices (workers) the artifact runs on."""
        return device_count(self.plan)

    @property
    def microbatches(self) -> int:
        """Slices one run splits the batch into: micro-batches, or one per device with data or hybrid placement."""
        replicas = int(self.plan.get("data_parallel", 0)) or int(self.plan.get("hybrid", {}).get("replicas", 1))
        return int(self.plan.get("microbatches", 1)) * replicas

    def run(self, inputs: Mapping[str, np.ndarray], timeout: float = 30.0) -> dict[str, np.ndarray]:
        """Run the model on numpy inputs by name; returns numpy outputs by name.

        A multi-device artifact launches its local workers (one process per device) for the run.
        """
        if self.devices > 1 or self.microbatches > 1:
            from runtime.launch import run_local

            return run_local(self.directory, self.devices, self.check_inputs(inputs), timeout=timeout)[0]
        return self.executor().run(inputs)

    def batch_input_types(self) -> dict[str, TensorType]:
        """Input name → type of one whole batch (micro-batched artifacts run several micro-batches)."""
        types = {}
        for name, spec in self.inputs.items():
            t = TensorType.parse(spec)
            shape = (t.shape[0] * self.microbatches,) + t.shape[1:] if t.rank else t.shape
            types[name] = TensorType(t.dtype, shape)
        return types

    def check_inputs(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Inputs checked against the whole-batch types before any worker starts."""
        from runtime.errors import InputError

        expected = {name: (t.shape, numpy_dtype(t.dtype)) for name, t in self.batch_input_types().items()}
        if set(inputs) != set(expected):
            raise InputError(f"inputs do not match the model: it takes {', '.join(sorted(expected))}, got {', '.join(sorted(inputs))}")
        for name, (shape, dtype) in expected.items():
            array = np.asarray(inputs[name])
            if array.shape != shape or array.dtype != dtype:
                raise InputError(f"input '{name}' is {array.dtype}{list(array.shape)}, the model takes {np.dtype(dtype)}{list(shape)}")
        return {name: np.asarray(a) for name, a in inputs.items()}

    def save(self, directory: str | Path, overwrite: bool = False) -> Path:
        """Write the artifact to `directory`; an existing non-empty directory is refused unless `overwrite`."""
        destination = Path(directory)
        if destination.resolve() == self.directory.resolve():
            return destination
        replace = check_destination(destination, overwrite)
        staging = Path(tempfile.mkdtemp(prefix=".tessel-save-", dir=destination.parent if destination.parent.exists() else None))
        try:
            shutil.copytree(self.directory, staging, dirs_exist_ok=True)
            # The old artifact goes only once the new one is complete beside it.
            if replace:
                shutil.rmtree(destination)
            staging.replace(destination)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise ArtifactError(f"{destination}: cannot write the artifact ({exc.strerror or exc})") from exc
        return destination


def check_destination(destination: Path, overwrite: bool) -> bool:
    """Whether saving to `destination` replaces an existing artifact; raise ArtifactError when it may not be written."""
    if not destination.exists() or (destination.is_dir() and not any(destination.iterdir())):
        return False
    if not overwrite:
        raise ArtifactError(f"{destination}: already exists and is not empty; choose another directory or pass --force")
    if not (destination / PLAN_FILE).is_file():
        raise ArtifactError(f"{destination}: exists and is not a Tessel artifact; refusing to replace it")
    return True


def load(directory: str | Path) -> Artifact:
    """Open a saved artifact, checking its format and the hashes of its files."""
    artifact = Artifact(directory)
    verify_files(artifact.directory, artifact.plan)
    return artifact
