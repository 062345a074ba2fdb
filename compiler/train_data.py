"""The data `tessel train` reads: .npz files keyed by the model's input names plus `labels`, checked against the
model, and cut into shuffled batches that depend only on (seed, epoch) so that a resumed run sees the same ones."""
from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np
import onnx

from tessel.ir.errors import TesselError
from tessel.ir.onnx_import import declared_shape

LABELS = "labels"


class TrainDataError(TesselError):
    """A data file does not fit the model: a missing key, a shape or dtype the model does not take."""


@dataclass(frozen=True)
class ModelInput:
    """A graph input of the ONNX model: its name, numpy dtype and per-sample shape (None: a symbolic dimension)."""

    name: str
    dtype: np.dtype
    sample_shape: tuple[int | None, ...]


@dataclass
class Dataset:
    """Arrays by name (the model's inputs, and `labels` when the loss needs them), all of `length` samples."""

    arrays: dict[str, np.ndarray]
    length: int

    def batches(self, batch: int, seed: int, epoch: int) -> Iterator[dict[str, np.ndarray]]:
        """The epoch's full batches in a shuffled order drawn from (seed, epoch); the last partial batch is left
        out, since the step is compiled for one batch size."""
        order = np.random.default_rng([seed, epoch]).permutation(self.length)
        for start in range(0, self.length - batch + 1, batch):
            rows = order[start:start + batch]
            yield {name: array[rows] for name, array in self.arrays.items()}

    def chunks(self, batch: int) -> Iterator[tuple[dict[str, np.ndarray], int]]:
        """Every sample in order, in chunks of `batch` (the last one padded with zeros): (chunk, valid rows)."""
        for start in range(0, self.length, batch):
            valid = min(batch, self.length - start)
            chunk = {}
            for name, array in self.arrays.items():
                part = array[start:start + valid]
                if valid < batch:
                    part = np.concatenate([part, np.zeros((batch - valid,) + part.shape[1:], part.dtype)])
                chunk[name] = part
            yield chunk, valid


def model_inputs(model_path: str | Path) -> list[ModelInput]:
    """The inputs the ONNX model is fed (graph inputs that are not initializers), axis 0 taken as the batch."""
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except FileNotFoundError:
        raise TrainDataError(f"{model_path}: no such model file") from None
    except Exception as exc:  # onnx raises DecodeError and friends for a file that is not a model
        raise TrainDataError(f"{model_path}: not an ONNX model ({type(exc).__name__})") from None
    initializers = {init.name for init in model.graph.initializer}
    inputs = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        dims = [d if isinstance(d, int) else None for d in declared_shape(tensor)]
        inputs.append(ModelInput(value.name, onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type), tuple(dims[1:])))
    return inputs


def model_outputs(model_path: str | Path) -> dict[str, tuple[int | None, ...]]:
    """The ONNX model's outputs in order: name -> declared shape (None: a symbolic or unknown dimension)."""
    graph = onnx.load(str(model_path), load_external_data=False).graph
    return {value.name: tuple(d if isinstance(d, int) else None for d in declared_shape(value.type.tensor_type))
            for value in graph.output}


def load_dataset(path: str | Path, inputs: Sequence[ModelInput], needs_labels: bool, flag: str) -> Dataset:
    """Read and check `path` (given as `flag`): one array per model input and `labels` (when `needs_labels`), the
    same number of samples in each, each input's per-sample shape and dtype as the model declares them."""
    arrays = _read_npz(Path(path), flag)
    wanted = [i.name for i in inputs] + ([LABELS] if needs_labels else [])
    missing = [name for name in wanted if name not in arrays]
    if missing:
        raise TrainDataError(f"{path}: missing key(s) {', '.join(missing)}; {flag} needs {', '.join(wanted)} "
                             f"(it has {', '.join(sorted(arrays)) or 'none'})")
    for spec in inputs:
        _check_input(path, spec, arrays[spec.name])
    lengths = {name: arrays[name].shape[0] if arrays[name].ndim else None for name in wanted}
    if len(set(lengths.values())) != 1 or None in lengths.values():
        shown = ", ".join(f"{name} {arrays[name].shape}" for name in wanted)
        raise TrainDataError(f"{path}: every array needs the same number of samples on axis 0; got {shown}")
    if needs_labels:
        _check_labels(path, arrays[LABELS])
    length = next(iter(lengths.values()))
    if length == 0:
        raise TrainDataError(f"{path}: holds no samples")
    return Dataset({name: arrays[name] for name in wanted}, length)


def input_shapes(inputs: Sequence[ModelInput], data: Dataset, batch: int) -> dict[str, tuple[int, ...]]:
    """The shapes the training step is compiled for: the batch, then each input's per-sample shape in the data."""
    return {spec.name: (batch,) + data.arrays[spec.name].shape[1:] for spec in inputs}


def _read_npz(path: Path, flag: str) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise TrainDataError(f"{path}: no such file (given as {flag})")
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        raise TrainDataError(f"{path}: not a readable .npz file of arrays ({exc})") from None


def _check_input(path, spec: ModelInput, array: np.ndarray) -> None:
    if array.dtype != spec.dtype:
        raise TrainDataError(f"{path}: '{spec.name}' is {array.dtype}, the model takes {spec.dtype}; "
                             f"save it as {spec.dtype}")
    sample = array.shape[1:]
    declared = spec.sample_shape
    if len(sample) != len(declared) or any(d is not None and d != s for d, s in zip(declared, sample)):
        shown = ", ".join(["N"] + ["?" if d is None else str(d) for d in declared])
        raise TrainDataError(f"{path}: '{spec.name}' has samples of shape {tuple(sample)}, the model takes [{shown}]")


def _check_labels(path, labels: np.ndarray) -> None:
    if labels.dtype.kind not in "iuf":
        raise TrainDataError(f"{path}: '{LABELS}' is {labels.dtype}; give class indices (int64) or float targets")


def check_class_labels(path, labels: np.ndarray, classes: int | None) -> None:
    """Cross-entropy labels are class indices: integers in [0, classes) (classes: the logits' axis 1, None when
    the model leaves it open)."""
    if labels.dtype.kind not in "iu" or labels.ndim != 1:
        raise TrainDataError(f"{path}: cross_entropy needs '{LABELS}' as class indices, int64 of shape [N]; "
                             f"got {labels.dtype} of shape {labels.shape}")
    if labels.min() < 0 or (classes is not None and labels.max() >= classes):
        bound = f"[0, {classes}) (the model's classes)" if classes is not None else "0 or above"
        raise TrainDataError(f"{path}: '{LABELS}' are class indices and must be {bound}; "
                             f"found {labels.min()}..{labels.max()}")


def as_step_labels(labels: np.ndarray) -> np.ndarray:
    """Labels as the step graph takes them: class indices as int64, targets as float32."""
    return labels.astype(np.int64 if labels.dtype.kind in "iu" else np.float32, copy=False)


def feeds(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A batch without its labels: the model's inputs by name."""
    return {name: array for name, array in batch.items() if name != LABELS}
