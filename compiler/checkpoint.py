"""Training checkpoints: a directory of JSON, .npz and the two artifacts, never a pickle.

    CKPT/step/, CKPT/eval/   the step and eval artifacts (plan.json hashes every file they run from)
    CKPT/state.npz           the state after `steps_done` steps: parameters, optimizer slots, running statistics
    CKPT/model.onnx          the model as given (the Trainer's export_onnx writes the trained values into it)
    CKPT/residuals.npz       with compressed data-parallel gradients: each worker's error-feedback residuals
                             ("RANK/TENSOR"), which its next messages would carry (runtime/comm.py)
    CKPT/training.json       the optimizer and its schedule, the step count, the seed, the step's names, and the
                             sha256 of state.npz, model.onnx (and residuals.npz)

Reading one checks every file before any kernel is loaded: training.json's fields and hashes, each
artifact's plan and file hashes, the state's arrays against the step artifact's plan.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tessel.passes.loss import LossSpec
from tessel.runtime.artifact_files import check_state_file, file_hash, inside, state_types
from tessel.runtime.errors import ArtifactError

from .artifact import Artifact, load, write_staged
from .optim import Optimizer, optimizer_from_json
from .state_program import STATE_FILE
from .training import StepGraph

TRAINING_FILE = "training.json"
MODEL_FILE = "model.onnx"
RESIDUALS_FILE = "residuals.npz"
STEP_DIR, EVAL_DIR = "step", "eval"
FORMAT = "tessel.training"
FORMAT_VERSION = 1
# No training.json Tessel writes comes near this; a larger file is not read.
MAX_TRAINING_FILE_BYTES = 16 << 20


@dataclass(frozen=True)
class StepNames:
    """What the Trainer feeds and reads by name: the StepGraph's names (compiler/training.py) and the loss kind."""

    loss: str
    data_inputs: list[str]
    label_input: str | None
    loss_output: str
    model_outputs: list[str]
    parameters: list[str]
    scalar_inputs: list[str]
    dropout_masks: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, step_graph: StepGraph, loss: str | LossSpec) -> StepNames:
        """The names of a StepGraph built for `loss` (a loss spec is recorded by its kind)."""
        return cls(loss if isinstance(loss, str) else loss.kind, list(step_graph.data_inputs),
                   step_graph.label_input, step_graph.loss_output, list(step_graph.model_outputs),
                   list(step_graph.parameters), list(step_graph.scalar_inputs),
                   {name: float(p) for name, p in step_graph.dropout_masks.items()})

    @classmethod
    def from_json(cls, doc: Any, where: str) -> StepNames:
        """Read back `asdict(names)`; ArtifactError naming the field when it is not well formed."""
        def text(key: str, optional: bool = False) -> str | None:
            value = doc.get(key)
            if not (isinstance(value, str) or optional and value is None):
                raise ArtifactError(f"{where}: '{key}' must be a string")
            return value

        def texts(key: str) -> list[str]:
            value = doc.get(key)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ArtifactError(f"{where}: '{key}' must be a list of strings")
            return value

        masks = doc.get("dropout_masks")
        if not isinstance(masks, dict) or not all(isinstance(p, (int, float)) and not isinstance(p, bool)
                                                  and 0 <= p < 1 for p in masks.values()):
            raise ArtifactError(f"{where}: 'dropout_masks' must map names to ratios in [0, 1)")
        return cls(text("loss"), texts("data_inputs"), text("label_input", optional=True), text("loss_output"),
                   texts("model_outputs"), texts("parameters"), texts("scalar_inputs"), dict(masks))


@dataclass
class Checkpoint:
    """Everything a Trainer resumes from."""

    step_artifact: Artifact
    eval_artifact: Artifact
    names: StepNames
    optimizer: Optimizer
    seed: int
    steps_done: int
    state: dict[str, np.ndarray]
    model_bytes: bytes
    residuals: dict[str, np.ndarray] = field(default_factory=dict)  # "RANK/TENSOR" -> error-feedback residual


def write_checkpoint(checkpoint: Checkpoint, directory: str | Path, force: bool = False) -> Path:
    """Write `checkpoint` to `directory`; an existing non-empty one is refused unless `force`, which replaces only
    a checkpoint. The files are written beside it first: an interrupted save leaves the old checkpoint whole."""
    destination = Path(directory)
    replace = _check_destination(destination, force)
    destination.parent.mkdir(parents=True, exist_ok=True)

    def fill(staging: Path) -> None:
        checkpoint.step_artifact.save(staging / STEP_DIR)
        checkpoint.eval_artifact.save(staging / EVAL_DIR)
        np.savez(staging / STATE_FILE, **checkpoint.state)
        (staging / MODEL_FILE).write_bytes(checkpoint.model_bytes)
        files = (STATE_FILE, MODEL_FILE)
        if checkpoint.residuals:
            np.savez(staging / RESIDUALS_FILE, **checkpoint.residuals)
            files += (RESIDUALS_FILE,)
        doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "steps_done": checkpoint.steps_done,
               "seed": checkpoint.seed, "optimizer": checkpoint.optimizer.to_json(), "step": asdict(checkpoint.names),
               "files": {name: file_hash(staging / name) for name in files}}
        (staging / TRAINING_FILE).write_text(json.dumps(doc, indent=1))

    return write_staged(destination, replace, fill, "checkpoint")


def read_checkpoint(directory: str | Path) -> Checkpoint:
    """The checkpoint `write_checkpoint` wrote to `directory`, every file checked; ArtifactError (one line)
    when one is missing, damaged or edited."""
    directory = Path(directory)
    doc = _read_training_file(directory)
    for name in (STATE_FILE, MODEL_FILE) + ((RESIDUALS_FILE,) if RESIDUALS_FILE in doc["files"] else ()):
        path = inside(directory, name)
        if not path.is_file() or file_hash(path) != doc["files"][name]:
            raise ArtifactError(f"{path}: missing, or its content does not match its hash in {TRAINING_FILE}")
    step_artifact, eval_artifact = load(directory / STEP_DIR), load(directory / EVAL_DIR)
    names = step_artifact.plan.get("state", {}).get("names", [])
    check_state_file(directory / STATE_FILE, names, state_types(step_artifact.plan) if names else {})
    with np.load(directory / STATE_FILE, allow_pickle=False) as arrays:
        state = {name: arrays[name] for name in names}
    try:
        optimizer = optimizer_from_json(doc["optimizer"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{directory / TRAINING_FILE}: the optimizer cannot be read ({exc})") from None
    return Checkpoint(step_artifact, eval_artifact, StepNames.from_json(doc["step"], str(directory / TRAINING_FILE)),
                      optimizer, doc["seed"], doc["steps_done"], state, (directory / MODEL_FILE).read_bytes(),
                      _read_residuals(directory, step_artifact.devices) if RESIDUALS_FILE in doc["files"] else {})


def _read_residuals(directory: Path, workers: int) -> dict[str, np.ndarray]:
    """residuals.npz, each name "RANK/TENSOR" with RANK one of the step's `workers`; ArtifactError otherwise."""
    with np.load(directory / RESIDUALS_FILE, allow_pickle=False) as arrays:
        residuals = {name: arrays[name] for name in arrays.files}
    for name in residuals:
        rank, _, tensor = name.partition("/")
        if not (rank.isdigit() and int(rank) < workers and tensor):
            raise ArtifactError(f"{directory / RESIDUALS_FILE}: '{name}' is not RANK/TENSOR for one of the step's "
                                f"{workers} workers")
    return residuals


def _read_training_file(directory: Path) -> dict[str, Any]:
    """training.json, checked: format, version, and the type of every field the Trainer reads."""
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: no such checkpoint directory")
    path = inside(directory, TRAINING_FILE)
    if not path.is_file():
        raise ArtifactError(f"{directory}: not a Tessel checkpoint (no {TRAINING_FILE})")
    if path.stat().st_size > MAX_TRAINING_FILE_BYTES:
        raise ArtifactError(f"{path}: larger than {MAX_TRAINING_FILE_BYTES >> 20} MiB, not a file Tessel wrote")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise ArtifactError(f"{path}: unreadable ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a Tessel training file")
    if doc.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{path}: format version {doc.get('format_version')} is not {FORMAT_VERSION}")
    for key in ("steps_done", "seed"):
        if not isinstance(doc.get(key), int) or isinstance(doc.get(key), bool) or doc[key] < 0:
            raise ArtifactError(f"{path}: '{key}' must be a non-negative integer")
    files = doc.get("files")
    if not isinstance(files, dict) or any(not isinstance(files.get(n), str) for n in (STATE_FILE, MODEL_FILE)):
        raise ArtifactError(f"{path}: 'files' must give the sha256 of {STATE_FILE} and {MODEL_FILE}")
    if not isinstance(doc.get("step"), dict):
        raise ArtifactError(f"{path}: 'step' must be an object")
    return doc


def _check_destination(destination: Path, force: bool) -> bool:
    """Whether saving replaces an existing checkpoint; ArtifactError when `destination` may not be written."""
    if not destination.exists() and not destination.is_symlink() or destination.is_dir() and not any(destination.iterdir()):
        return False
    if not force:
        raise ArtifactError(f"{destination}: already exists and is not empty; choose another directory or pass force=True")
    if destination.is_symlink() or not destination.is_dir() or not (destination / TRAINING_FILE).is_file():
        raise ArtifactError(f"{destination}: force replaces only a Tessel checkpoint and this is not one; "
                            "remove it yourself or choose another directory")
    return True
