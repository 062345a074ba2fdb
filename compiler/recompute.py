"""The compile stage's recomputation hook: fit a training step into `device_memory` by recomputing activations.

The device holds the weights and the training state (parameters, optimizer slots,
running statistics: compiler/state_program.py keeps them outside the arena) and the
activation arena; what the first two leave is the arena's budget. When the step's
planned activations exceed it, passes/recompute.py drops stashed activations and
recomputes them before their backward use. The pass must run after common-
subexpression elimination, which would merge every copy back into its original,
and before fusion, which then fuses the copies into the backward kernels:
`place_recompute` puts it there in a pipeline. Whatever the budget, `cheap_recompute_pass` recomputes the
activations that cheap ops make again from values the backward pass keeps anyway (passes/recompute.py's
plan_cheap_recompute), in the same place.
"""
from __future__ import annotations

from typing import Any, Collection, Sequence

from tessel.ir.analysis import weight_derived
from tessel.ir.graph import Graph
from tessel.passes.base import Pass, PassResult
from tessel.passes.memory_plan import DEFAULT_ALIGNMENT
from tessel.passes.recompute import RecomputeError, apply_recompute, plan_cheap_recompute, plan_recompute

from .sizes import format_bytes

RECOMPUTE = "recompute"
CHEAP_RECOMPUTE = "recompute_cheap"
# Passes a recomputation must follow (CSE would undo it; DCE runs after CSE) and the one it must precede.
_AFTER = ("cse", "dce")
_BEFORE = "fuse"


def resident_bytes(graph: Graph, persistent: Collection[str] = ()) -> int:
    """Bytes the device holds besides the activation arena: the weights (constants and what is made from them
    alone at load) and the `persistent` inputs."""
    made = weight_derived(graph)
    weights = sum(v.type.nbytes for v in graph.constants)
    derived = sum(out.type.nbytes for node in graph.nodes for out in node.outputs
                  if out is not None and id(out) in made)
    state = sum(v.type.nbytes for v in graph.inputs if v.name in persistent)
    return weights + derived + state


def recompute_for_budget(graph: Graph, device_memory: int | None, *, persistent: Collection[str] = (),
                         loss: str | None = None, alignment: int = DEFAULT_ALIGNMENT) -> tuple[Graph, dict[str, Any]]:
    """Recompute activations of the training step `graph` (edited in place) so that it fits `device_memory` bytes.

    `persistent` names the state inputs (StepGraph.state), `loss` the loss output (default: the first output,
    StepGraph's order), `alignment` the arena's (passes/memory_plan.py: CUDA_ALIGNMENT on a GPU). Returns the
    graph and a JSON-ready report: the budget left for activations, the planned arena before and after, its
    bound, the smallest arena recomputation reaches and the extra FLOPs (every prediction marked "estimated"),
    and a one-line summary. No `device_memory`, or a step that already
    fits, leaves the graph unchanged. Raises RecomputeError when even recomputation cannot fit the step.
    """
    if device_memory is None:
        return graph, {"changed": False, "summary": "recompute: no device_memory given"}
    resident = resident_bytes(graph, persistent)
    budget = device_memory - resident
    if budget <= 0:
        raise RecomputeError(f"the weights and training state take {format_bytes(resident)}, more than the device's "
                             f"{format_bytes(device_memory)}: no room is left for activations",
                             budget_bytes=budget, floor_bytes=None)
    try:
        plan = plan_recompute(graph, budget, persistent=persistent, loss=loss, alignment=alignment)
    except RecomputeError as error:
        raise RecomputeError(f"{format_bytes(device_memory)} of device memory less {format_bytes(resident)} of "
                             f"weights and training state leaves {format_bytes(budget)} for activations, and {error}",
                             budget_bytes=budget, floor_bytes=error.floor_bytes) from None
    result = apply_recompute(graph, plan, persistent=persistent, loss=loss)
    report = {"changed": result.changed, "device_memory_bytes": device_memory, "resident_bytes": resident,
              **plan.to_json(), "summary": plan.summary()}
    return result.graph, report


def recompute_pass(device_memory: int | None, *, persistent: Collection[str] = (), loss: str | None = None,
                   alignment: int = DEFAULT_ALIGNMENT) -> Pass:
    """recompute_for_budget as a pipeline pass; its stats hold the report's numbers (bytes and FLOPs, estimated)."""

    def run(graph: Graph) -> PassResult:
        graph, report = recompute_for_budget(graph, device_memory, persistent=persistent, loss=loss,
                                             alignment=alignment)
        if "peak" not in report:
            return PassResult(graph, False, {})
        peak = report["peak"]
        return PassResult(graph, report["changed"], {
            "values_recomputed": len(report["dropped"]), "nodes_copied": len(report["copies"]),
            "peak_before_bytes": peak["before_bytes"], "peak_after_bytes": peak["after_bytes"],
            "extra_flops": report["flops"]["extra"]})

    return Pass(RECOMPUTE, run)


def cheap_recompute_pass(*, persistent: Collection[str] = (), loss: str | None = None,
                         alignment: int = DEFAULT_ALIGNMENT) -> Pass:
    """The training step's cheap recomputation (passes/recompute.py's plan_cheap_recompute) as a pipeline pass; its
    stats hold what it drops and the most bytes live at once before and after (estimated)."""

    def run(graph: Graph) -> PassResult:
        plan = plan_cheap_recompute(graph, persistent=persistent, loss=loss, alignment=alignment)
        result = apply_recompute(graph, plan, persistent=persistent, loss=loss)
        return PassResult(result.graph, result.changed, {
            "values_recomputed": len(plan.dropped), "nodes_copied": len(plan.copies),
            "bound_before_bytes": plan.peak_before, "bound_after_bytes": plan.peak_after,
            "extra_flops": plan.extra_flops})

    return Pass(CHEAP_RECOMPUTE, run)


def place_recompute(passes: Sequence[Pass], recompute: Pass) -> tuple[Pass, ...]:
    """`passes` with `recompute` after CSE and DCE (CSE would merge each copy back into its original) and before
    fusion (which fuses the copies into the backward kernels)."""
    names = [p.name for p in passes]
    after = max((i for i, name in enumerate(names) if name in _AFTER), default=-1)
    before = names.index(_BEFORE) if _BEFORE in names else len(names)
    if after >= before:
        raise ValueError(f"recompute must run after {' and '.join(_AFTER)} and before {_BEFORE}; "
                         f"the pipeline runs {', '.join(names)}")
    return (*passes[:after + 1], recompute, *passes[after + 1:])
