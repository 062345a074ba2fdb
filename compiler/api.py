"""The public Python API: `compile` a model into an `Artifact`, `load` a saved one.

`compile` is a short sequence of stages: options → import (once) → passes →
micro-batches → program → algorithm selection → kernels → placement (one
program per worker, compiler/worker_programs.py) → memory plans → artifact.
Everything after the import is `compile_graph`, which training shares
(compiler/trainer.py compiles a step graph and an eval graph with it).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from tessel import ir
from tessel.backends.builder import build_kernels
from tessel.backends.cache import KernelCache
from tessel.backends.lowering import LoweringError
from tessel.backends.target import parse_target
from tessel.backends.tvm_env import version as tvm_version
from tessel.ir.float64_model import promote_to_float64
from tessel.ir.onnx_import import bind_input_values, declared_shape, input_defaults, with_batch
from tessel.passes.base import Pass
from tessel.runtime.calibrate import load_link
from tessel.runtime.instructions import kernel_call_count
from tessel.runtime.profile_db import ProfileDB

from .artifact import Artifact, load, write_input_defaults, write_model_files
from .compile_log import CompileLog
from .distribute import placement_markdown, read_machine_file
from .kernel_profile import node_flops
from .memory import plan_program_memory, weight_bytes, write_memory_reports
from .options import CompileError, CompileOptions
from .packaging import write_artifact
from .plots.algo_selection import write_algo_chart
from .plots.gantt import graph_facts, write_gantt
from .plots.memory_timeline import write_memory_timeline
from .plots.placement_alternatives import write_placement_chart
from .pipeline import pass_report, run_pipeline
from .precision import BF16, choose_precision
from .program import Program, build_program
from .provenance import PLANNED
from .state_program import PersistentState, with_state, write_state_file
from .worker_programs import MachineShape, check_fits, micro_batch_graph, place_workers

if TYPE_CHECKING:
    import onnx

__all__ = ["Artifact", "CompileError", "CompileOptions", "compile", "load"]

_log = logging.getLogger("tessel.compile")  # one INFO line per stage: the progress of a compile without a terminal


def compile(  # noqa: A001 - the contract names it compile
    model_or_path,
    options: CompileOptions | None = None,
    /,
    *,
    progress: Callable[[int, int], None] | None = None,
    profile_progress: Callable[[int, int], None] | None = None,
    **overrides,
) -> Artifact:
    """Compile an ONNX model (path, bytes or ModelProto) into an in-memory Artifact to `run` or `save`.

    The options are a `CompileOptions` (compiler/options.py, which says what each does) and/or its fields as
    keywords, e.g. `compile("m.onnx", target="cuda:sm_80", devices=2, input_shapes={"x": (1, 3, 224, 224)})`.
    `progress` and `profile_progress` are called with (done, total) while kernels compile and while
    algorithm candidates are timed.
    """
    options = CompileOptions.create(options, **overrides)
    machine = prepare_machine(options)
    started = time.perf_counter()
    model, input_shapes = load_model(model_or_path, options)
    graph = ir.from_onnx(model, input_shapes, input_values=options.input_values)
    if options.input_values:  # the model as compiled, with those inputs constants: what `run --check` compares with
        model = bind_input_values(model, options.input_values)
    origin = model if options.input_values else model_or_path
    source = ModelSource(model_name(model_or_path, model), model, origin, input_defaults(model),
                         time.perf_counter() - started)
    return compile_graph(graph, options, machine, source, progress=progress, profile_progress=profile_progress)


@dataclass(frozen=True)
class ModelSource:
    """What packaging needs about the model a graph came from: its name (for charts), the ONNX model (graph.json,
    model.onnx with `keep_model`), where it was read from, its overridable inputs' defaults, and the import time."""

    name: str
    model: onnx.ModelProto
    origin: Any
    defaults: Mapping[str, Any]
    import_seconds: float


def load_model(model_or_path, options: CompileOptions) -> tuple[onnx.ModelProto, dict]:
    """The ONNX model as compiled and its input shapes: re-batched when the options give a `batch`, in float64 with
    precision "fp64"."""
    model = ir.load_model(model_or_path)
    if options.precision == "fp64":
        model = promote_to_float64(model)
    input_shapes = dict(options.input_shapes)
    if options.batch is not None:
        model = with_batch(model, options.batch)
        input_shapes = {name: (options.batch,) + shape[1:] if shape else shape for name, shape in input_shapes.items()}
    return model, input_shapes


def model_name(model_or_path, model: onnx.ModelProto) -> str:
    """What the charts call the model: its file's name, else the ONNX graph's name."""
    if isinstance(model_or_path, (str, os.PathLike)):
        return Path(model_or_path).stem
    return model.graph.name or "model"


def prepare_machine(options: CompileOptions) -> MachineShape:
    """The workers the options describe (machine file or devices), checked before any import; warns when they
    outnumber this machine's cores."""
    parse_target(options.target)
    machine_shape = _machine_shape(options)
    _warn_shared_cores(machine_shape.devices)
    return machine_shape


def compile_graph(graph: ir.Graph, options: CompileOptions, machine_shape: MachineShape, source: ModelSource, *,
                  state: PersistentState | None = None, passes: Sequence[Pass] | None = None,
                  progress: Callable[[int, int], None] | None = None,
                  profile_progress: Callable[[int, int], None] | None = None,
                  replicate: Callable[[Program, ir.Graph], list[Program]] | None = None,
                  plan_extra: Mapping[str, Any] | None = None) -> Artifact:
    """The stages after import: passes → micro-batches → program → algorithm selection → kernels → placement →
    memory plans → artifact. Inference compiles the imported model's graph; training (compiler/trainer.py) a
    step graph and an eval graph, whose `state` persists across runs (compiler/state_program.py). `passes`
    replaces the options' pipeline (training adds recomputation); `replicate` turns the one-device program (and
    the graph it runs) into the workers' programs (data-parallel training, compiler/dp_training.py; pipeline
    training, compiler/pipeline_programs.py); `plan_extra` adds entries to plan.json."""
    if state is not None and (machine_shape.devices > 1 or options.microbatches > 1):
        raise CompileError("training compiles for one device and one micro-batch; data-parallel training "
                           "replicates that step (compile_training with devices=N)")
    spec = parse_target(options.target)
    name = source.name
    imported = time.perf_counter()
    _log.info("imported: %d nodes (%.1f s)", len(graph.nodes), source.import_seconds)
    staging = tempfile.TemporaryDirectory(prefix="tessel-artifact-")
    root = Path(staging.name)
    reports = root / "reports"
    reports.mkdir()
    graph, pass_records = run_pipeline(graph, options.passes if passes is None else passes, verify=options.verify,
                                       dump_after=options.dump_after, dump_dir=reports)
    graph = micro_batch_graph(graph, options.microbatches)
    optimized = time.perf_counter()
    _log.info("passes: %d nodes after %d passes (%.1f s)", len(graph.nodes), len(pass_records), optimized - imported)
    for record in pass_records:
        _log.debug("  %s: nodes %d -> %d, kernels %d -> %d (%.1f ms)", record.name, record.nodes_before,
                   record.nodes_after, record.kernels_before, record.kernels_after, 1e3 * record.seconds)
    built: dict[str, Program] = {}  # by precision: the bf16 program the choice looks at is the one then used

    def program_in(precision: str) -> Program:
        if precision not in built:
            built[precision] = build_program(graph, spec, blocked_layout=options.blocked_layout, precision=precision)
        return built[precision]

    precision = choose_precision(options.precision, graph, spec.kind, lambda: program_in(BF16).bf16_nodes)
    if precision.used != options.precision:  # "auto" resolved: every later program is built with the choice
        options = CompileOptions.create(options, precision=precision.used)
    program = _with_state(program_in(options.precision), state)
    if program.unsupported:
        raise LoweringError(f"no {spec.kind} kernels for {len(program.unsupported)} op type(s): " + "; ".join(program.unsupported))
    if machine_shape.devices == 1:  # fail before minutes of kernel compilation
        check_fits(program, plan_program_memory(program, spec.kind), machine_shape.capacities[0])
    cache = KernelCache(options.cache_dir)
    algo_summary = None
    if options.algo_select != "off":
        program, algo_summary = _select_algorithms(graph, spec, program, cache, reports, options,
                                                   machine_shape.capacities[0], profile_progress, name)
        program = _with_state(program, state)
        _log.info("algorithm selection (%s) (%.1f s)", options.algo_select, time.perf_counter() - optimized)
    _log.debug("kernels: %d distinct, looked up in %s", len(program.kernels), cache.root)
    stats = build_kernels(program.kernels, spec, cache, options.jobs, progress)
    built = time.perf_counter()
    _log.info("kernels: %d (%d from cache, %d compiled) (%.1f s)", stats.kernels, stats.cached, stats.compiled,
              built - optimized)
    facts = graph_facts(graph)  # placement adds Send/Recv nodes to `graph`
    log = CompileLog()
    placed = place_workers(graph, program, spec, cache, options, machine_shape, log)
    programs, memories, graph = placed.programs, placed.memories, placed.graph
    if replicate is not None:
        programs = replicate(programs[0], graph)
        memories = [plan_program_memory(p, spec.kind) for p in programs]
    _log.info("placement: %d worker program(s) planned (%.1f s)", len(programs), time.perf_counter() - built)
    _warn_idle_workers(programs, placed.report)
    extra: dict = {"microbatches": options.microbatches} if options.microbatches > 1 else {}
    if precision.used == BF16:  # plan.json says so (a float32 plan stays as it was)
        extra["precision"] = BF16
    if placed.report is not None:
        extra["placement"] = placed.report["planner"]
        (reports / "placement.json").write_text(json.dumps(placed.report, indent=1))
        (reports / "placement.md").write_text(placement_markdown(placed.report))
        write_gantt(reports / "placement_gantt", placed.report, facts, name)
        if placed.report.get("alternatives"):
            write_placement_chart(reports / "placement_alternatives", placed.report["alternatives"],
                                  placed.report["planner"], name)
    memory_reports = [write_memory_reports(reports, m, weight_bytes(p), suffix="" if w == 0 else f"_device{w}")
                      for w, (p, m) in enumerate(zip(programs, memories))]
    write_memory_timeline(reports / "memory_timeline", memory_reports, f"{name}: planned activation memory per step")
    model_record = write_model_files(root, source.model, graph, options.keep_model, source.origin, options.batch)
    extra.update(write_input_defaults(root, source.defaults))
    if state is not None:
        extra.update(write_state_file(root, programs, state))
    extra.update(plan_extra or {})
    report = {
        "target": str(spec),
        "model": model_record,
        "devices": len(programs),
        "nodes": len(graph.nodes),
        "instructions": sum(len(p.instructions) for p in programs),
        "kernel_calls": sum(kernel_call_count(p.instructions) for p in programs),
        "node_flops": node_flops(graph),
        "kernels": stats.kernels,
        "kernels_cached": stats.cached,
        "kernels_compiled": stats.compiled,
        "seconds": {"import": round(source.import_seconds, 3), "passes": round(optimized - imported, 3),
                    "kernels": round(built - optimized, 3)},
        "passes": [record.to_json() for record in pass_records],
        "memory": _memory_summary(memory_reports),
        "conv_layout": {"mode": options.conv_layout, "blocked_values": sum(len(p.blocked) for p in programs)},
        "precision": precision.to_json(),
        **({"algo": algo_summary} if algo_summary else {}),
        **({"placement": {k: placed.report[k] for k in ("planner", "predicted_makespan_s", "predicted_source",
                                                        "node_times", "link", "alternatives", "bound_s",
                                                        "transfer_bytes")}}
           if placed.report is not None else {}),
        "tvm_version": tvm_version(),
        **({"notes": log.notes} if log.notes else {}),
    }
    log.write(root)
    (reports / "compile.json").write_text(json.dumps(report, indent=2))
    (reports / "passes.md").write_text(pass_report(pass_records))
    write_artifact(root, programs, memories, str(spec), cache, extra)
    return Artifact(root, staging)


def _with_state(program: Program, state: PersistentState | None) -> Program:
    """The program with its persistent state out of its inputs and outputs and its Assigns added (training)."""
    return program if state is None else with_state(program, state)


def _machine_shape(options: CompileOptions) -> MachineShape:
    """The workers: from the machine file when given, else `devices` alike with `device_memory` each."""
    if options.machine is None:
        return MachineShape(options.devices, [options.device_memory] * options.devices, load_link())
    try:
        devices, capacities, link = read_machine_file(options.machine)
    except ValueError as exc:
        raise CompileError(str(exc)) from None
    if devices > 1:
        CompileOptions.create(options, devices=devices)  # the same checks as --devices
    return MachineShape(devices, capacities, link or load_link())


def _warn_shared_cores(devices: int) -> None:
    """More workers than this machine has cores: its local runs share them, so they cannot keep the pace the
    placement planned with kernels timed one at a time."""
    cores = len(os.sched_getaffinity(0))
    if devices > cores:
        _log.warning("%d devices on a machine with %d core(s): the %d workers of a local run will share the cores "
                     "and run slower than the placement predicts", devices, cores, devices)


def _warn_idle_workers(programs, placement: dict | None) -> None:
    """Say when the placement gives some workers no kernel to run: their processes would only wait."""
    idle = sum(1 for p in programs if kernel_call_count(p.instructions) == 0)
    if idle and placement is not None:
        _log.warning("placement %s gives %d of %d devices no kernel to run (their "
                     "processes would only wait); compile with fewer --devices", placement["planner"], idle, len(programs))


def _select_algorithms(graph, spec, program, cache, reports, options: CompileOptions, capacity, progress, name):
    """Choose algorithms and micro-batches, write reports/algo.*; the program rebuilt with the choices."""
    from .algo import AlgoSelectionError, find_layers, markdown, report, select, time_candidates
    from .program import selection_builder

    mode, policy = options.algo_select, options.batch_policy
    if options.workspace_limit is not None:
        limit, source = options.workspace_limit, "--workspace-limit"
    elif capacity is not None:
        needed = plan_program_memory(program, spec.kind).arena_bytes + weight_bytes(program)
        limit, source = capacity - needed, "device memory less the planned weights and activations"
    else:
        limit, source = None, "none given"
    layers = find_layers(graph, spec.kind, policy)
    # The candidates in the compile's precision: a bf16 compile times the bf16 kernels its packed convs would run
    # (their specs, hence their profile database keys, carry the precision), not the float32 ones.
    builder = selection_builder(graph, spec, options.precision)
    timing = time_candidates(layers, builder, spec, cache, ProfileDB(), options.profile_budget, options.reprofile,
                             progress=progress)
    try:
        selection = select(layers, timing, mode, limit, source, policy)
    except AlgoSelectionError as exc:
        raise CompileError(str(exc)) from None
    chosen = build_program(graph, spec, choices=selection.pieces(), blocked_layout=options.blocked_layout,
                           precision=options.precision)
    doc = report(selection, timing, program, chosen, builder)
    (reports / "algo.json").write_text(json.dumps(doc, indent=1))
    (reports / "algo.md").write_text(markdown(doc))
    write_algo_chart(reports / "algo_selection", doc, name)
    summary = {k: doc[k] for k in ("mode", "policy", "workspace_limit_bytes", "total_seconds", "total_source",
                                   "best_single_total_seconds", "best_single_source", "workspace_bytes",
                                   "weight_bytes", "default_weight_bytes", "extra_layout_bytes", "profiling")}
    return chosen, summary


def _memory_summary(reports: Sequence[dict]) -> dict:
    """Memory totals over the devices (one device: its plan), with each device's numbers when several."""
    keys = ("arena_bytes", "bound_bytes", "no_reuse_bytes", "weights_bytes")
    summary = {key: sum(r[key] for r in reports) for key in keys}
    summary["ratio"] = round(max(r["ratio"] for r in reports), 4)
    summary["source"] = PLANNED
    if len(reports) > 1:
        summary["per_device"] = [{key: r[key] for key in (*keys, "ratio")} for r in reports]
    return summary


def whole_input_shapes(proto, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Every model input's shape: from `shapes`, else the model's own static shape."""
    initializers = {init.name for init in proto.graph.initializer}
    whole = dict(shapes)
    for value in proto.graph.input:
        if value.name in initializers or value.name in whole:
            continue
        dims = declared_shape(value.type.tensor_type)
        if not all(isinstance(d, int) for d in dims):
            raise CompileError(f"training on several devices needs the shape of input '{value.name}' (input_shapes)")
        whole[value.name] = tuple(dims)
    return whole


def divided_batch_shapes(shapes: Mapping[str, Sequence[int]], parts: int, training: str,
                         division: str) -> dict[str, tuple[int, ...]]:
    """Each input's shape with axis 0 (the batch) divided into `parts`: one replica's or one micro-batch's.
    CompileError when the inputs disagree on the batch, or one does not divide; the line names `training`
    ("data-parallel training") and `division` ("on 2 workers")."""
    if len({shape[0] if shape else None for shape in shapes.values()}) > 1:
        raise CompileError(f"{training}: the inputs disagree on the batch (axis 0): "
                           f"{', '.join(f'{n}: {list(s)}' for n, s in shapes.items())}")
    divided = {}
    for name, shape in shapes.items():
        if not shape or shape[0] % parts:
            raise CompileError(f"{training} {division}: input '{name}' has batch "
                               f"{shape[0] if shape else 'none (a scalar)'}, not a multiple of {parts}")
        divided[name] = (shape[0] // parts, *shape[1:])
    return divided
