"""The public Python API: `compile` a model into an `Artifact`, `load` a saved one."""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from tessel import ir
from tessel.backends.builder import build_kernels
from tessel.backends.cache import KernelCache
from tessel.backends.lowering import LoweringError
from tessel.backends.target import parse_target
from tessel.backends.tvm_env import version as tvm_version
from tessel.ir.errors import TesselError
from tessel.ir.onnx_import import input_defaults, with_batch
from tessel.passes.partition import insert_transfers
from tessel.passes.machine import Machine
from tessel.passes.placement import PlacementError, place
from tessel.runtime.calibrate import load_link
from tessel.runtime.profile import ProfilingFailed, profile_steps
from tessel.runtime.profile_db import ProfileDB

from .artifact import Artifact, load, write_input_defaults
from .distribute import PlacementReport, build_tasks, placement_markdown, read_machine_file
from .gantt_png import write_gantt_png
from .packaging import write_artifact
from .memory import peak_description, plan_program_memory, weight_bytes, write_memory_reports
from .pipeline import PASS_NAMES, pass_report, run_pipeline, select_passes
from .program import build_program
from .sizes import format_bytes, parse_bytes

__all__ = ["Artifact", "CompileError", "compile", "load"]


class CompileError(TesselError):
    """The compile request itself is invalid (e.g. an option Tessel does not offer yet)."""


CONV_LAYOUTS = ("blocked", "nchw")


def compile(  # noqa: A001 - the contract names it compile
    model_or_path,
    *,
    target: str = "llvm",
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    devices: int = 1,
    placement: str = "auto",
    microbatches: int = 1,
    batch: int | None = None,
    pins: Sequence[str] = (),
    machine: str | os.PathLike | None = None,
    profile: bool = True,
    reprofile: bool = False,
    cache_dir: str | os.PathLike | None = None,
    jobs: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    profile_progress: Callable[[int, int], None] | None = None,
    device_memory: int | str | None = None,
    skip_passes: Sequence[str] = (),
    verify: bool = False,
    dump_after: Sequence[str] = (),
    algo_select: str = "off",
    workspace_limit: int | str | None = None,
    batch_policy: str = "powers-of-two",
    profile_budget: float | None = None,
    conv_layout: str = "blocked",
) -> Artifact:
    """Compile an ONNX model (path, bytes or ModelProto) for `target` ("llvm" or "cuda:sm_XX").

    `devices` > 1 places the model on that many devices (`placement`: auto, single,
    pipeline or list; `pins`: 'REGEX=DEVICE' constraints) and inserts the Send/Recv
    pairs between them; with `microbatches` K the batch (axis 0 of every input and
    output) runs as K micro-batches that flow through the devices in a pipeline; node times
    for placement are measured on this machine once and cached (`reprofile`: measure again;
    `profile=False`: FLOP/byte estimates); `batch`
    re-declares axis 0 of every model input (e.g. batch 8 of a model exported at batch 1). A JSON
    `machine` file gives the devices, their memory and the link cost instead.
    `device_memory` (bytes, or a size such as "512MiB", per device) makes compilation
    fail when the weights and the planned activation arena do not fit.
    The graph goes through the optimization pipeline (compiler/pipeline.py) less
    `skip_passes`; `verify` checks the graph after every pass; `dump_after` names
    passes after which the graph is written to `reports/after_<pass>.txt` and `.onnx`.
    `conv_layout` "blocked" keeps activations between conv kernels in NCHW[16]c
    (passes/conv_layout.py); "nchw" converts at every conv kernel.
    Returns an in-memory Artifact (a temporary directory) to `run` or `save`.
    """
    spec = parse_target(target)
    capacities, link = [_capacity(device_memory)] * max(devices, 1), None
    if machine is not None:
        try:
            devices, capacities, link = read_machine_file(machine)
        except ValueError as exc:
            raise CompileError(str(exc)) from None
    passes = _checked_options(devices, microbatches, skip_passes, dump_after, algo_select, batch_policy)
    if conv_layout not in CONV_LAYOUTS:
        raise CompileError(f"conv_layout={conv_layout!r}: use one of {', '.join(CONV_LAYOUTS)}")
    blocked = conv_layout == "blocked"
    selection_options = workspace_limit is not None or profile_budget is not None or batch_policy != "powers-of-two"
    if algo_select == "off" and selection_options:
        raise CompileError("--workspace-limit, --batch-policy and --profile-budget choose algorithms: "
                           "add --algo-select dp or ilp")
    capacity = capacities[0]
    started = time.perf_counter()
    model = ir.load_model(model_or_path)
    if batch is not None:
        model = with_batch(model, batch)
        input_shapes = {name: (batch,) + tuple(shape[1:]) if len(shape) else tuple(shape)
                        for name, shape in (input_shapes or {}).items()}
    graph = _import(model, input_shapes, microbatches)
    imported = time.perf_counter()
    staging = tempfile.TemporaryDirectory(prefix="tessel-artifact-")
    root = Path(staging.name)
    (root / "reports").mkdir()
    graph, pass_records = run_pipeline(graph, passes, verify=verify, dump_after=dump_after, dump_dir=root / "reports")
    optimized = time.perf_counter()
    program = build_program(graph, spec, blocked_layout=blocked)
    if program.unsupported:
        raise LoweringError(f"no {spec.kind} kernels for {len(program.unsupported)} op type(s): " + "; ".join(program.unsupported))
    if devices == 1:
        _check_device_memory(plan_program_memory(program, spec.kind), weight_bytes(program), capacity)
    cache = KernelCache(cache_dir)
    algo_summary = None
    if algo_select != "off":
        program, algo_summary = _select_algorithms(graph, spec, program, cache, root / "reports", algo_select,
                                                   workspace_limit, capacity, batch_policy, profile_budget,
                                                   reprofile, profile_progress, blocked)
    stats = build_kernels(program.kernels, spec, cache, jobs, progress)
    built = time.perf_counter()
    report: dict = {}
    extra: dict = {"microbatches": microbatches} if microbatches > 1 else {}
    if devices == 1:
        programs = [program]
    else:
        programs, placement_doc, graph = _distribute(graph, program, spec, cache, placement, microbatches, pins,
                                                     capacities, link or load_link(), profile, reprofile,
                                                     lambda share: _replica(model, input_shapes, share, passes), blocked)
        extra.update({"placement": placement_doc["planner"]})
        if placement_doc["planner"] == "data":
            extra["data_parallel"] = devices
        elif placement_doc["planner"] == "hybrid":
            extra["hybrid"] = {"replicas": devices, "gathered": placement_doc["cut"]["values"]}
        report["placement"] = {k: placement_doc[k] for k in ("planner", "predicted_makespan_s", "bound_s", "transfer_bytes")}
        (root / "reports" / "placement.json").write_text(json.dumps(placement_doc, indent=1))
        (root / "reports" / "placement.md").write_text(placement_markdown(placement_doc))
        write_gantt_png(root / "reports" / "placement_gantt.png", placement_doc)
    memories = [plan_program_memory(p, spec.kind) for p in programs]
    memory_reports = [write_memory_reports(root / "reports", m, weight_bytes(p), suffix="" if d == 0 else f"_device{d}")
                      for d, (p, m) in enumerate(zip(programs, memories))]
    (root / "model.onnx").write_bytes(model.SerializeToString())
    extra.update(write_input_defaults(root, input_defaults(model)))
    (root / "graph.json").write_text(ir.to_json(graph))
    report = {
        "target": str(spec),
        "devices": devices,
        "nodes": len(graph.nodes),
        "steps": sum(len(p.steps) for p in programs),
        "kernel_calls": max(_count_kernel_calls(p.steps) for p in programs) if devices == 1 else
        sum(_count_kernel_calls(p.steps) for p in programs),
        "kernels": stats.kernels,
        "kernels_cached": stats.cached,
        "kernels_compiled": stats.compiled,
        "seconds": {"import": round(imported - started, 3), "passes": round(optimized - imported, 3),
                    "kernels": round(built - optimized, 3)},
        "passes": [record.to_json() for record in pass_records],
        "memory": _memory_summary(memory_reports),
        "conv_layout": {"mode": conv_layout, "blocked_values": sum(len(p.blocked) for p in programs)},
        **({"algo": algo_summary} if algo_summary else {}),
        **report,
        "tvm_version": tvm_version(),
    }
    (root / "reports" / "compile.json").write_text(json.dumps(report, indent=2))
    (root / "reports" / "passes.md").write_text(pass_report(pass_records))
    write_artifact(root, programs, memories, str(spec), cache, extra)
    return Artifact(root, staging)


def _select_algorithms(graph, spec, program, cache, reports, mode, workspace_limit, capacity, policy, budget,
                       reprofile, progress, blocked_layout):
    """Choose algorithms and micro-batches, write reports/algo.*; the program rebuilt with the choices."""
    from .algo import AlgoSelectionError, find_layers, markdown, report, select, time_candidates
    from .program import ProgramBuilder

    if workspace_limit is not None:
        try:
            limit = parse_bytes(workspace_limit) if isinstance(workspace_limit, str) else int(workspace_limit)
        except ValueError as exc:
            raise CompileError(f"--workspace-limit: {exc}") from None
        source = "--workspace-limit"
    elif capacity is not None:
        needed = plan_program_memory(program, spec.kind).arena_bytes + weight_bytes(program)
        limit, source = capacity - needed, "device memory less the planned weights and activations"
    else:
        limit, source = None, "none given"
    layers = find_layers(graph, spec.kind, policy)
    builder = ProgramBuilder(spec)
    timing = time_candidates(layers, builder, spec, cache, ProfileDB(), budget, reprofile,
                             progress=progress)
    try:
        selection = select(layers, timing, mode, limit, source, policy)
    except AlgoSelectionError as exc:
        raise CompileError(str(exc)) from None
    doc = report(selection, timing)
    (reports / "algo.json").write_text(json.dumps(doc, indent=1))
    (reports / "algo.md").write_text(markdown(doc))
    summary = {k: doc[k] for k in ("mode", "policy", "workspace_limit_bytes", "total_seconds",
                                   "best_single_total_seconds", "workspace_bytes")}
    return build_program(graph, spec, choices=selection.pieces(), blocked_layout=blocked_layout), summary


def _memory_summary(reports: Sequence[dict]) -> dict:
    """Memory totals over the devices (one device: its plan), with each device's numbers when several."""
    keys = ("arena_bytes", "bound_bytes", "no_reuse_bytes", "weights_bytes")
    summary = {key: sum(r[key] for r in reports) for key in keys}
    summary["ratio"] = round(max(r["ratio"] for r in reports), 4)
    if len(reports) > 1:
        summary["per_device"] = [{key: r[key] for key in (*keys, "ratio")} for r in reports]
    return summary


def _checked_options(devices: int, microbatches: int, skip_passes: Sequence[str], dump_after: Sequence[str],
                     algo_select: str = "off", batch_policy: str = "powers-of-two"):
    from tessel.passes.algo_select import POLICIES

    from .algo import MODES

    if algo_select not in MODES:
        raise CompileError(f"--algo-select {algo_select}: use one of {', '.join(MODES)}")
    if batch_policy not in POLICIES:
        raise CompileError(f"--batch-policy {batch_policy}: use one of {', '.join(POLICIES)}")
    if algo_select != "off" and devices > 1:
        raise CompileError(f"--algo-select {algo_select} chooses kernels for one device; compile with --devices 1")
    if devices < 1:
        raise CompileError(f"devices={devices}: need at least one device")
    if microbatches < 1:
        raise CompileError(f"microbatches={microbatches}: need at least one")
    try:
        passes = select_passes(skip_passes)
    except ValueError as exc:
        raise CompileError(str(exc)) from None
    unknown_dumps = sorted(set(dump_after) - set(PASS_NAMES))
    if unknown_dumps:
        raise CompileError(f"--dump-after {', '.join(unknown_dumps)}: no such pass; passes are {', '.join(PASS_NAMES)}")
    return passes


def _import(model, input_shapes, microbatches: int):
    """The graph at micro-batch size: axis 0 of every input and output divided by `microbatches`."""
    graph = ir.from_onnx(model, input_shapes)
    if microbatches == 1:
        return graph
    shapes = {}
    for value in graph.inputs:
        batch = value.type.shape[0] if value.type.rank else 0
        if batch % microbatches or batch == 0:
            raise CompileError(f"--microbatches {microbatches}: input '{value.name}' has batch size "
                               f"{batch if value.type.rank else 'none (a scalar)'}, not a multiple of {microbatches}")
        shapes[value.name] = (batch // microbatches,) + value.type.shape[1:]
    full_outputs = {v.name: v.type.shape for v in graph.outputs}
    batches = {shape[0] for shape in shapes.values()}
    if len(batches) != 1:
        raise CompileError(f"--microbatches {microbatches}: the inputs disagree on the batch size (axis 0)")
    micro = ir.from_onnx(with_batch(model, batches.pop()), shapes)
    for value in micro.outputs:
        full = full_outputs[value.name]
        if not full or value.type.shape[0] * microbatches != full[0]:
            raise CompileError(f"--microbatches {microbatches}: output '{value.name}' does not have the batch on axis 0 "
                               f"({list(full)} at full batch); compile without micro-batches")
    return micro


def _capacity(device_memory: int | str | None) -> int | None:
    if device_memory is None:
        return None
    try:
        return parse_bytes(device_memory) if isinstance(device_memory, str) else int(device_memory)
    except ValueError as exc:
        raise CompileError(f"--device-memory: {exc}") from None


def _replica(model, input_shapes, devices: int, passes):
    """The optimized graph one data-parallel device runs: the model at 1/devices of the batch."""
    graph, _ = run_pipeline(_import(model, input_shapes, devices), passes)
    return graph


def _shared_batch(graph) -> int | None:
    """Axis 0 of every input and output when they all share it, else None."""
    sizes = {v.type.shape[0] if v.type.rank else None for v in [*graph.inputs, *graph.outputs]}
    return sizes.pop() if len(sizes) == 1 else None


def _distribute(graph, program, spec, cache, placement, microbatches, pins, capacities, link, profile, reprofile,
                replica, blocked_layout):
    """Place the graph on the devices: measure node times, plan, insert Send/Recv, one program per device.

    Returns (programs, placement report, graph run): with `data` placement one
    program that every device runs, made from `replica(devices)`.
    """
    devices = len(capacities)
    if spec.kind != "llvm":
        raise CompileError(f"devices={devices}: multi-device runs use CPU workers (gloo); compile with --target llvm")
    threads = max(1, (os.cpu_count() or 1) // devices)
    step_ms, note = {}, "not profiled: node times are estimates"
    if profile:
        with tempfile.TemporaryDirectory(prefix="tessel-profile-") as scratch:
            write_artifact(Path(scratch), [program], [plan_program_memory(program, spec.kind)], str(spec), cache)
            try:
                step_ms = profile_steps(Path(scratch), program.steps, threads, ProfileDB(), remeasure=reprofile)
                note = None
            except ProfilingFailed as exc:
                note = f"kernels could not be timed on random inputs ({exc}); node times are estimates"
    tasks = build_tasks(graph, step_ms, once={s["node"] for s in program.steps if s.get("init")})
    machine = Machine(tuple(c or (1 << 62) for c in capacities), link)
    io_bytes = (sum(v.type.nbytes for v in graph.inputs), sum(v.type.nbytes for v in graph.outputs))
    batch = _shared_batch(graph)
    cuts = {i: sum(v.type.nbytes for v in crossing) for i, crossing in _batch_cuts(graph, batch).items()}
    try:
        plan = place(tasks, machine, placement, pins, microbatches, batch, io_bytes, cuts)
    except PlacementError as exc:
        raise CompileError(str(exc)) from None
    if note:
        plan.notes.append(note)
    if plan.replicated:
        return _data_parallel(plan, tasks, machine, spec, cache, capacities, replica(devices), blocked_layout)
    if plan.cut is not None:
        return _hybrid(plan, tasks, machine, spec, cache, capacities, graph, replica(devices), blocked_layout)
    transfers = insert_transfers(graph, plan.device)
    programs = [build_program(graph, spec, d, plan.device, blocked_layout=blocked_layout) for d in range(devices)]
    # A value sent to another device keeps NCHW, so a device's kernels may differ from the one-device program's.
    for program in programs:
        build_kernels(program.kernels, spec, cache)
    memories = [plan_program_memory(p, spec.kind) for p in programs]
    for d, (p, m) in enumerate(zip(programs, memories)):
        _check_device_memory(m, weight_bytes(p), capacities[d], f"device {d}: ")
    doc = PlacementReport(plan, transfers, machine, tasks, [weight_bytes(p) for p in programs],
                          [m.arena_bytes for m in memories]).to_json()
    return programs, doc, graph


def _batch_cuts(graph, batch: int | None) -> dict[int, list]:
    """Cut position i (nodes[:i] | nodes[i:]) → the values crossing it, where every one of them carries the
    batch on axis 0 and is computed from the inputs (so its slices can be gathered)."""
    from tessel.ir.analysis import weight_derived

    if not batch:
        return {}
    nodes = graph.nodes
    produced_at = {id(v): i for i, node in enumerate(nodes) for v in node.outputs if v is not None}
    last_read: dict[int, int] = {}
    for i, node in enumerate(nodes):
        for v in node.dependencies():
            last_read[id(v)] = i
    for v in graph.outputs:
        last_read[id(v)] = len(nodes)
    values = {id(v): v for node in nodes for v in node.outputs if v is not None}
    derived = weight_derived(graph)
    cuts: dict[int, list] = {}
    for i in range(1, len(nodes)):
        crossing = [values[k] for k, p in produced_at.items() if p < i <= last_read.get(k, -1)]
        if crossing and all(id(v) not in derived and v.type.rank and v.type.shape[0] == batch for v in crossing):
            cuts[i] = crossing
    return cuts


def _hybrid(plan, tasks, machine, spec, cache, capacities, graph, replica, blocked_layout):
    """Two programs: the nodes before the cut at the replica's batch (every device runs them on its slice), and
    the rest at the whole batch (device 0, fed the gathered values at the cut and the model inputs it reads)."""
    from tessel.passes.partition import Transfers

    from .program import stage_program

    devices = machine.devices
    prefix = {node.name for node in graph.nodes[:plan.cut]}
    missing = sorted(prefix - {node.name for node in replica.nodes})
    if missing:
        raise CompileError(f"--placement hybrid: the model at 1/{devices} of the batch optimizes differently "
                           f"(no node '{missing[0]}'); use --placement data or pipeline")
    crossing = _batch_cuts(graph, _shared_batch(graph))[plan.cut]
    by_name = {v.name: v for node in replica.nodes for v in node.outputs if v is not None}
    head = stage_program(replica, spec, prefix, list(replica.inputs), [by_name[v.name] for v in crossing],
                         blocked_layout)
    read_by_tail = {id(v) for node in graph.nodes[plan.cut:] for v in node.dependencies()}
    tail_inputs = crossing + [v for v in graph.inputs if id(v) in read_by_tail or v in graph.outputs]
    tail = stage_program(graph, spec, {node.name for node in graph.nodes[plan.cut:]}, tail_inputs, list(graph.outputs),
                         blocked_layout)
    programs = [head, tail]
    for program in programs:
        build_kernels(program.kernels, spec, cache)
    memories = [plan_program_memory(p, spec.kind) for p in programs]
    needs = [weight_bytes(head) + weight_bytes(tail), weight_bytes(head)]
    for d, capacity in enumerate(capacities):
        memory = memories[0].arena_bytes + (memories[1].arena_bytes if d == 0 else 0)
        if capacity is not None and needs[min(d, 1)] + memory > capacity:
            raise CompileError(f"device {d}: hybrid placement needs {format_bytes(needs[min(d, 1)] + memory)}, "
                               f"the device has {format_bytes(capacity)}")
    transfers = Transfers([(v.name, 0, d, v.type.nbytes // devices) for v in graph.inputs for d in range(1, devices)]
                          + [(v.name, d, 0, v.type.nbytes // devices) for v in crossing for d in range(1, devices)])
    arenas = [memories[0].arena_bytes + memories[1].arena_bytes] + [memories[0].arena_bytes] * (devices - 1)
    doc = PlacementReport(plan, transfers, machine, tasks, [needs[0]] + [needs[1]] * (devices - 1), arenas).to_json()
    doc["cut"] = {"position": plan.cut, "before_node": graph.nodes[plan.cut].name, "values": [v.name for v in crossing]}
    return programs, doc, graph


def _data_parallel(plan, tasks, machine, spec, cache, capacities, graph, blocked_layout):
    """One program at the replica's batch, which every device runs; the scatter and gather as its transfers."""
    from tessel.passes.partition import Transfers

    program = build_program(graph, spec, blocked_layout=blocked_layout)
    build_kernels(program.kernels, spec, cache)
    memory = plan_program_memory(program, spec.kind)
    for d, capacity in enumerate(capacities):
        _check_device_memory(memory, weight_bytes(program), capacity, f"device {d}: ")
    devices = machine.devices
    transfers = Transfers([(v.name, 0, d, v.type.nbytes) for v in graph.inputs for d in range(1, devices)]
                          + [(v.name, d, 0, v.type.nbytes) for v in graph.outputs for d in range(1, devices)])
    doc = PlacementReport(plan, transfers, machine, tasks, [weight_bytes(program)] * devices,
                          [memory.arena_bytes] * devices).to_json()
    return [program], doc, graph


def _check_device_memory(memory, weights: int, capacity: int | None, where: str = "") -> None:
    if capacity is None:
        return
    needed = memory.arena_bytes + weights
    if needed > capacity:
        raise CompileError(
            f"{where}the model needs {format_bytes(needed)} (weights {format_bytes(weights)} + activations "
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
