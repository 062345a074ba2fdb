"""A whole batch's inputs and outputs as the user sees them: types, the defaults of overridable inputs, checks.

A micro-batched artifact's programs run one micro-batch; its callers give and get the whole batch (axis 0
times the micro-batches). An input that every worker of a multi-worker artifact takes is fed to each worker
straight from the client (a data-parallel step, compiler/dp_training.py): with axes, each worker takes its
slice along axis 0 (the whole batch is the workers' slices together); a scalar goes whole to every worker.
Shared by compiler.artifact.Artifact and runtime.session.InferenceSession.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from tessel.ir.types import TensorType, numpy_dtype

from .errors import InputError

# Overridable inputs' defaults (initializers that are also graph inputs), listed in plan.json's "input_defaults".
DEFAULTS_FILE = "input_defaults.npz"


def _whole_batch(plan: dict[str, Any], names_key: str) -> dict[str, TensorType]:
    entry = plan["workers"][0]
    microbatches = int(plan.get("microbatches", 1))
    split = _split_among_workers(plan) if names_key == "inputs" else set()
    types = {}
    for name in entry[names_key]:
        t = TensorType.parse(entry["values"][name])
        parts = microbatches * (len(plan["workers"]) if name in split else 1)
        types[name] = TensorType(t.dtype, (t.shape[0] * parts,) + t.shape[1:]) if t.rank else t
    return types


def _split_among_workers(plan: dict[str, Any]) -> set[str]:
    """The inputs every worker takes (there are several): each worker gets its part of the batch."""
    workers = plan["workers"]
    if len(workers) < 2:
        return set()
    return set.intersection(*(set(w["inputs"]) for w in workers))


def worker_feeds(plan: dict[str, Any], inputs: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """What each worker takes of a whole batch's `inputs` (checked): the inputs its program lists, those that every
    worker takes split evenly along axis 0 (a scalar whole), the others whole (rank 0's)."""
    workers = plan["workers"]
    split = _split_among_workers(plan)
    feeds: list[dict[str, np.ndarray]] = [{} for _ in workers]
    for name, array in inputs.items():
        if name in split and np.ndim(array):
            # Plain slices (np.split's generality costs tens of microseconds a call, on every step): the checked
            # batch divides evenly.
            rows, left = divmod(len(array), len(workers))
            if left:
                raise InputError(f"input '{name}' has {len(array)} rows, which do not split evenly among "
                                 f"{len(workers)} workers: give a multiple of {len(workers)} rows")
            for k, feed in enumerate(feeds):
                feed[name] = np.ascontiguousarray(array[k * rows:(k + 1) * rows])
        else:
            for feed, entry in zip(feeds, workers):
                if name in entry["inputs"]:
                    feed[name] = array
    return feeds


def batch_input_types(plan: dict[str, Any]) -> dict[str, TensorType]:
    """Input name → type of one whole batch."""
    return _whole_batch(plan, "inputs")


def batch_output_types(plan: dict[str, Any]) -> dict[str, TensorType]:
    """Output name → type of one whole batch."""
    return _whole_batch(plan, "outputs")


def read_defaults(directory: Path, plan: dict[str, Any]) -> dict[str, np.ndarray]:
    """The defaults (the model's initializers) of the overridable inputs plan.json lists, read once: runs reuse them."""
    if not plan.get("input_defaults"):
        return {}
    defaults = {}
    with np.load(Path(directory) / DEFAULTS_FILE, allow_pickle=False) as stored:
        for name in plan["input_defaults"]:
            defaults[name] = stored[name]
            defaults[name].flags.writeable = False  # shared by every run: a caller must not change them
    return defaults


def with_defaults(defaults: Mapping[str, np.ndarray], inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inputs, plus the default (`read_defaults`) of every overridable input not given."""
    return {**{name: value for name, value in defaults.items() if name not in inputs}, **inputs}


def input_specs(plan: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Input name → (whole-batch shape, numpy dtype): what `check_inputs` compares, computed once by a caller
    that checks many runs."""
    return {name: (t.shape, np.dtype(numpy_dtype(t.dtype))) for name, t in batch_input_types(plan).items()}


def check_inputs(defaults: Mapping[str, np.ndarray], plan: dict[str, Any], inputs: Mapping[str, np.ndarray],
                 specs: Mapping[str, tuple[tuple[int, ...], np.dtype]] | None = None) -> dict[str, np.ndarray]:
    """The inputs with their defaults (`read_defaults`), checked against the whole-batch types (before any worker
    runs them); `specs`: the plan's `input_specs`, when the caller keeps them."""
    inputs = with_defaults(defaults, inputs)
    expected = specs if specs is not None else input_specs(plan)
    if inputs.keys() != expected.keys():
        raise InputError(f"inputs do not match the model: it takes {', '.join(sorted(expected))}, got {', '.join(sorted(inputs))}")
    for name, (shape, dtype) in expected.items():
        array = inputs[name]
        if type(array) is not np.ndarray:
            inputs[name] = array = np.asarray(array)
        if array.shape != shape or array.dtype != dtype:
            raise InputError(f"input '{name}' is {array.dtype}{list(array.shape)}, the model takes {np.dtype(dtype)}{list(shape)}")
    return inputs
