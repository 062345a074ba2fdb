"""The public Python API: `compile` a model into an `Artifact`, `load` a saved one."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

import ir
from backends.builder import build_kernels
from backends.cache import KernelCache
from backends.lowering import LoweringError
from backends.target import parse_target
from backends.tvm_env import version as tvm_version
from ir.errors import TesselError
from runtime.artifact_files import FORMAT, FORMAT_VERSION, PLAN_FILE, file_hash

from .artifact import Artifact, load
from .memory import peak_description, plan_program_memory, weight_bytes, write_memory_reports
from .pipeline import PASS_NAMES, pass_report, run_pipeline, select_passes
from .sizes import format_bytes, parse_bytes
from .program import build_program

__all__ = ["Artifact", "CompileError", "compile", "load"]


class CompileError(TesselError):
    """The compile request itself is invalid (e.g. an option Tessel does not offer yet)."""


def compile(  # noqa: A001 - the contract names it compile
    model_or_path,
    *,
    target: str = "llvm",
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    devices: int = 1,
    cache_dir: str | os.PathLike | None = None,
    jobs: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    device_memory: int | str | None = None,
    skip_passes: Sequence[str] = (),
    verify: bool = False,
    dump_after: Sequence[str] = (),
) -> Artifact:
    """Compile an ONNX model (path, bytes or ModelProto) for `target` ("llvm" or "cuda:sm_XX").

    `device_memory` (bytes, or a size such as "512MiB") makes compilation fail when the
    weights and the planned activation arena do not fit.
    The graph goes through the optimization pipeline (compiler/pipeline.py) less
    `skip_passes`; `verify` checks the graph after every pass; `dump_after` names
    passes after which the graph is written to `reports/after_<pass>.txt` and `.onnx`.
    Returns an in-memory Artifact (a temporary directory) to `run` or `save`.
    """
    if devices != 1:
        raise CompileError(f"devices={devices}: placement across several devices is not available yet; use devices=1")
    spec = parse_target(target)
    try:
        passes = select_passes(skip_passes)
    except ValueError as exc:
        raise CompileError(str(exc)) from None
    unknown_dumps = sorted(set(dump_after) - set(PASS_NAMES))
    if unknown_dumps:
        raise CompileError(f"--dump-after {', '.join(unknown_dumps)}: no such pass; passes are {', '.join(PASS_NAMES)}")
    started = time.perf_counter()
    model = ir.load_model(model_or_path)
    graph = ir.from_onnx(model, input_shapes)
    imported = time.perf_counter()
    staging = tempfile.TemporaryDirectory(prefix="tessel-artifact-")
    root = Path(staging.name)
    (root / "reports").mkdir()
    graph, pass_records = run_pipeline(graph, passes, verify=verify, dump_after=dump_after, dump_dir=root / "reports")
    optimized = time.perf_counter()
    program = build_program(graph, spec)
    if program.unsupported:
        raise LoweringError(f"no {spec.kind} kernels for {len(program.unsupported)} op type(s): " + "; ".join(program.unsupported))
    memory = plan_program_memory(program, spec.kind)
    _check_device_memory(memory, weight_bytes(program), device_memory)
    cache = KernelCache(cache_dir)
    stats = build_kernels(program.kernels, spec, cache, jobs, progress)
    built = time.perf_counter()
    kernel_entries = {}
    (root / "kernels").mkdir()
    for key in program.kernels:
        for suffix in (".so", ".cu", ".fatbin"):
            source = cache.root / f"{key}{suffix}"
            if source.is_file():
                shutil.copyfile(source, root / "kernels" / f"{key}{suffix}")
        kernel_entries[key] = {"file": f"kernels/{key}.so", "op": program.kernels[key].op_type}
    np.savez(root / "weights.npz", **{name: np.ascontiguousarray(a) for name, a in program.weights.items()})
    memory_report = write_memory_reports(root / "reports", memory, weight_bytes(program))
    (root / "model.onnx").write_bytes(model.SerializeToString())
    (root / "graph.json").write_text(ir.to_json(graph))
    report = {
        "target": str(spec),
        "nodes": len(graph.nodes),
        "steps": len(program.steps),
        "kernel_calls": _count_kernel_calls(program.steps),
        "kernels": stats.kernels,
        "kernels_cached": stats.cached,
        "kernels_compiled": stats.compiled,
        "seconds": {"import": round(imported - started, 3), "passes": round(optimized - imported, 3),
                    "kernels": round(built - optimized, 3)},
        "passes": [record.to_json() for record in pass_records],
        "memory": {key: memory_report[key] for key in ("arena_bytes", "bound_bytes", "ratio", "no_reuse_bytes", "weights_bytes")},
        "tvm_version": tvm_version(),
    }
    (root / "reports" / "compile.json").write_text(json.dumps(report, indent=2))
    (root / "reports" / "passes.md").write_text(pass_report(pass_records))
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    plan = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "target": str(spec),
        "inputs": program.inputs,
        "outputs": program.outputs,
        "values": program.values,
        "weights": {"file": "weights.npz", "names": sorted(program.weights)},
        "memory": {"alignment": memory.alignment, "arena_bytes": memory.arena_bytes, "offsets": memory.offsets},
        "kernels": kernel_entries,
        "steps": program.steps,
        "hashes": {name: file_hash(root / name) for name in files},
    }
    (root / PLAN_FILE).write_text(json.dumps(plan, indent=1))
    return Artifact(root, staging)


def _check_device_memory(memory, weights: int, device_memory: int | str | None) -> None:
    if device_memory is None:
        return
    try:
        capacity = parse_bytes(device_memory) if isinstance(device_memory, str) else int(device_memory)
    except ValueError as exc:
        raise CompileError(f"--device-memory: {exc}") from None
    needed = memory.arena_bytes + weights
    if needed > capacity:
        raise CompileError(
            f"the model needs {format_bytes(needed)} (weights {format_bytes(weights)} + activations "
            f"{format_bytes(memory.arena_bytes)}) but the device has {format_bytes(capacity)}: "
            f"{format_bytes(needed - capacity)} missing; the activation peak is {peak_description(memory)}"
        )


def _count_kernel_calls(steps) -> int:
    total = 0
    for step in steps:
        if step["kind"] == "kernel":
            total += 1
        elif step["kind"] == "if":
            total += max(_count_kernel_calls(step["then"]["steps"]), _count_kernel_calls(step["else"]["steps"]))
    return total
