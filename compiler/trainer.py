"""Training: one compiled step (forward, loss, backward, update) run again and again on persistent state.

`compile_training` builds the step graph (compiler/training.py) and compiles it and its eval graph through the
same stages as inference (compiler/api.compile_graph). The `Trainer` runs them: `step` feeds a batch, its
labels, the optimizer's scalars for that step and the dropout masks; `evaluate` runs the eval artifact on a copy
of the current state. A checkpoint is a directory of JSON, .npz and the two artifacts, never a pickle:

    CKPT/step/, CKPT/eval/   the step and eval artifacts (plan.json hashes every file they run from)
    CKPT/state.npz           the state after `steps_done` steps: parameters, optimizer slots, running statistics
    CKPT/model.onnx          the model as given: `export_onnx` writes the trained values into it
    CKPT/training.json       the optimizer and its schedule, the step count, the seed, the step's names, and the
                             sha256 of state.npz and model.onnx
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from tessel.runtime.artifact_files import check_state_file, file_hash, inside
from tessel.runtime.errors import ArtifactError, InputError
from tessel.runtime.executor import Executor

from .api import ModelSource, compile_graph, load_model, model_name, prepare_machine
from .artifact import Artifact, load
from .optim import Optimizer, optimizer_from_json
from .options import CompileOptions
from .state_program import STATE_FILE, PersistentState
from .training import StepGraph, build_step_graph
from .worker_programs import MachineShape

TRAINING_FILE = "training.json"
MODEL_FILE = "model.onnx"
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
    def of(cls, step_graph: StepGraph, loss: str) -> StepNames:
        """The names of a StepGraph."""
        return cls(str(loss), list(step_graph.data_inputs), step_graph.label_input, step_graph.loss_output,
                   list(step_graph.model_outputs), list(step_graph.parameters), list(step_graph.scalar_inputs),
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


class Trainer:
    """Runs a compiled training step on persistent state; `steps_done` steps so far."""

    def __init__(self, step_artifact: Artifact, eval_artifact: Artifact, names: StepNames, optimizer: Optimizer, seed: int,
                 model_bytes: bytes, steps_done: int = 0, state: Mapping[str, np.ndarray] | None = None):
        """Load both artifacts' executors; `state` (by default the step artifact's starting state) is set in."""
        self.step_artifact, self.eval_artifact = step_artifact, eval_artifact
        self.names, self.optimizer, self.seed = names, optimizer, seed
        self.steps_done = steps_done
        self._model_bytes = model_bytes
        self._step = Executor(step_artifact.directory)
        self._eval = Executor(eval_artifact.directory)
        if state is not None:
            self._step.set_state(state)
        types = self._step.input_types
        self._masks = [(name, ratio, types[name].shape) for name, ratio in sorted(names.dropout_masks.items())]

    @property
    def state(self) -> dict[str, np.ndarray]:
        """Copies of the current state by name: parameters, optimizer slots, running statistics."""
        return self._step.state()

    def step(self, inputs: Mapping[str, np.ndarray], labels: np.ndarray | None = None) -> float:
        """Run one training step on a batch (`inputs` by the model's input names) and its labels; the loss."""
        feeds = dict(self._data(inputs, self._step.input_types))
        if self.names.label_input is not None:
            if labels is None:
                raise InputError("this loss needs labels: step(inputs, labels)")
            feeds[self.names.label_input] = labels
        elif labels is not None:
            raise InputError("the model's own output is the loss: step(inputs) takes no labels")
        feeds.update(self.optimizer.step_scalars(self.steps_done))
        feeds.update(self.dropout_masks(self.steps_done))
        loss = float(self._step.run(feeds, copy=False)[self.names.loss_output])
        self.steps_done += 1
        return loss

    def dropout_masks(self, step: int) -> dict[str, np.ndarray]:
        """The dropout masks of step `step`: keep with probability 1 - p, scaled by 1 / (1 - p), drawn from
        numpy's Generator seeded by (seed, step), so a resumed run draws the same masks."""
        if not self._masks:
            return {}
        rng = np.random.default_rng([self.seed, step])
        return {name: (rng.random(shape, dtype=np.float32) >= ratio).astype(np.float32) / np.float32(1 - ratio)
                for name, ratio, shape in self._masks}

    def evaluate(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's outputs on `inputs` with the current state (inference semantics: running statistics for
        BatchNormalization, no dropout)."""
        self._eval.set_state(self._step.state(self._eval.state_names))
        outputs = self._eval.run(dict(self._data(inputs, self._eval.input_types)))
        return {name: outputs[name] for name in self.names.model_outputs}

    def _data(self, inputs: Mapping[str, np.ndarray], types) -> Mapping[str, np.ndarray]:
        """The model's inputs, checked by name first (the executor checks their types)."""
        want = self.names.data_inputs
        missing, extra = [n for n in want if n not in inputs], [n for n in inputs if n not in want]
        if missing or extra:
            problems = ([f"missing {', '.join(map(repr, missing))}"] if missing else []) + \
                       ([f"unknown {', '.join(map(repr, extra))}"] if extra else [])
            takes = ", ".join(f"{n}: {types[n].spec()}" for n in want)
            raise InputError(f"inputs do not match the model ({'; '.join(problems)}); it takes {takes}")
        return inputs

    # ---- checkpoints --------------------------------------------------------------
    def save(self, directory: str | Path, force: bool = False) -> Path:
        """Write a checkpoint to `directory`; an existing non-empty one is refused unless `force`, which replaces
        only a checkpoint."""
        destination = Path(directory)
        replace = _check_checkpoint_destination(destination, force)
        destination.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tessel-checkpoint-", dir=destination.parent))
        try:
            self.step_artifact.save(staging / STEP_DIR)
            self.eval_artifact.save(staging / EVAL_DIR)
            np.savez(staging / STATE_FILE, **self.state)
            (staging / MODEL_FILE).write_bytes(self._model_bytes)
            doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "steps_done": self.steps_done,
                   "seed": self.seed, "optimizer": self.optimizer.to_json(), "step": asdict(self.names),
                   "files": {name: file_hash(staging / name) for name in (STATE_FILE, MODEL_FILE)}}
            (staging / TRAINING_FILE).write_text(json.dumps(doc, indent=1))
            if replace:
                shutil.rmtree(destination)
            staging.replace(destination)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise ArtifactError(f"{destination}: cannot write the checkpoint ({exc.strerror or exc})") from exc
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return destination

    def export_onnx(self, path: str | Path) -> Path:
        """Write the model as given with its trained values: every initializer named like a state value
        (parameters, BatchNormalization running statistics) takes that value, in the initializer's type."""
        import onnx
        from onnx import numpy_helper

        model = onnx.load_from_string(self._model_bytes)
        state = self.state
        found = set()
        for initializer in model.graph.initializer:
            if initializer.name in state:
                dtype = numpy_helper.to_array(initializer).dtype
                initializer.CopyFrom(numpy_helper.from_array(state[initializer.name].astype(dtype), initializer.name))
                found.add(initializer.name)
        lost = [name for name in self.names.parameters if name not in found]
        if lost:
            raise ArtifactError(f"parameter '{lost[0]}' is not an initializer of the model; cannot export it")
        onnx.save(model, str(path))
        return Path(path)


def compile_training(model, loss: str, optimizer: Optimizer, input_shapes: Mapping[str, tuple[int, ...]] | None = None,
                     trainable: str | None = None, frozen: str | None = None, seed: int = 0,
                     label_smoothing: float = 0.0, **options) -> Trainer:
    """Compile an ONNX model (path, bytes or ModelProto) into a Trainer: one compiled graph per step.

    `loss`: "cross_entropy" (with `label_smoothing`), "mse", "l1", "bce_with_logits", or "output:K" (the
    model's output K is the loss); `optimizer`: a `tessel.optim` optimizer; `trainable` / `frozen`: regexes on
    initializer names; `seed` seeds the dropout masks; the other keywords are compile options
    (compiler/options.py).
    """
    options = CompileOptions.create(None, input_shapes=dict(input_shapes or {}), **options)
    machine = prepare_machine(options)
    started = time.perf_counter()
    proto, shapes = load_model(model, options)
    step_graph = build_step_graph(proto, shapes, loss, optimizer, trainable=trainable, frozen=frozen,
                                  label_smoothing=label_smoothing)
    source = ModelSource(model_name(model, proto), proto, model, {}, time.perf_counter() - started)
    return compile_step(step_graph, source, loss, optimizer, seed, options, machine)


def compile_step(step_graph: StepGraph, source: ModelSource, loss: str, optimizer: Optimizer, seed: int,
                 options: CompileOptions, machine: MachineShape | None = None) -> Trainer:
    """Compile a StepGraph's step graph and eval graph (`source`: the model they came from); their Trainer."""
    machine = machine or prepare_machine(options)
    state = PersistentState(step_graph.state, step_graph.state_updates)
    step = compile_graph(step_graph.graph, options, machine, source, state=state)
    eval_names = {v.name for v in step_graph.eval_graph.inputs} & set(step_graph.state)
    eval_state = PersistentState({n: step_graph.state[n] for n in eval_names}, {})
    evaluation = compile_graph(step_graph.eval_graph, options, machine,
                               ModelSource(source.name, source.model, source.origin, {}, 0.0), state=eval_state)
    return Trainer(step, evaluation, StepNames.of(step_graph, loss), optimizer, seed,
                   source.model.SerializeToString())


def load_training(directory: str | Path) -> Trainer:
    """Open a checkpoint `Trainer.save` wrote: its files are checked (training.json's hashes, each artifact's
    plan and file hashes, the state's arrays against the plan) before any kernel is loaded."""
    directory = Path(directory)
    doc = _read_training_file(directory)
    for name in (STATE_FILE, MODEL_FILE):
        path = inside(directory, name)
        if not path.is_file() or file_hash(path) != doc["files"][name]:
            raise ArtifactError(f"{path}: missing, or its content does not match its hash in {TRAINING_FILE}")
    step_artifact, eval_artifact = load(directory / STEP_DIR), load(directory / EVAL_DIR)
    worker = step_artifact.plan["workers"][0]
    names = step_artifact.plan.get("state", {}).get("names", [])
    check_state_file(directory / STATE_FILE, names, worker["values"])
    with np.load(directory / STATE_FILE, allow_pickle=False) as arrays:
        state = {name: arrays[name] for name in names}
    try:
        optimizer = optimizer_from_json(doc["optimizer"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{directory / TRAINING_FILE}: the optimizer cannot be read ({exc})") from None
    return Trainer(step_artifact, eval_artifact, StepNames.from_json(doc["step"], str(directory / TRAINING_FILE)),
                   optimizer, doc["seed"], (directory / MODEL_FILE).read_bytes(), doc["steps_done"], state)


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


def _check_checkpoint_destination(destination: Path, force: bool) -> bool:
    """Whether saving replaces an existing checkpoint; ArtifactError when `destination` may not be written."""
    if not destination.exists() and not destination.is_symlink() or destination.is_dir() and not any(destination.iterdir()):
        return False
    if not force:
        raise ArtifactError(f"{destination}: already exists and is not empty; choose another directory or pass force=True")
    if destination.is_symlink() or not destination.is_dir() or not (destination / TRAINING_FILE).is_file():
        raise ArtifactError(f"{destination}: force replaces only a Tessel checkpoint and this is not one; "
                            "remove it yourself or choose another directory")
    return True
