"""Activation memory of a graph run in its node order, planned before there is a program.

compiler/memory.py plans the arena of a built program; a pass that must compare
schedules (passes/recompute.py) needs the same plan from the graph itself. Each
node becomes one step as the program would execute it: views (Reshape, Flatten,
...) share their input's buffer, an elementwise kernel may write over an input
that dies there (passes/inplace.py), and values made from weights alone run at
load and stay out of the arena, as do the `persistent` inputs (a training step's
parameters, optimizer slots and running statistics live in their own buffers).
Fusion and algorithm selection change the program afterwards, so these numbers
are estimates of the compiled plan, not the plan itself.
"""
from __future__ import annotations

from typing import Collection, Sequence

from tessel.ir.analysis import weight_derived
from tessel.ir.graph import Graph, Node
from tessel.ir.op_traits import op_traits

from .fuse import is_kernel
from .inplace import inplace_pairs
from .memory_plan import DEFAULT_ALIGNMENT, MemoryPlan, StepUse, plan_memory


def node_step(node: Node, reads: Sequence[str | None] | None = None, writes: Sequence[str | None] | None = None,
              name: str | None = None) -> StepUse:
    """The step running `node`, with its views and in-place candidates as the program builder gives them.

    `reads` and `writes` (one name per input and output, None where omitted) and `name` default to the node's
    own; a planned rewrite passes those of a copy of the node it has not made yet.
    """
    ins = [v.name if v is not None else None for v in node.inputs] if reads is None else list(reads)
    outs = [v.name if v is not None else None for v in node.outputs] if writes is None else list(writes)
    written = tuple(n for n in outs if n is not None)
    views: tuple[tuple[str, str], ...] = ()
    inplace: tuple[tuple[str, str], ...] = ()
    if op_traits(node.op_type).view and not is_kernel(node):
        views = ((outs[0], ins[0]),)
    else:
        inplace = tuple((outs[o], ins[k]) for o, k in inplace_pairs(node) if outs[o] is not None and ins[k] is not None)
    captured = tuple(v.name for v in node.captured_values())
    return StepUse(name or node.name, node.op_type, tuple(n for n in ins if n is not None) + captured, written,
                   views, inplace)


def activation_sizes(graph: Graph, persistent: Collection[str] = ()) -> dict[str, int]:
    """Bytes of every value the arena holds: inputs outside `persistent` and node outputs not computed from
    weights alone."""
    resident = weight_derived(graph)
    held = {id(v) for v in graph.inputs if v.name in persistent}
    for node in graph.nodes:
        # A view of a persistent input (a parameter reshaped) is that input's buffer, outside the arena too.
        source = node.inputs[0] if node.inputs else None
        if source is not None and id(source) in held and op_traits(node.op_type).view and not is_kernel(node):
            held.add(id(node.outputs[0]))
    sizes = {v.name: v.type.nbytes for v in graph.inputs if id(v) not in held}
    for node in graph.nodes:
        for out in node.outputs:
            if out is not None and id(out) not in resident and id(out) not in held:
                sizes[out.name] = out.type.nbytes
    return sizes


def plan_graph_memory(graph: Graph, persistent: Collection[str] = (), *,
                      alignment: int = DEFAULT_ALIGNMENT) -> MemoryPlan:
    """The arena plan (passes/memory_plan.py) of `graph`'s activations when its nodes run in graph order."""
    steps = [node_step(node) for node in graph.nodes]
    return plan_schedule(graph, steps, activation_sizes(graph, persistent), alignment=alignment)


def plan_schedule(graph: Graph, steps: Sequence[StepUse], sizes: dict[str, int], *,
                  alignment: int = DEFAULT_ALIGNMENT) -> MemoryPlan:
    """The arena plan of `steps` (a schedule of `graph`'s nodes, possibly rewritten) over the values in `sizes`."""
    return plan_memory(steps, sizes, inputs=[v.name for v in graph.inputs], outputs=[v.name for v in graph.outputs],
                       alignment=alignment)
