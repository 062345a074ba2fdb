"""The memory step of the driver: program → lifetimes → plan (passes/memory_plan.py) → reports.

Sent tensors live until the end of the run (sends complete asynchronously); an
inference program's, from its start too (their sends are waited for in the next run).
`If` steps are flattened into the timeline (then-branch steps, else-branch
steps, then the step that copies the taken branch's results): only one branch
runs, so this is conservative and always safe.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from tessel.ir.types import TensorType
from tessel.passes.memory_plan import CUDA_ALIGNMENT, DEFAULT_ALIGNMENT, MemoryPlan, StepUse, plan_memory

from tessel.runtime.held_sends import held_send_names
from tessel.runtime.instructions import Instruction, buffer_uses, sent_values

from .program import Program
from .provenance import PLANNED
from .state_program import state_views
from .sizes import format_bytes


def schedule_uses(instructions: Sequence[Instruction]) -> list[StepUse]:
    """The executed instructions as the planner sees them, `If` branches flattened (runtime/instructions.py)."""
    return [StepUse(*use) for use in buffer_uses(instructions)]


def plan_program_memory(program: Program, target_kind: str) -> MemoryPlan:
    """The arena plan of every activation of `program` (weights and state live in their own region)."""
    resident = set(program.weights) | set(program.init_values) | state_views(program)
    sizes = {name: TensorType.parse(spec).nbytes for name, spec in program.values.items() if name not in resident}
    alignment = CUDA_ALIGNMENT if target_kind == "cuda" else DEFAULT_ALIGNMENT
    uses = schedule_uses(program.instructions)
    sent = sent_values(program.instructions)
    if sent:
        # Sends complete asynchronously: a sent buffer stays untouched until the run's end.
        uses.append(StepUse("wait for sends", "Send", sent))
    # An inference program's Sends stay in flight into the next run, until it first overwrites their bytes
    # (runtime/held_sends.py): planned live from the run's start too, those bytes are written only by the
    # producer, so the stage runs the next micro-batch up to there while the send completes. A training step
    # keeps its sent buffers' bytes for reuse within the step (its many micro-batches send many values).
    held = () if program.state else [name for name in held_send_names(program.instructions)
                                      if name in sizes and name not in program.inputs]
    return plan_memory(uses, sizes, inputs=[*program.inputs, *held], outputs=program.outputs, alignment=alignment)


def weight_bytes(program: Program) -> int:
    """Bytes of the weights region: every weight (packed copies included), the values made from them at load
    and the persistent state."""
    made = sum(TensorType.parse(program.values[name]).nbytes for name in program.init_values + program.state)
    return sum(int(a.nbytes) for a in program.weights.values()) + made


def peak_description(plan: MemoryPlan, limit: int = 4) -> str:
    """Where the peak is: the step, its op, and the largest tensors live there."""
    if not plan.steps:
        return "no steps"
    step = plan.steps[plan.peak_step()]
    live = plan.live_at(plan.peak_step())
    names = ", ".join(f"'{s.values[0]}' ({format_bytes(s.nbytes)})" for s in live[:limit])
    more = f" and {len(live) - limit} more" if len(live) > limit else ""
    return f"at node '{step.name}' ({step.op}) with {names}{more} live"


def memory_report(plan: MemoryPlan, weights: int) -> dict[str, Any]:
    """The plan as a JSON-ready report with stable keys."""
    peak = plan.peak_step()
    return {
        "alignment": plan.alignment,
        "arena_bytes": plan.arena_bytes,
        "bound_bytes": plan.bound_bytes,
        "ratio": round(plan.ratio, 4),
        "no_reuse_bytes": plan.no_reuse_bytes,
        "weights_bytes": weights,
        "total_bytes": plan.arena_bytes + weights,
        "source": PLANNED,
        "strategy": plan.strategy,
        "strategies": plan.strategies,
        "inplace": [list(pair) for pair in plan.inplace],
        "peak": {
            "step": peak,
            "node": plan.steps[peak].name if plan.steps else None,
            "op": plan.steps[peak].op if plan.steps else None,
            "live": [{"values": list(s.values), "bytes": s.nbytes, "offset": s.offset} for s in plan.live_at(peak)],
        },
        "tensors": {name: {"offset": plan.offsets[name], "bytes": plan.sizes[name]} for name in sorted(plan.offsets)},
        "timeline": plan.live_bytes(),
    }


def memory_markdown(report: dict[str, Any], largest: int = 10) -> str:
    """The memory report for people: totals per region, the peak point, the largest tensors."""
    peak = report["peak"]
    lines = [
        "# Memory", "",
        "| region | bytes |", "|---|---:|",
        f"| activations (arena) | {format_bytes(report['arena_bytes'])} |",
        f"| weights | {format_bytes(report['weights_bytes'])} |",
        f"| total | {format_bytes(report['total_bytes'])} |", "",
        f"Arena {format_bytes(report['arena_bytes'])} against a lower bound of {format_bytes(report['bound_bytes'])} "
        f"(most bytes live at once): ratio {report['ratio']:.3f}, strategy {report['strategy']} "
        f"({', '.join(f'{k} {format_bytes(v)}' for k, v in report['strategies'].items())}). "
        f"Without reuse: {format_bytes(report['no_reuse_bytes'])}. "
        f"{len(report['inplace'])} outputs computed in place of a dying input. These sizes are planned, not "
        "estimated: the runtime allocates exactly this arena and these weights.", "",
        f"## Peak: step {peak['step']}, node '{peak['node']}' ({peak['op']})", "",
        "| tensors | bytes | offset |", "|---|---:|---:|",
    ]
    lines += [f"| {', '.join(s['values'])} | {format_bytes(s['bytes'])} | {s['offset']} |" for s in peak["live"]]
    lines += ["", "## Largest tensors", "", "| tensor | bytes | offset |", "|---|---:|---:|"]
    tensors = sorted(report["tensors"].items(), key=lambda item: -item[1]["bytes"])[:largest]
    lines += [f"| {name} | {format_bytes(t['bytes'])} | {t['offset']} |" for name, t in tensors]
    return "\n".join(lines) + "\n"


def write_memory_reports(directory: Path, plan: MemoryPlan, weights: int, suffix: str = "") -> dict[str, Any]:
    """Write memory<suffix>.json and .md into `directory`; returns the JSON report (its chart, of every worker at
    once, is compiler/plots/memory_timeline.py's)."""
    report = memory_report(plan, weights)
    (directory / f"memory{suffix}.json").write_text(json.dumps(report, indent=1))
    (directory / f"memory{suffix}.md").write_text(memory_markdown(report))
    return report
