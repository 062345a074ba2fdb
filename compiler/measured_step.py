"""The measured timeline of one training step: the spans its workers recorded (runtime/step_profile.py) as the
bars of a step chart (compiler/plots/step_gantt.py), beside the predicted one (compiler/step_timeline.py).

Each run span (one native-host segment, or one instruction the Python host runs) becomes a bar of the phase most
of its instructions have (a data-parallel replica's from its data flow, `replica_phases`; a pipeline stage's from
the blocks plan.json records, `stage_phases`): the segments are cut at the collectives and transfers, which sit
at the borders of forward, backward and update, so a segment is mostly of one phase. A wait on an all-reduce draws
the reduction as a communication bar from its start to the wait's end, and the wait itself grey in the kernels'
row; a wait on a receive is grey only. A worker's busy time is its run spans less the waits inside them.
"""
from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

from tessel.runtime.instructions import AllReduce, program_from_json
from tessel.runtime.step_profile import RUN, WAIT as WAIT_SPAN

from .step_timeline import ALLREDUCE, WAIT, Bar, Timeline, forward_loss, replica_phases, stage_phases


def run_phases(plan: Mapping) -> list[list[str]]:
    """Each worker's run instructions' phases (those run at load left out, as in the profile's indices)."""
    programs = [program_from_json(w["instructions"]) for w in plan["workers"]]
    if "pipeline" in plan:
        phases = [stage_phases(runs) for runs in plan["pipeline"]["phases"]]
    else:
        loss = forward_loss(plan)
        phases = [replica_phases(program, loss) for program in programs]
    return [[phase for instruction, phase in zip(program, worker) if not instruction.runs_at_load]
            for program, worker in zip(programs, phases)]


def measured_timeline(plan: Mapping, profile: Mapping[str, Sequence[Sequence[int]]]) -> Timeline:
    """The step `profile` recorded (rank -> spans) as a Timeline, seconds from the first span's start."""
    phases = run_phases(plan)
    programs = [[i for i in program_from_json(w["instructions"]) if not i.runs_at_load] for w in plan["workers"]]
    spans = {int(rank): [tuple(row) for row in rows] for rank, rows in profile.items()}
    starts = [row[3] for rows in spans.values() for row in rows]
    if not starts:
        return Timeline([], 0.0, [0.0] * len(plan["workers"]))
    origin = min(starts)

    def seconds(ns: int) -> float:
        return (ns - origin) / 1e9

    bars, busy = [], []
    for rank in range(len(plan["workers"])):
        rows = spans.get(rank, [])
        runs = [row for row in rows if row[0] == RUN]
        waits = [row for row in rows if row[0] == WAIT_SPAN]
        started_at = {row[1]: row[3] for row in runs}
        for _, first, last, start, end in runs:
            counted = Counter(phases[rank][first:last + 1])
            phase = counted.most_common(1)[0][0] if counted else ALLREDUCE
            bars.append(Bar(rank, phase, seconds(start), seconds(end), _label(programs[rank], first, last)))
        for _, index, _, start, end in waits:
            bars.append(Bar(rank, WAIT, seconds(start), seconds(end), _label(programs[rank], index, index)))
            if 0 <= index < len(programs[rank]) and isinstance(programs[rank][index], AllReduce):
                bars.append(Bar(rank, ALLREDUCE, seconds(started_at.get(index, start)), seconds(end),
                                programs[rank][index].node, comm=True))
        inside = sum(_overlap(wait, run) for wait in waits for run in runs)
        busy.append(sum(run[4] - run[3] for run in runs) / 1e9 - inside / 1e9)
    step_s = (max(row[4] for rows in spans.values() for row in rows) - origin) / 1e9
    return Timeline(bars, step_s, busy)


def _overlap(a: Sequence[int], b: Sequence[int]) -> int:
    """Nanoseconds spans a and b share."""
    return max(0, min(a[4], b[4]) - max(a[3], b[3]))


def _label(program: Sequence, first: int, last: int) -> str:
    """The node (or first..last nodes) of run instructions first..last; "end of the run" past the program."""
    if not 0 <= first < len(program):
        return "end of the run"
    return program[first].node if first == last else f"{program[first].node}..{program[last].node}"
