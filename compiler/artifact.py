"""The compiled artifact: a directory with plan.json, kernels/, weights.npz, graph.json and reports/.

Weights are stored once, in the weights files: graph.json describes the
compiled graph without tensor data, and the original model is kept as
model.onnx only when asked (`keep_model`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from tessel.ir.graph import Graph
from tessel.ir.serialize import to_json
from tessel.ir.types import TensorType
from tessel.runtime.artifact_files import (PLAN_FILE, artifact_digest, file_hash, parse_expected_digest, read_plan,
                                           unlisted_files, verify_files, worker_count)
from tessel.runtime.batch_io import DEFAULTS_FILE, batch_input_types, check_inputs, read_defaults, with_defaults
from tessel.runtime.errors import ArtifactError
from tessel.runtime.graph_names import GRAPH_FILE
from tessel.runtime.signature import Signature

if TYPE_CHECKING:
    import onnx


# The model as compiled (re-batched when asked), kept only with `keep_model`.
MODEL_FILE = "model.onnx"


def write_model_files(root: Path, model: "onnx.ModelProto", graph: Graph, keep_model: bool,
                      source: "str | os.PathLike | bytes | onnx.ModelProto | None" = None,
                      batch: int | None = None) -> dict[str, Any]:
    """Write graph.json (no tensor data) and, with `keep_model`, model.onnx (the model as compiled) into `root`.

    Returns reports/compile.json's "model" entry: where the model came from (`source`, when a file path) and
    its sha256, so that `tessel run --check` finds it again without a copy in the artifact; `batch` is the
    batch the model was re-declared to (`compile(batch=...)`), which the check applies to the file too.
    """
    (root / GRAPH_FILE).write_text(to_json(graph, tensor_data=False))
    record: dict[str, Any] = {"kept": keep_model}
    if keep_model:
        (root / MODEL_FILE).write_bytes(model.SerializeToString())
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).resolve()
        record.update({"path": str(path), "sha256": file_hash(path)})
    if batch is not None:
        record["batch"] = batch
    return record


def write_input_defaults(root: Path, defaults: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Save the defaults of overridable inputs into the artifact at `root`; the plan.json entry that lists them."""
    if not defaults:
        return {}
    np.savez(root / DEFAULTS_FILE, **defaults)
    return {"input_defaults": sorted(defaults)}


class Artifact:
    """A compiled model; `run` executes it, `save` writes it to a directory of your choice."""

    def __init__(self, directory: str | Path, staging: tempfile.TemporaryDirectory | None = None,
                 expect_sha256: str | None = None, signature: Signature | None = None):
        self.directory = Path(directory)
        self._staging = staging  # keeps a freshly compiled artifact's temporary directory alive
        self.plan: dict[str, Any] = read_plan(self.directory, expect_sha256, signature)
        self._executor = None
        self._session = None
        self._defaults: dict[str, np.ndarray] | None = None

    @property
    def sha256(self) -> str:
        """The digest naming the whole artifact (sha256 of plan.json, which holds every file's hash): publish it
        beside the artifact, and check it with `load(dir, expect_sha256=...)` or `tessel run --expect-sha256`."""
        return artifact_digest(self.directory)

    @property
    def target(self) -> str:
        """The target the kernels were compiled for."""
        return self.plan["target"]

    @property
    def inputs(self) -> dict[str, str]:
        """Input name → type (e.g. "float32[1,3,224,224]")."""
        entry = self.plan["workers"][0]
        return {name: entry["values"][name] for name in entry["inputs"]}

    @property
    def outputs(self) -> dict[str, str]:
        """Output name → type."""
        entry = self.plan["workers"][0]
        return {name: entry["values"][name] for name in entry["outputs"]}

    def report(self) -> dict[str, Any]:
        """The compile report (reports/compile.json)."""
        return json.loads((self.directory / "reports" / "compile.json").read_text())

    def executor(self):
        """The executor that runs this (single-device) artifact, made on first use: profiling, arena inspection."""
        if self.devices > 1:
            raise ArtifactError(f"{self.directory}: a {self.devices}-device artifact runs on its workers; use run()")
        if self._executor is None:
            from tessel.runtime.executor import Executor

            self._executor = Executor(self.directory)
        return self._executor

    @property
    def devices(self) -> int:
        """Devices (workers) the artifact runs on."""
        return worker_count(self.plan)

    @property
    def microbatches(self) -> int:
        """Micro-batches one run splits the batch into."""
        return int(self.plan.get("microbatches", 1))

    def run(self, inputs: Mapping[str, np.ndarray], timeout: float = 30.0) -> dict[str, np.ndarray]:
        """Run the model on numpy inputs by name; returns numpy outputs by name.

        The first run opens this artifact's InferenceSession (runtime/session.py), which later runs reuse: a
        multi-device artifact starts its local workers (one process per device) once, not per run.
        """
        session = self._session
        if session is None or session.closed or session.timeout != timeout:
            session = self.session(timeout)
        return session.run(inputs)

    def session(self, timeout: float = 30.0):
        """This artifact's InferenceSession, opened on first use (again after `close` or with another timeout)."""
        if self._session is None or self._session.closed or self._session.timeout != timeout:
            from tessel.runtime.session import InferenceSession

            if self._session is not None:
                self._session.close()
            self._session = InferenceSession(self, timeout=timeout)
        return self._session

    def input_defaults(self) -> dict[str, np.ndarray]:
        """The overridable inputs' defaults, read from the artifact on first use."""
        if self._defaults is None:
            self._defaults = read_defaults(self.directory, self.plan)
        return self._defaults

    def with_defaults(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The inputs, plus the default (the model's initializer) of every overridable input not given."""
        return with_defaults(self.input_defaults(), inputs)

    def batch_input_types(self) -> dict[str, TensorType]:
        """Input name → type of one whole batch (micro-batched artifacts run several micro-batches)."""
        return batch_input_types(self.plan)

    def check_inputs(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Inputs checked against the whole-batch types before any worker starts."""
        return check_inputs(self.input_defaults(), self.plan, inputs)

    def save(self, directory: str | Path, overwrite: bool = False) -> Path:
        """Write the artifact to `directory`; an existing non-empty directory is refused unless `overwrite`."""
        destination = Path(directory)
        if destination.resolve() == self.directory.resolve():
            return destination
        replace = check_destination(destination, overwrite)
        return write_staged(destination, replace, partial(shutil.copytree, self.directory, dirs_exist_ok=True),
                            "artifact")


def write_staged(destination: Path, replace: bool, fill: Callable[[Path], Any], what: str) -> Path:
    """Write a directory to `destination` through `fill(staging)`, a new directory beside it: the old one (removed
    when `replace`) goes only once the new one is complete, and a failed or interrupted fill leaves no staging
    behind. An OSError becomes one ArtifactError line naming `what` was being written."""
    staging = Path(tempfile.mkdtemp(prefix=f".tessel-{what}-", dir=destination.parent if destination.parent.exists() else None))
    try:
        fill(staging)
        if replace:
            shutil.rmtree(destination)
        staging.replace(destination)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise ArtifactError(f"{destination}: cannot write the {what} ({exc.strerror or exc})") from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return destination


def check_destination(destination: Path, overwrite: bool) -> bool:
    """Whether saving to `destination` replaces an existing artifact; raise ArtifactError when it may not be written.

    Only a complete Tessel artifact is replaced: its plan validates and every file outside reports/ is one the
    plan lists. Anything else (a project that holds a plan.json, an artifact with files added) is refused.
    """
    if not destination.exists() and not destination.is_symlink() or (destination.is_dir() and not any(destination.iterdir())):
        return False
    if not destination.is_symlink() and not destination.is_dir():  # --force does not replace it either
        raise ArtifactError(f"{destination}: is a file, not a directory; an artifact is a directory: choose another path")
    if not overwrite:
        raise ArtifactError(f"{destination}: already exists and is not empty; choose another directory or pass --force")
    refuse = f"{destination}: --force replaces only a complete Tessel artifact and this is not one"
    if destination.is_symlink() or not destination.is_dir():
        raise ArtifactError(f"{refuse} (not a directory); remove it yourself or choose another directory")
    try:
        plan = read_plan(destination)
    except ArtifactError as exc:
        reason = str(exc).removeprefix(f"{destination}: ").removeprefix(f"{destination / PLAN_FILE}: ")
        raise ArtifactError(f"{refuse} ({reason}); remove it yourself or choose another directory") from None
    stray = next(unlisted_files(destination, plan), None)
    if stray is not None:
        raise ArtifactError(f"{refuse}: {stray.relative_to(destination)} is not part of it; "
                            "remove it yourself or choose another directory")
    return True


def load(directory: str | Path, expect_sha256: str | None = None, signature: Signature | None = None) -> Artifact:
    """Open a saved artifact, checking its plan (schema, own hash) and the hashes of its files.

    An artifact is native code: load only what you or a source you trust compiled. `expect_sha256`
    (64 hex digits, or a file holding them) is the digest published with it (`Artifact.sha256`);
    `signature` a detached OpenSSH signature of its plan.json (runtime/signature.py). Any other
    plan.json is refused before anything is loaded.
    """
    expected = parse_expected_digest(expect_sha256) if expect_sha256 is not None else None
    artifact = Artifact(directory, expect_sha256=expected, signature=signature)
    verify_files(artifact.directory, artifact.plan)
    return artifact
