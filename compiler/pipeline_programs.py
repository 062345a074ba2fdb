"""Pipeline-parallel training: the one-device step program (compiler/pipeline_step.py's graph, compiled as usual)
cut into K stages, one worker each, every worker running its stage for M micro-batches in the schedule's order.

Each instruction of the step program gets a role from the data flow:
- forward: reads the micro-batch (data, labels, masks) and is needed for the loss or a running statistic;
- backward: reads the micro-batch and is not forward (the gradients, and their sums over the micro-batches);
- update: reads a gradient sum (the optimizer update and its Assigns): run once, after the last micro-batch;
- once: reads neither (a parameter transposed, a scalar cast): run once, before the first micro-batch;
- at load: reads only constants (as in every program).

The forward instructions are cut into K contiguous stages, each running a kernel, with the least bottleneck of
estimated times (passes/pipeline_schedule.py balanced_cut; the placement planner's pipeline cut may leave a
device idle, which a stage of a pipeline step cannot be). Every parameter, and everything that reads it, lives on the
stage whose forward reads it; a backward instruction runs where its forward inputs live, unless a gradient it
reads comes from an earlier stage (gradients flow from the last stage to the first). Each worker's program is
straight-line: its once block, then F(m) and B(m) blocks in passes/pipeline_schedule.py's order, each block the
stage's instructions with every per-micro-batch value renamed `name@mbM`, then its update block. A value read on
another stage crosses once per micro-batch (Send right after its producer; Recv right before its first reader);
Sends complete asynchronously, so no worker waits for a reader, and a dry run of the programs checks that every
Recv has its Send issued before the worker gets there (no deadlock).

Micro-batch m's gradient sums read micro-batch m - 1's (the first reads the parameter, scaled by a constant 0).
A running statistic (BatchNormalization) is chained the same way: micro-batch m reads m - 1's next value and
only the last one is assigned, so each micro-batch normalises with its own batch statistics and the running
statistics see the micro-batches one after the other, as in GPipe.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

import numpy as np

from tessel.ir.costs import bytes_moved, flops
from tessel.ir.graph import Graph
from tessel.ir.types import TensorType, numpy_dtype
from tessel.passes.pipeline_schedule import (BACKWARD, FORWARD, balanced_cut, bubble_fraction, most_in_flight,
                                             stage_order)
from tessel.runtime.instructions import Assign, Instruction, KernelCall, Recv, Send, kernel_keys, reads_within
from tessel.runtime.profile_db import ESTIMATE_BYTES_PER_S, ESTIMATE_FLOPS_PER_S

from .options import CompileError
from .pipeline_step import KEEP_INPUT
from .program import Program

# Tag of the k-th Send/Recv pair of a pipeline step (beside the scatter, gather and scalar tags).
PIPE_TAG = 1 << 23
# The weights standing for the keep input: micro-batch 0 starts its gradient sums, the others add to them.
KEEP_WEIGHTS = ("pipeline.keep=0", "pipeline.keep=1")
INIT, ONCE, UPDATE = "init", "once", "update"


@dataclass(frozen=True)
class PipelineSpec:
    """What the pipeline programs are made of: the stages, micro-batches and schedule, and the roles of the step
    program's inputs and outputs (compiler/pipeline_step.py)."""

    stages: int
    micro_batches: int
    schedule: str
    batched: tuple[str, ...]              # inputs fed per micro-batch (rank 0's, split by the host)
    grad_sums: Mapping[str, str]          # gradient-sum input -> its parameter
    sum_outputs: Mapping[str, str]        # gradient-sum input -> the sum including the micro-batch
    loss: str


def micro_name(name: str, micro_batch: int) -> str:
    """What value `name` of micro-batch `micro_batch` is called in the pipeline programs."""
    return f"{name}@mb{micro_batch}"


def pipeline_programs(program: Program, graph: Graph, spec: PipelineSpec) -> tuple[list[Program], list[list]]:
    """One program per stage from the one-device step `program` (running `graph`, whose nodes give the costs), and
    each stage's block runs (`block_runs`)."""
    roles = _roles(program, spec)
    stages, home = _stages(program, graph, roles, spec)
    blocks = [_blocks(program, roles, stages, spec, s) for s in range(spec.stages)]
    sequences = _with_transfers(program, blocks, home, spec)
    _check_no_deadlock(sequences)
    return ([_stage_program(program, sequence, home, spec, s) for s, sequence in enumerate(sequences)],
            [block_runs(stage_blocks, sequence) for stage_blocks, sequence in zip(blocks, sequences)])


def block_runs(blocks, sequence: list[Instruction]) -> list[list]:
    """A stage's program in runs of one phase, [phase, micro-batch or None, instruction count] in order (what
    plan.json's pipeline "phases" holds per stage, for the step's timeline, compiler/step_timeline.py): "once",
    "F", "B" or "update". A Send belongs to the block of the instruction before it, a Recv to the next one's."""
    phase_of = {id(instruction): (phase, m) for phase, m, block in blocks for instruction in block}
    labels: list = [phase_of.get(id(instruction)) for instruction in sequence]
    following = None
    for k in reversed(range(len(labels))):  # a Recv waits for the block it feeds
        if labels[k] is None and isinstance(sequence[k], Recv):
            labels[k] = following
        following = labels[k] or following
    previous = (ONCE, None)
    runs: list[list] = []
    for label in labels:
        previous = label or previous
        if runs and (runs[-1][0], runs[-1][1]) == previous:
            runs[-1][2] += 1
        else:
            runs.append([previous[0], previous[1], 1])
    return runs


# ---- roles -------------------------------------------------------------------------------------------------
def _roles(program: Program, spec: PipelineSpec) -> list[str]:
    """Each instruction's role: INIT, ONCE, FORWARD, BACKWARD or UPDATE."""
    state = set(program.state)
    per_micro = set(spec.batched) | set(spec.grad_sums) | {KEEP_INPUT}
    updated = set(spec.sum_outputs.values())
    roles = []
    for instruction in program.instructions:
        reads = reads_within(instruction)
        written = [name for name in instruction.writes() if name not in state]
        if instruction.runs_at_load:
            roles.append(INIT)
        elif reads & updated:
            roles.append(UPDATE)
            updated.update(written)
        elif reads & per_micro:
            roles.append(BACKWARD)  # forward ones are picked out below
            per_micro.update(written)
        else:
            roles.append(ONCE)
    producer = _producers(program)
    wanted = [producer[spec.loss]] + [i for i, instruction in enumerate(program.instructions)
                                      if roles[i] == BACKWARD and isinstance(instruction, Assign)]
    while wanted:
        i = wanted.pop()
        if roles[i] != BACKWARD:
            continue
        roles[i] = FORWARD
        wanted.extend(producer[name] for name in reads_within(program.instructions[i]) if name in producer)
    return roles


def _producers(program: Program) -> dict[str, int]:
    """The instruction writing each value (state values, written by Assigns, are left out)."""
    state = set(program.state)
    return {name: i for i, instruction in enumerate(program.instructions)
            for name in instruction.writes() if name not in state}


# ---- stages ------------------------------------------------------------------------------------------------
def _stages(program: Program, graph: Graph, roles: list[str],
            spec: PipelineSpec) -> tuple[list[set[int]], dict[str, int]]:
    """Each instruction's stages (one, or every stage reading an at-load value) and each state value's stage."""
    readers: dict[str, list[int]] = {}
    for i, instruction in enumerate(program.instructions):
        for name in reads_within(instruction):
            readers.setdefault(name, []).append(i)
    stage = _forward_cut(program, graph, roles, spec)
    home = _state_homes(program, roles, spec, stage, readers)
    _place_the_rest(program, roles, spec, stage, home, readers)
    stages: list[set[int]] = [{stage[i]} if i in stage else set() for i in range(len(program.instructions))]
    for i in reversed(range(len(program.instructions))):
        if roles[i] == INIT:
            for out in program.instructions[i].writes():
                for j in readers.get(out, ()):
                    stages[i] |= stages[j]
    for name in program.state:
        wrong = [j for j in readers.get(name, ()) if roles[j] != INIT and stages[j] != {home[name]}]
        if wrong:
            raise CompileError(f"pipeline training: '{name}' lives on stage {home[name]} but instruction "
                               f"'{program.instructions[wrong[0]].node}' of stage {min(stages[wrong[0]])} reads it")
    return stages, home


def _state_homes(program: Program, roles: list[str], spec: PipelineSpec, stage: Mapping[int, int],
                 readers: Mapping[str, list[int]]) -> dict[str, int]:
    """The stage of each state value whose forward readers (direct, or through once instructions) are on one
    stage, and of each gradient sum (its parameter's); CompileError for one read by several stages."""
    def forward_stages(name: str, seen: set[str]) -> set[int]:
        found: set[int] = set()
        for j in readers.get(name, ()):
            if roles[j] == FORWARD:
                found.add(stage[j])
            elif roles[j] == ONCE:
                for out in program.instructions[j].writes():
                    if out not in seen:
                        seen.add(out)
                        found |= forward_stages(out, seen)
        return found

    home: dict[str, int] = {}
    for name in program.state:
        where = forward_stages(name, {name})
        if len(where) > 1:
            raise CompileError(f"pipeline training: '{name}' is read by stages {sorted(where)}; a parameter or "
                               "running statistic must belong to one stage (compile with fewer --devices)")
        if where:
            home[name] = where.pop()
    for grad_sum, param in spec.grad_sums.items():
        if param in home:
            home[grad_sum] = home[param]
    return home


def _place_the_rest(program: Program, roles: list[str], spec: PipelineSpec, stage: dict[int, int],
                    home: dict[str, int], readers: Mapping[str, list[int]]) -> None:
    """Give every instruction but the forward and at-load ones its stage (into `stage`), and every state value
    its stage (into `home`): an instruction reading (or assigning) state runs on its stage; another runs where
    the forward values it reads live (their last forward reader's stage), but no later than the stage of a
    gradient it reads (gradients flow from the last stage to the first)."""
    producer = _producers(program)

    def forward_home(name: str) -> int:
        where = [stage[j] for j in readers.get(name, ()) if roles[j] == FORWARD]
        return max(where) if where else stage.get(producer.get(name), 0)

    def made_by(name: str, *wanted: str) -> bool:
        return name in producer and roles[producer[name]] in wanted

    for i, instruction in enumerate(program.instructions):
        if roles[i] in (FORWARD, INIT):
            continue
        reads = reads_within(instruction)
        homed = {home[name] for name in reads if name in home}
        if isinstance(instruction, Assign) and instruction.dst in home:
            homed = {home[instruction.dst]}
        if len(homed) > 1:
            raise CompileError(f"pipeline training: instruction '{instruction.node}' reads state of stages "
                               f"{sorted(homed)}")
        if homed:
            stage[i] = homed.pop()
        else:
            later = [forward_home(n) for n in reads if n in spec.batched or made_by(n, FORWARD)]
            later += [stage[producer[n]] for n in reads if made_by(n, ONCE)]
            earlier = [stage[producer[n]] for n in reads if made_by(n, BACKWARD, UPDATE)]
            bounds = ([max(later)] if later else []) + ([min(earlier)] if earlier else [])
            stage[i] = min(bounds) if bounds else (spec.stages - 1 if roles[i] == BACKWARD else 0)
        if isinstance(instruction, Assign):
            home.setdefault(instruction.dst, stage[i])
    for name in program.state:
        home.setdefault(name, min((stage[j] for j in readers.get(name, ()) if j in stage), default=0))


def _forward_cut(program: Program, graph: Graph, roles: list[str], spec: PipelineSpec) -> dict[int, int]:
    """The stage of each forward instruction: K contiguous stages, each running a kernel, with the least
    bottleneck of estimated times (FLOPs or bytes moved, whichever takes longer)."""
    nodes = {node.name: node for node in graph.nodes}
    forward = [i for i, role in enumerate(roles) if role == FORWARD]
    costs, kernels = [], []
    for i in forward:
        instruction = program.instructions[i]
        node = nodes.get(instruction.node) if isinstance(instruction, KernelCall) else None
        costs.append(max(flops(node) / ESTIMATE_FLOPS_PER_S, bytes_moved(node) / ESTIMATE_BYTES_PER_S) if node else 0.0)
        kernels.append(isinstance(instruction, KernelCall))
    try:
        bounds = balanced_cut(costs, spec.stages, kernels)
    except ValueError as exc:
        raise CompileError(f"pipeline training: the forward pass cannot be cut into {spec.stages} stages ({exc}); "
                           "compile with fewer --devices") from None
    return {i: s for s, (start, end) in enumerate(zip(bounds, bounds[1:])) for i in forward[start:end]}


# ---- blocks ------------------------------------------------------------------------------------------------
def _renames(program: Program, roles: list[str], spec: PipelineSpec, micro_batch: int) -> dict[str, str]:
    """Micro-batch `micro_batch`'s value names: its own copy of every per-micro-batch value; the previous
    micro-batch's gradient sums and running statistics (the first's: the parameters and the state)."""
    state = set(program.state)
    names = {name: micro_name(name, micro_batch) for name in spec.batched}
    for i, instruction in enumerate(program.instructions):
        if roles[i] in (FORWARD, BACKWARD):
            names.update({name: micro_name(name, micro_batch) for name in instruction.writes() if name not in state})
    first = micro_batch == 0
    names[KEEP_INPUT] = KEEP_WEIGHTS[0 if first else 1]
    for grad_sum, param in spec.grad_sums.items():
        names[grad_sum] = param if first else micro_name(spec.sum_outputs[grad_sum], micro_batch - 1)
    for i, instruction in enumerate(program.instructions):
        if roles[i] == FORWARD and isinstance(instruction, Assign) and not first:
            names[instruction.dst] = micro_name(instruction.src, micro_batch - 1)
    return names


def _renamed(instruction: Instruction, names: Mapping[str, str]) -> Instruction:
    """The instruction reading and writing micro-batch names; an Assign still writes its state value."""
    if isinstance(instruction, Assign):
        return replace(instruction, src=names.get(instruction.src, instruction.src))
    return instruction.renamed(names)


def _blocks(program: Program, roles: list[str], stages: list[set[int]], spec: PipelineSpec,
            stage: int) -> list[tuple[str, int | None, list[Instruction]]]:
    """Stage `stage`'s blocks in order: at-load and once, then F(m)/B(m) in the schedule's order, then update."""
    mine = [i for i in range(len(program.instructions)) if stage in stages[i]]

    def pick(*wanted: str) -> list[int]:
        return [i for i in mine if roles[i] in wanted]

    blocks = [(ONCE, None, [program.instructions[i] for i in pick(INIT, ONCE)])]
    last = spec.micro_batches - 1
    maps = [_renames(program, roles, spec, m) for m in range(spec.micro_batches)]
    for phase, m in stage_order(spec.schedule, spec.stages, spec.micro_batches, stage):
        chosen = [i for i in pick(phase)
                  if not (phase == FORWARD and isinstance(program.instructions[i], Assign) and m != last)]
        blocks.append((phase, m, [_renamed(program.instructions[i], maps[m]) for i in chosen]))
    blocks.append((UPDATE, None, [_renamed(program.instructions[i], maps[last]) for i in pick(UPDATE)]))
    return blocks


# ---- transfers ---------------------------------------------------------------------------------------------
def _with_transfers(program: Program, blocks, home: Mapping[str, int], spec: PipelineSpec) -> list[list[Instruction]]:
    """Each stage's instructions with a Recv before the first read of a value made elsewhere and a Send right
    after the producer of a value read elsewhere (rank 0 sends its inputs first); rank 0 receives the losses
    last."""
    sequences = [[instruction for _, _, block in stage_blocks for instruction in block] for stage_blocks in blocks]
    made: dict[str, int] = {name: 0 for name in _rank0_inputs(program, spec)}
    for s, sequence in enumerate(sequences):
        for instruction in sequence:
            if not instruction.runs_at_load:
                made.update({name: s for name in instruction.writes() if name not in home})
    local = set(program.weights) | set(program.init_values) | set(KEEP_WEIGHTS) | set(home)
    sends: list[list[Send]] = [[] for _ in sequences]
    received: list[list[Instruction]] = []
    tag = PIPE_TAG
    for t, sequence in enumerate(sequences):
        have = {name for name, s in made.items() if s == t} | local
        steps = [(sorted(reads_within(instruction)), instruction) for instruction in sequence]
        if t == 0:
            steps.append(([micro_name(spec.loss, m) for m in range(spec.micro_batches)], None))
        out: list[Instruction] = []
        for wanted, instruction in steps:
            for name in wanted:
                if name in have:
                    continue
                if name not in made:
                    raise AssertionError(f"pipeline stage {t} reads '{name}', which no stage makes")
                source = made[name]
                out.append(Recv(f"recv/{name}/from{source}", "Recv", output=name, peer=source, tag=tag))
                sends[source].append(Send(f"send/{name}/to{t}", "Send", tensor=name, peer=t, tag=tag))
                have.add(name)
                tag += 1
            out.extend([instruction] if instruction is not None else [])
        received.append(out)
    return [_placed_sends(sequence, sends[s]) for s, sequence in enumerate(received)]


def _placed_sends(sequence: list[Instruction], sends: list[Send]) -> list[Instruction]:
    """The stage's instructions with each Send right after the instruction writing its value (inputs: first)."""
    after: dict[str, list[Send]] = {}
    for send in sends:
        after.setdefault(send.tensor, []).append(send)
    written = {name for instruction in sequence for name in instruction.writes()}
    placed = [send for name, group in after.items() if name not in written for send in group]
    for instruction in sequence:
        placed.append(instruction)
        for name in instruction.writes():
            placed.extend(after.pop(name, []))
    return placed


def _check_no_deadlock(sequences: list[list[Instruction]]) -> None:
    """Run the programs' transfers in the mind: Sends never wait, a Recv waits for its Send. AssertionError
    when every unfinished worker waits (the schedule would hang)."""
    position, sent = [0] * len(sequences), set()
    while True:
        moved = False
        for s, sequence in enumerate(sequences):
            while position[s] < len(sequence):
                instruction = sequence[position[s]]
                if isinstance(instruction, Recv) and (instruction.peer, s, instruction.tag) not in sent:
                    break
                if isinstance(instruction, Send):
                    sent.add((s, instruction.peer, instruction.tag))
                position[s] += 1
                moved = True
        if all(p == len(sequence) for p, sequence in zip(position, sequences)):
            return
        if not moved:
            stuck = {s: sequences[s][p].node for s, p in enumerate(position) if p < len(sequences[s])}
            raise AssertionError(f"pipeline programs would deadlock: {stuck}")


# ---- stage programs ----------------------------------------------------------------------------------------
def _rank0_inputs(program: Program, spec: PipelineSpec) -> list[str]:
    """Rank 0's inputs: every micro-batch's batched inputs, then the optimizer's scalars."""
    shared = [name for name in program.inputs
              if name not in spec.batched and name not in spec.grad_sums and name != KEEP_INPUT]
    return [micro_name(name, m) for m in range(spec.micro_batches) for name in spec.batched] + shared


def _origin(name: str) -> str:
    """The one-device value a pipeline value copies."""
    if name in KEEP_WEIGHTS:
        return KEEP_INPUT
    return name.rsplit("@mb", 1)[0] if "@mb" in name else name


def _stage_program(program: Program, sequence: list[Instruction], home: Mapping[str, int], spec: PipelineSpec,
                   stage: int) -> Program:
    """Stage `stage`'s program: its instructions, with the values, kernels and weights they touch."""
    root = stage == 0
    inputs = _rank0_inputs(program, spec) if root else []
    outputs = [micro_name(spec.loss, m) for m in range(spec.micro_batches)] if root else []
    used = set(inputs) | set(outputs)
    for instruction in sequence:
        used |= reads_within(instruction) | set(instruction.writes())
    keep = np.asarray(0.0, np.float32), np.asarray(1.0, np.float32)
    weights = {name: program.weights[name] for name in used if name in program.weights}
    weights.update({name: value.astype(_dtype(program)) for name, value in zip(KEEP_WEIGHTS, keep) if name in used})
    blocked = {name: program.blocked[_origin(name)] for name in used if _origin(name) in program.blocked}
    return Program(
        instructions=sequence,
        kernels={key: program.kernels[key] for key in kernel_keys(sequence)},
        values={name: program.values[_origin(name)] for name in sorted(used)},
        weights=weights, inputs=inputs, outputs=outputs, unsupported=[],
        init_values=[name for name in program.init_values if name in used], blocked=blocked,
        state=[name for name in program.state if home.get(name) == stage],
        at_load={name: program.at_load[name] for name in weights if name in program.at_load})


def _dtype(program: Program) -> np.dtype:
    return np.dtype(numpy_dtype(TensorType.parse(program.values[KEEP_INPUT]).dtype))


def step_report(spec: PipelineSpec) -> dict:
    """plan.json's "pipeline" entry: the stages, micro-batches, schedule, predicted bubble, and what the host
    splits per micro-batch."""
    return {
        "stages": spec.stages, "micro_batches": spec.micro_batches, "schedule": spec.schedule,
        "batched": list(spec.batched), "loss": spec.loss,
        "bubble_fraction_predicted": bubble_fraction(spec.stages, spec.micro_batches),
        "in_flight": [most_in_flight(stage_order(spec.schedule, spec.stages, spec.micro_batches, s))
                      for s in range(spec.stages)],
    }
