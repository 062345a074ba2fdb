"""The placement stage: the optimized graph and a machine → one instruction program per worker.

One device runs the program as built. On several, node times are measured
(or estimated), the planner (passes/placement.py) picks a placement, and this
module applies it:

- single, pipeline, list: Send/Recv pairs between the workers' nodes
  (passes/partition.py); each worker runs its own nodes;
- data: every worker runs the graph re-batched to its slice of the batch
  (ir/rebatch.py); worker 0 scatters the inputs and gathers the outputs;
- hybrid: the nodes before the planner's cut run data-parallel like that,
  their values at the cut are gathered on worker 0, which runs the rest on the
  whole batch.

Scatter and gather are instructions of the programs (runtime/instructions.py),
like Send and Recv: a worker just runs its list.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from tessel.backends.builder import build_kernels
from tessel.ir.analysis import weight_derived
from tessel.ir.graph import Graph, Value
from tessel.ir.rebatch import RebatchError, batch_size, rebatched
from tessel.passes.partition import Transfers, insert_transfers
from tessel.passes.machine import Link, Machine
from tessel.passes.memory_plan import MemoryPlan
from tessel.passes.placement import PlacementError, place
from tessel.runtime.instructions import Gather, KernelCall, Scatter
from tessel.runtime.profile import ProfilingFailed, profile_steps
from tessel.runtime.profile_db import ProfileDB

from .compile_log import CompileLog
from .distribute import PlacementReport, build_tasks
from .memory import peak_description, plan_program_memory, weight_bytes
from .options import CompileError, CompileOptions
from .packaging import write_artifact
from .program import Program, build_program, joined_programs, renamed_program, stage_program
from .sizes import format_bytes

# Tags of the scatters and gathers (Send/Recv pairs take small tags of their own); input or output k uses
# its base + k * workers + worker.
SCATTER_TAG, GATHER_TAG = 1 << 20, 1 << 21
# What a value's slice on one worker is called, beside the whole value on the root.
SLICE_SUFFIX = "@slice"


@dataclass
class MachineShape:
    """The workers to place on: how many, each one's memory (None: unbounded) and the link between them."""

    devices: int
    capacities: list[int | None]
    link: Link | None


@dataclass
class WorkerPrograms:
    """The placement's result: one program per worker with its memory plan, the placement report (None on one
    device), and the graph run."""

    programs: list[Program]
    memories: list[MemoryPlan]
    report: dict[str, Any] | None
    graph: Graph


def micro_batch_graph(graph: Graph, microbatches: int) -> Graph:
    """The graph at micro-batch size: axis 0 of every input and output divided by `microbatches`."""
    if microbatches == 1:
        return graph
    for value in graph.inputs:
        batch = value.type.shape[0] if value.type.rank else 0
        if batch % microbatches or batch == 0:
            raise CompileError(f"--microbatches {microbatches}: input '{value.name}' has batch size "
                               f"{batch if value.type.rank else 'none (a scalar)'}, not a multiple of {microbatches}")
    if batch_size(graph) is None:
        raise CompileError(f"--microbatches {microbatches}: the inputs disagree on the batch size (axis 0)")
    return _sliced(graph, microbatches, f"--microbatches {microbatches}", "compile without micro-batches")


def _sliced(graph: Graph, parts: int, why: str, instead: str) -> Graph:
    """The graph re-batched to 1/`parts` of its batch; every output must carry the batch on axis 0."""
    try:
        part = rebatched(graph, batch_size(graph) // parts)
    except RebatchError as exc:
        raise CompileError(f"{why}: {exc}; {instead}") from None
    for whole, value in zip(graph.outputs, part.outputs):
        if not whole.type.rank or value.type.shape[0] * parts != whole.type.shape[0]:
            raise CompileError(f"{why}: output '{whole.name}' does not have the batch on axis 0 "
                               f"({list(whole.type.shape)} at the whole batch); {instead}")
    return part


def place_workers(graph: Graph, program: Program, spec, cache, options: CompileOptions,
                  machine_shape: MachineShape, log: CompileLog) -> WorkerPrograms:
    """One program per worker for `graph` (whose one-device `program` is built and its kernels compiled); what
    goes wrong on the way is detailed in `log`."""
    if machine_shape.devices == 1:
        memory = plan_program_memory(program, spec.kind)
        check_fits(program, memory, machine_shape.capacities[0])
        return WorkerPrograms([program], [memory], None, graph)
    tasks, notes = _tasks(graph, program, spec, cache, options, machine_shape.devices, log)
    machine = Machine(tuple(c or (1 << 62) for c in machine_shape.capacities), machine_shape.link)
    io_bytes = (sum(v.type.nbytes for v in graph.inputs), sum(v.type.nbytes for v in graph.outputs))
    batch = _shared_batch(graph)
    crossings = _batch_cuts(graph, batch)
    cuts = {i: sum(v.type.nbytes for v in crossing) for i, crossing in crossings.items()}
    try:
        plan = place(tasks, machine, options.placement, options.pins, options.microbatches, batch, io_bytes, cuts)
    except PlacementError as exc:
        raise CompileError(str(exc)) from None
    plan.notes.extend(notes)
    if plan.replicated or plan.cut is not None:
        crossing = crossings[plan.cut] if plan.cut is not None else None
        return _data_parallel(graph, plan, crossing, tasks, machine, spec, cache, options, machine_shape.capacities)
    transfers = insert_transfers(graph, plan.device)
    programs = [build_program(graph, spec, d, plan.device, blocked_layout=options.blocked_layout,
                              precision=options.precision)
                for d in range(machine.devices)]
    # A value sent to another worker keeps NCHW, so a worker's kernels may differ from the one-device program's.
    return _finish(programs, plan, transfers, machine, tasks, graph, spec, cache, machine_shape.capacities)


def _tasks(graph: Graph, program: Program, spec, cache, options: CompileOptions, devices: int, log: CompileLog):
    """One task per node, timed on this machine (cached) or estimated; and notes on how the times were found."""
    threads = max(1, (os.cpu_count() or 1) // devices)
    step_ms, notes = {}, ["not profiled: node times are estimates"]
    if options.profile:
        kernels = {i.node: i.kernel for i in program.instructions if isinstance(i, KernelCall) and not i.init}
        with tempfile.TemporaryDirectory(prefix="tessel-profile-") as scratch:
            write_artifact(Path(scratch), [program], [plan_program_memory(program, spec.kind)], str(spec), cache)
            try:
                step_ms = profile_steps(Path(scratch), kernels, threads, ProfileDB(), remeasure=options.reprofile)
                notes = []
            except ProfilingFailed as exc:
                notes = [log.note("The model did not run on random inputs, so its kernels could not be timed and "
                                  "node times are estimates.", exc, exc.details)]
    return build_tasks(graph, step_ms, once={i.node for i in program.instructions if i.runs_at_load}), notes


def _data_parallel(graph, plan, crossing, tasks, machine, spec, cache, options, capacities) -> WorkerPrograms:
    """Data (every node) or hybrid (the nodes before the cut, `crossing` the values at the cut) placement: those
    nodes run on every worker on its slice of the batch, between a scatter of the inputs and a gather of what
    leaves them."""
    workers = machine.devices
    replica = _sliced(graph, workers, f"--placement {plan.planner}", "use --placement pipeline")
    if plan.cut is None:
        head = build_program(replica, spec, blocked_layout=options.blocked_layout, precision=options.precision)
        leaving, tail = list(graph.outputs), None
    else:
        leaving = crossing
        by_name = {v.name: v for node in replica.nodes for v in node.outputs if v is not None}
        before = {node.name for node in graph.nodes[:plan.cut]}
        head = stage_program(replica, spec, before, list(replica.inputs), [by_name[v.name] for v in leaving],
                             options.blocked_layout, options.precision)
        read_after = {id(v) for node in graph.nodes[plan.cut:] for v in node.dependencies()}
        tail = stage_program(graph, spec, {node.name for node in graph.nodes[plan.cut:]},
                             leaving + [v for v in graph.inputs if id(v) in read_after or v in graph.outputs],
                             list(graph.outputs), options.blocked_layout, options.precision)
    transfers = [(v.name, 0, d, v.type.nbytes // workers) for v in graph.inputs for d in range(1, workers)] + \
                [(v.name, d, 0, v.type.nbytes // workers) for v in leaving for d in range(1, workers)]
    programs = [_replica_program(head, tail, graph, leaving, rank, workers) for rank in range(workers)]
    placed = _finish(programs, plan, Transfers(transfers), machine, tasks, graph, spec, cache, capacities)
    if plan.cut is not None:
        placed.report["cut"] = {"position": plan.cut, "before_node": graph.nodes[plan.cut].name,
                                "values": [v.name for v in crossing]}
    return placed


def _replica_program(head: Program, tail: Program | None, graph: Graph, leaving: Sequence[Value], rank: int,
                     workers: int) -> Program:
    """Worker `rank`'s program: scatter the inputs, run `head` on the slice, gather `leaving` on worker 0,
    which then runs `tail` (hybrid) on the whole batch."""
    slices = {name: f"{name}{SLICE_SUFFIX}" for name in [v.name for v in graph.inputs] + [v.name for v in leaving]}
    body = renamed_program(head, slices)
    root = rank == 0
    scatters = [Scatter(f"scatter_{v.name}", "Scatter", output=slices[v.name], root=0, parts=workers,
                        tag=SCATTER_TAG + k * workers, source=v.name if root else None)
                for k, v in enumerate(graph.inputs)]
    gathers = [Gather(f"gather_{v.name}", "Gather", input=slices[v.name], root=0, parts=workers,
                      tag=GATHER_TAG + k * workers, output=v.name if root else None)
               for k, v in enumerate(leaving)]
    whole = {v.name: v.type.spec() for v in [*graph.inputs, *leaving]} if root else {}
    program = Program(scatters + body.instructions + gathers, body.kernels, {**body.values, **whole}, body.weights,
                      [v.name for v in graph.inputs] if root else [], [v.name for v in leaving] if root else [],
                      body.unsupported, body.init_values, body.blocked, at_load=body.at_load)
    if tail is None or not root:
        return program
    return joined_programs(program, tail, inputs=program.inputs, outputs=tail.outputs)


def _finish(programs, plan, transfers, machine, tasks, graph, spec, cache, capacities) -> WorkerPrograms:
    """Compile the workers' kernels, check each fits its device, and write the placement report."""
    for program in programs:
        build_kernels(program.kernels, spec, cache)
    memories = [plan_program_memory(p, spec.kind) for p in programs]
    for worker, (program, memory, capacity) in enumerate(zip(programs, memories, capacities)):
        check_fits(program, memory, capacity, f"device {worker}: ")
    report = PlacementReport(plan, transfers, machine, tasks, [weight_bytes(p) for p in programs],
                             [m.arena_bytes for m in memories]).to_json()
    return WorkerPrograms(programs, memories, report, graph)


def check_fits(program: Program, memory, capacity: int | None, where: str = "") -> None:
    """CompileError when the program's weights and activation arena (`memory`) exceed the device's `capacity`."""
    if capacity is None:
        return
    weights = weight_bytes(program)
    needed = memory.arena_bytes + weights
    if needed > capacity:
        raise CompileError(
            f"{where}the model needs {format_bytes(needed)} (weights {format_bytes(weights)} + activations "
            f"{format_bytes(memory.arena_bytes)}) but the device has {format_bytes(capacity)}: "
            f"{format_bytes(needed - capacity)} missing; the activation peak is {peak_description(memory)}"
        )


def _shared_batch(graph: Graph) -> int | None:
    """Axis 0 of every input and output when they all share it, else None."""
    sizes = {v.type.shape[0] if v.type.rank else None for v in [*graph.inputs, *graph.outputs]}
    return sizes.pop() if len(sizes) == 1 else None


def _batch_cuts(graph: Graph, batch: int | None) -> dict[int, list[Value]]:
    """Cut position i (nodes[:i] | nodes[i:]) → the values crossing it, where every one of them carries the
    batch on axis 0 and is computed from the inputs (so its slices can be gathered)."""
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
    cuts: dict[int, list[Value]] = {}
    for i in range(1, len(nodes)):
        crossing = [values[k] for k, p in produced_at.items() if p < i <= last_read.get(k, -1)]
        if crossing and all(id(v) not in derived and v.type.rank and v.type.shape[0] == batch for v in crossing):
            cuts[i] = crossing
    return cuts
