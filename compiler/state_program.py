"""Persistent state in a program: a training step's parameters, optimizer slots and running statistics.

The step graph takes each state value as a graph input and returns its next value as a graph output
(compiler/training.py). In the program the state is neither: its buffers live outside the arena and keep
their values across runs, loaded once from the artifact's state.npz (plan.json's "state"), and one
`Assign` per update copies the next value in, right after the last read of the current value: from there
the next value's buffer is free for the rest of the step, so the arena does not hold a second copy of
every parameter and optimizer slot until the step's end. Nothing that reads the state runs at load: a
parameter's packed layout is recomputed each step.

An optimizer update runs as early as it can: right after its gradient is computed and the last other read of
the parameter and its slots (its gradient dies there instead of living to the end of backward), unless it waits
on a collective (a data-parallel all-reduce overlaps the backward that follows it). An optimizer update kernel
(it computes element by element, each read before written) that runs after every other read of the parameter
and its slots writes their buffers itself, without Assigns or arena buffers for the next values.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from tessel.ir.optimizer_ops import NEXT_VALUE_OF
from tessel.ir.types import TensorType, numpy_dtype
from tessel.runtime.instructions import Assign, Instruction, KernelCall, View, reads_within

from .program import Program

STATE_FILE = "state.npz"


@dataclass(frozen=True)
class PersistentState:
    """The graph inputs that persist across runs: each one's starting value, and the graph output holding the
    next value of those that change (a state without an update keeps its value, as an eval graph's)."""

    initial: Mapping[str, np.ndarray]
    updates: Mapping[str, str]


def with_state(program: Program, state: PersistentState) -> Program:
    """The program with the state taken out of its inputs (and the updates out of its outputs) and an Assign
    per update at its end; ValueError when a state value or update is not one of the graph's."""
    missing = sorted(set(state.initial) - set(program.inputs))
    if missing:
        raise ValueError(f"state '{missing[0]}' is not an input of the graph")
    unknown = sorted(set(state.updates) - set(state.initial))
    if unknown:
        raise ValueError(f"update of '{unknown[0]}', which is not a state value")
    lost = sorted(source for source in state.updates.values() if source not in program.outputs)
    if lost:
        raise ValueError(f"update '{lost[0]}' is not an output of the graph")
    names = [name for name in program.inputs if name in state.initial]
    sources = set(state.updates.values())
    assigns = [Assign(node=f"assign/{name}", op="Assign", src=state.updates[name], dst=name)
               for name in names if state.updates.get(name, name) != name]
    instructions = placed_assigns(early_updates(program.instructions, assigns), assigns)
    instructions, replaced = updated_in_place(instructions)
    return replace(program, instructions=instructions,
                   values={name: spec for name, spec in program.values.items() if name not in replaced},
                   inputs=[name for name in program.inputs if name not in state.initial],
                   outputs=[name for name in program.outputs if name not in sources], state=names)


def _state_readers(instructions: list[Instruction], states: set[str]) -> dict[str, list[int]]:
    """For each state value, the instructions that read it or a view of it, in order."""
    owner = {name: name for name in states}
    readers: dict[str, list[int]] = {name: [] for name in states}
    for index, instruction in enumerate(instructions):
        for name in sorted({owner[n] for n in reads_within(instruction) if n in owner}):
            readers[name].append(index)
        if isinstance(instruction, View) and instruction.input in owner:
            owner[instruction.output] = owner[instruction.input]
    return readers


def early_updates(instructions: list[Instruction], assigns: list[Assign]) -> list[Instruction]:
    """The instructions with each update kernel (a kernel call whose every output is a next state value) moved up
    to right after the later of its inputs' producers and the other reads of the state values it updates; one
    whose input comes from anything but a kernel call or a view (a collective) stays where it is."""
    state_of = {assign.src: assign.dst for assign in assigns}
    readers = _state_readers(instructions, set(state_of.values()))
    producer: dict[str, int] = {}
    read_anywhere = set().union(*(reads_within(i) for i in instructions)) if instructions else set()
    follows: dict[int, list[Instruction]] = {}
    moved: set[int] = set()
    for index, instruction in enumerate(instructions):
        outputs = instruction.writes()
        if (isinstance(instruction, KernelCall) and outputs and all(n in state_of for n in outputs)
                and not read_anywhere.intersection(outputs)):
            inputs = [name for _, name in instruction.reads()]
            sources = [producer[name] for name in inputs if name in producer]
            if all(isinstance(instructions[k], (KernelCall, View)) for k in sources):
                states = {state_of[n] for n in outputs}
                after = max(sources + [k for s in states for k in readers[s] if k != index], default=-1)
                if after < index:
                    follows.setdefault(after, []).append(instruction)
                    moved.add(index)
        for name in outputs:
            producer[name] = index
    placed: list[Instruction] = list(follows.get(-1, []))
    for index, instruction in enumerate(instructions):
        if index not in moved:
            placed.append(instruction)
        placed.extend(follows.get(index, []))
    return placed


def updated_in_place(instructions: list[Instruction]) -> tuple[list[Instruction], set[str]]:
    """The instructions with each Assign folded into the optimizer update computing its source where that kernel
    may write
    the source over the state value (an in-place pair) and nothing else reads the source, nor the state after the
    kernel; and the names of the sources folded away."""
    assigns = {index: i for index, i in enumerate(instructions) if isinstance(i, Assign)}
    readers = _state_readers(instructions, {a.dst for a in assigns.values()})
    source_reads: dict[str, int] = {}
    producer: dict[str, int] = {}
    for index, instruction in enumerate(instructions):
        for name in reads_within(instruction):
            source_reads[name] = source_reads.get(name, 0) + 1
        for name in instruction.writes():
            producer[name] = index
    renames: dict[int, dict[str, str]] = {}
    folded: set[int] = set()
    for index, assign in assigns.items():
        at = producer.get(assign.src)
        kernel = instructions[at] if at is not None else None
        if (isinstance(kernel, KernelCall) and kernel.op in NEXT_VALUE_OF and not kernel.pieces
                and (assign.src, assign.dst) in kernel.inplace
                and source_reads.get(assign.src, 0) == 1 and all(k <= at for k in readers[assign.dst])):
            renames.setdefault(at, {})[assign.src] = assign.dst
            folded.add(index)
    placed: list[Instruction] = []
    for index, instruction in enumerate(instructions):
        if index in folded:
            continue
        if index in renames:
            names = renames[index]
            instruction = replace(instruction, outputs=tuple(names.get(n, n) for n in instruction.outputs),
                                  inplace=tuple(pair for pair in instruction.inplace if pair[0] not in names))
        placed.append(instruction)
    return placed, {source for names in renames.values() for source in names}


def placed_assigns(instructions: list[Instruction], assigns: list[Assign]) -> list[Instruction]:
    """The instructions with each Assign inserted right after the later of its source's producer and the last
    reader of its state value or of a view of it (at the start when neither is in the program)."""
    owner = {assign.dst: assign.dst for assign in assigns}  # a state value or a view of one -> the state value
    last: dict[str, int] = {}  # state value -> the last instruction that reads it, its views or its update
    source_of = {assign.src: assign.dst for assign in assigns}
    for index, instruction in enumerate(instructions):
        for name in reads_within(instruction):
            if name in owner:
                last[owner[name]] = index
        for name in instruction.writes():
            if name in source_of:
                last[source_of[name]] = max(last.get(source_of[name], -1), index)
        if isinstance(instruction, View) and instruction.input in owner:
            owner[instruction.output] = owner[instruction.input]
    follows: dict[int, list[Assign]] = {}
    for assign in assigns:
        follows.setdefault(last.get(assign.dst, -1), []).append(assign)
    placed: list[Instruction] = list(follows.get(-1, []))
    for index, instruction in enumerate(instructions):
        placed.append(instruction)
        placed.extend(follows.get(index, []))
    return placed


def write_state_file(root: Path, programs: Sequence[Program], state: PersistentState) -> dict[str, Any]:
    """Save the state's starting values as `root`/state.npz; plan.json's "state" entry that describes it. Workers
    holding the same state (one worker, data-parallel replicas) share its names; workers holding parts of it
    (pipeline stages) get a list each under "workers"."""
    arrays, updates = {}, {}
    for program in programs:
        for name in program.state:
            want = TensorType.parse(program.values[name])
            array = np.asarray(state.initial[name])
            if array.shape != want.shape or array.dtype != numpy_dtype(want.dtype):
                raise ValueError(f"the starting value of state '{name}' is {array.dtype}{list(array.shape)}, "
                                 f"the graph takes {want.spec()}")
            arrays[name] = np.ascontiguousarray(array)
        updates.update({i.dst: i.src for i in program.instructions if isinstance(i, Assign)})
    np.savez(root / STATE_FILE, **arrays)
    entry = {"names": list(arrays), "updates": updates, "file": STATE_FILE}
    if any(program.state != programs[0].state for program in programs):
        entry["workers"] = [list(program.state) for program in programs]
    return {"state": entry}


def state_views(program: Program) -> set[str]:
    """The state values and the views of them (a parameter reshaped): their buffers are the state's, outside
    the arena."""
    held = set(program.state)
    for instruction in program.instructions:
        if isinstance(instruction, View) and not instruction.runs_at_load and instruction.input in held:
            held.add(instruction.output)
    return held
