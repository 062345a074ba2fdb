"""Persistent state in a program: a training step's parameters, optimizer slots and running statistics.

The step graph takes each state value as a graph input and returns its next value as a graph output
(compiler/training.py). In the program the state is neither: its buffers live outside the arena and keep
their values across runs, loaded once from the artifact's state.npz (plan.json's "state"), and one
`Assign` per update copies the next value in, right after the last read of the current value: from there
the next value's buffer is free for the rest of the step, so the arena does not hold a second copy of
every parameter and optimizer slot until the step's end. Nothing that reads the state runs at load: a
parameter's packed layout is recomputed each step.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from tessel.ir.types import TensorType, numpy_dtype
from tessel.runtime.instructions import Assign, Instruction, View, reads_within

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
    return replace(program, instructions=placed_assigns(program.instructions, assigns),
                   inputs=[name for name in program.inputs if name not in state.initial],
                   outputs=[name for name in program.outputs if name not in sources], state=names)


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
