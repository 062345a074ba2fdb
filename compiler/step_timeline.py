"""The predicted timeline of one training step on its workers: every worker's program played out on a clock.

Each worker runs its instructions in order. A kernel takes its time (compiler/step_kernels.py) once the
all-reduces whose results it reads are done; an all-reduce starts when issued and its worker's link is free and
takes the α-β time of its algorithm (passes/data_parallel.py), so it overlaps the kernels after it; a Send
leaves when issued and its worker's link is free, holds the link for β·bytes (its latency α does not keep the
next message back: sends are asynchronous) and arrives α + β·bytes after leaving; a Recv waits for its Send's
arrival. Each end of a message also takes α/2 of its worker's time (the software's share of the latency, LogP's
overhead o: between local processes α is mostly that), the sender's after issuing, the receiver's before the
message counts as arrived. The step ends when every worker's last instruction, all-reduce and Send is done.

Every bar carries the phase of the step it belongs to (forward, backward, all-reduce, send/recv, update), from
the data flow of a data-parallel replica's program (`replica_phases`) or from the stage blocks a pipeline's
plan.json records (`stage_phases`); `reordered_stage` replays a pipeline stage's blocks in another schedule's
order (1F1B from a GPipe compile: the blocks are the same, only their order differs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from tessel.ir.types import TensorType
from tessel.passes.machine import Link
from tessel.passes.pipeline_schedule import stage_order
from tessel.runtime.instructions import AllReduce, Assign, Instruction, KernelCall, Recv, Send, reads_within
from tessel.runtime.profile_db import ESTIMATE_BYTES_PER_S

FORWARD, BACKWARD, ALLREDUCE, TRANSFER, UPDATE = "forward", "backward", "all-reduce", "send/recv", "update"
WAIT = "waiting (recv, all-reduce)"
PHASES = (FORWARD, BACKWARD, ALLREDUCE, TRANSFER, UPDATE, WAIT)
# The pipeline block kinds plan.json records (compiler/pipeline_programs.py block_runs) as step phases; the
# once block (parameters prepared for the micro-batches) counts as forward.
_BLOCK_PHASES = {"once": FORWARD, "F": FORWARD, "B": BACKWARD, "update": UPDATE}
# plan.json of a data-parallel step: the replica's own loss, before its mean over the replicas (which rides in the
# last gradient bucket, so the data flow from the loss output would take in the whole backward pass).
REPLICA_LOSS = "replica_loss"


def forward_loss(plan: Mapping) -> str:
    """The value a data-parallel replica's forward pass ends with: the plan's replica loss, else (an artifact from
    before it was recorded) the step's loss output."""
    return plan.get(REPLICA_LOSS) or plan["workers"][0]["outputs"][0]


@dataclass(frozen=True)
class Bar:
    """One instruction's time on a worker: `comm` bars (all-reduce, Send) run beside the worker's kernels."""

    worker: int
    phase: str
    start_s: float
    finish_s: float
    node: str
    comm: bool = False


@dataclass(frozen=True)
class Timeline:
    """A step's bars, its seconds, and each worker's busy seconds (kernels and copies: what a bubble is not)."""

    bars: list[Bar]
    step_s: float
    busy_s: list[float]


@dataclass(frozen=True)
class WorkerProgram:
    """What the simulation needs of one worker: its instructions, the phase of each, and its values' types."""

    instructions: Sequence[Instruction]
    phases: Sequence[str]
    values: Mapping[str, str]

    def nbytes(self, name: str) -> int:
        """Bytes of value `name`."""
        return TensorType.parse(self.values[name]).nbytes


def simulate(workers: Sequence[WorkerProgram], kernel_s: Callable[[KernelCall], float], link: Link,
             allreduce_s: Callable[[int], float], start_s: float = 0.0) -> Timeline:
    """Play the workers' programs out from `start_s` (the batch delivered); ValueError when they would deadlock."""
    count = len(workers)
    overhead = link.alpha / 2  # a message's software cost on each end (LogP's o): α is mostly that on one machine
    position, clock = [0] * count, [start_s] * count
    link_free, busy = [start_s] * count, [0.0] * count
    ready: list[dict[str, float]] = [{} for _ in workers]
    arrivals: dict[tuple[int, int, int], float] = {}
    bars: list[Bar] = []
    while any(position[w] < len(p.instructions) for w, p in enumerate(workers)):
        moved = False
        for w, program in enumerate(workers):
            while position[w] < len(program.instructions):
                instruction, phase = program.instructions[position[w]], program.phases[position[w]]
                if isinstance(instruction, Recv):
                    key = (instruction.peer, w, instruction.tag)
                    if key not in arrivals:
                        break
                    arrived = max(clock[w] + overhead, arrivals[key])
                    if arrived > clock[w]:
                        bars.append(Bar(w, WAIT, clock[w], arrived, instruction.node))
                    clock[w] = arrived
                elif isinstance(instruction, Send):
                    nbytes = program.nbytes(instruction.tensor)
                    leaves = max(clock[w], link_free[w])
                    link_free[w] = leaves + link.beta * nbytes
                    arrivals[(w, instruction.peer, instruction.tag)] = leaves + link.seconds(nbytes)
                    bars.append(Bar(w, TRANSFER, leaves, leaves + link.seconds(nbytes), instruction.node, comm=True))
                    bars.append(Bar(w, TRANSFER, clock[w], clock[w] + overhead, instruction.node))
                    clock[w] += overhead
                elif isinstance(instruction, AllReduce):
                    begins = max(clock[w], link_free[w])
                    link_free[w] = begins + allreduce_s(program.nbytes(instruction.tensor))
                    ready[w][instruction.output or instruction.tensor] = link_free[w]
                    bars.append(Bar(w, ALLREDUCE, begins, link_free[w], instruction.node, comm=True))
                elif not instruction.runs_at_load:
                    seconds = _compute_s(instruction, program, kernel_s)
                    begins = max([clock[w], *(ready[w].get(name, 0.0) for name in reads_within(instruction))])
                    if seconds:
                        bars.append(Bar(w, phase, begins, begins + seconds, instruction.node))
                    clock[w], busy[w] = begins + seconds, busy[w] + seconds
                position[w] += 1
                moved = True
        if not moved:
            stuck = {w: workers[w].instructions[p].node for w, p in enumerate(position)
                     if p < len(workers[w].instructions)}
            raise ValueError(f"the step's programs would deadlock at {stuck}")
    ends = [max([clock[w], link_free[w], *ready[w].values()]) for w in range(count)]
    return Timeline(bars, max(ends, default=start_s), busy)


def _compute_s(instruction: Instruction, program: WorkerProgram, kernel_s: Callable[[KernelCall], float]) -> float:
    """Seconds of a kernel call or a copy on the worker (views and the like cost nothing)."""
    if isinstance(instruction, KernelCall):
        return kernel_s(instruction)
    if isinstance(instruction, Assign):
        return 2 * program.nbytes(instruction.src) / ESTIMATE_BYTES_PER_S
    return 0.0


def replica_phases(instructions: Sequence[Instruction], loss: str) -> list[str]:
    """The phase of each instruction of a data-parallel replica's step: forward (what the loss needs), all-reduce,
    update (what reads an averaged gradient, and the state copies), backward (the rest)."""
    # What each instruction reads comes from the last writer before it (a parameter the update later writes in
    # place is read as it was before).
    latest: dict[str, int] = {}
    sources: list[set[int]] = []
    for k, instruction in enumerate(instructions):
        sources.append({latest[name] for name in reads_within(instruction) if name in latest})
        latest.update(dict.fromkeys(instruction.writes(), k))
    phases = [BACKWARD] * len(instructions)
    wanted = [latest[loss]] if loss in latest else []
    while wanted:
        k = wanted.pop()
        if phases[k] == FORWARD:
            continue
        phases[k] = FORWARD
        wanted.extend(sources[k])
    averaged: set[str] = set()
    for k, instruction in enumerate(instructions):
        if isinstance(instruction, AllReduce):
            phases[k] = ALLREDUCE
            if (instruction.output or instruction.tensor) != loss:
                averaged.add(instruction.output or instruction.tensor)
        elif isinstance(instruction, Assign) or reads_within(instruction) & averaged:
            phases[k] = UPDATE
            averaged.update(instruction.writes())
    return phases


def stage_phases(runs: Sequence[Sequence]) -> list[str]:
    """Each instruction's phase from a stage's [block kind, micro-batch, count] runs (plan.json's pipeline
    "phases")."""
    return [_BLOCK_PHASES[kind] for kind, _, count in runs for _ in range(count)]


def reordered_stage(instructions: Sequence[Instruction], runs: Sequence[Sequence], schedule: str, stages: int,
                    micro_batches: int, stage: int) -> tuple[list[Instruction], list[str]]:
    """A stage's instructions and phases with its F(m) and B(m) blocks in `schedule`'s order (the once block
    first and the update block last, as compiled)."""
    blocks: dict[tuple[str, int | None], list[Instruction]] = {}
    first, last = [], []
    at = 0
    for kind, m, count in runs:
        part = list(instructions[at:at + count])
        at += count
        if kind == "once":
            first += part
        elif kind == "update":
            last += part
        else:
            blocks.setdefault((kind, m), []).extend(part)
    order = stage_order(schedule, stages, micro_batches, stage)
    ordered = [(first, "once"), *((blocks.get((kind, m), []), kind) for kind, m in order), (last, "update")]
    sequence = [instruction for part, _ in ordered for instruction in part]
    phases = [_BLOCK_PHASES[kind] for part, kind in ordered for _ in part]
    return sequence, phases
