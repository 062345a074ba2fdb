"""Writing an artifact directory: kernels, weights, reports and plan.json.

plan.json lists one program per worker under "workers" (instructions, values,
weights file, memory plan, inputs and outputs; one worker for a single-device
artifact); worker 0 takes the model's inputs and returns its outputs.
kernels/ holds every worker's kernels and each worker loads only its own;
workers holding the same weights (data-parallel replicas) share one weights file.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from tessel.backends.cache import KernelCache
from tessel.backends.kernel import arg_alignments
from tessel.ir.types import TensorType
from tessel.runtime.artifact_files import FORMAT, PLAN_FILE, file_hash, sealed_plan_bytes
from tessel.runtime.instructions import FORMAT_VERSION, KernelCall, program_to_json, walk
from tessel.runtime.plan_schema import kernel_calls

from .program import Program


def program_section(program: Program, memory, weights_file: str) -> dict[str, Any]:
    """The part of plan.json one worker runs."""
    return {
        "inputs": program.inputs,
        "outputs": program.outputs,
        "values": program.values,
        "weights": _weights_section(program, weights_file),
        "memory": {"alignment": memory.alignment, "arena_bytes": memory.arena_bytes, "offsets": memory.offsets},
        "instructions": program_to_json(program.instructions),
    }


def _weights_section(program: Program, weights_file: str) -> dict[str, Any]:
    """The weights file, the names it holds and, for those stored in their own form, how the loader transforms them."""
    section: dict[str, Any] = {"file": weights_file, "names": sorted(program.weights)}
    at_load = {name: entry for name, (entry, _) in sorted(program.at_load.items()) if name in program.weights}
    if at_load:
        section["at_load"] = at_load
    return section


def _stored_weights(program: Program) -> dict[str, np.ndarray]:
    """The arrays the weights file holds: each weight as the kernels read it, or in its own form where it is
    transformed at load."""
    return {name: np.require(program.at_load[name][1] if name in program.at_load else array, requirements="C")
            for name, array in program.weights.items()}


def kernel_signatures(programs: Sequence[Program]) -> dict[str, list[str]]:
    """Each called kernel's argument types (inputs, then outputs): the loader checks every call against them."""
    signatures: dict[str, list[str]] = {}
    for program in programs:
        types = {name: TensorType.parse(spec) for name, spec in program.values.items()}
        for instruction in walk(program.instructions):
            if isinstance(instruction, KernelCall):
                for key, arguments in kernel_calls(instruction, types):
                    signatures.setdefault(key, arguments)
    return signatures


def write_artifact(root: Path, programs: Sequence[Program], memories: Sequence[Any], target: str,
                   cache: KernelCache, extra: Mapping[str, Any] | None = None) -> None:
    """Write kernels, weights and plan.json (with the hash of every file it runs from, and its own) into `root`.

    Reports are not hashed: `tessel run` adds what it measured to them.
    """
    (root / "kernels").mkdir(exist_ok=True)
    kernel_entries = {}
    for program in programs:
        for key, spec in program.kernels.items():
            for suffix in (".so", ".cu"):
                source = cache.root / f"{key}{suffix}"
                if source.is_file():
                    shutil.copyfile(source, root / "kernels" / f"{key}{suffix}")
            kernel_entries[key] = {"file": f"kernels/{key}.so", "op": spec.op_type}
            alignments = arg_alignments(spec)
            if alignments is not None:
                # The runtime reads a model input in place when it is as aligned as every kernel reading it assumes.
                kernel_entries[key]["arg_alignment"] = list(alignments)
    for key, signature in kernel_signatures(programs).items():
        kernel_entries[key]["signature"] = signature
    sections = []
    weight_files: dict[tuple, str] = {}
    for worker, (program, memory) in enumerate(zip(programs, memories)):
        # Replicas hold the very same arrays: one file serves them all.
        made_at_load = tuple(sorted(name for name in program.at_load if name in program.weights))
        held = (tuple(sorted((name, id(array)) for name, array in program.weights.items())), made_at_load)
        if held not in weight_files:
            weight_files[held] = "weights.npz" if not weight_files else f"weights_{worker}.npz"
            np.savez(root / weight_files[held], **_stored_weights(program))
        sections.append(program_section(program, memory, weight_files[held]))
    plan: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION, "target": target, "workers": sections}
    plan.update(extra or {})
    plan["kernels"] = kernel_entries
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.relative_to(root).parts[0] != "reports")
    plan["hashes"] = {name: file_hash(root / name) for name in files}
    (root / PLAN_FILE).write_bytes(sealed_plan_bytes(plan))
