"""Recomputation of activations in a training step graph, when its memory budget is short.

A step graph runs the forward pass, the loss, then the backward pass, which reads
forward values ("stashed" activations) long after they were made: at the start of
the backward pass they are all live at once, usually the step's memory peak.
`plan_recompute` chooses stashed values to drop — each backward reader then reads a
copy made again just before its first backward use, from the values that are kept
(checkpoints) — and `apply_recompute` makes those copies.

Checkpoints are chosen as Chen et al. 2016 ("Training deep nets with sublinear
memory cost") do: walking the forward pass, a value becomes a checkpoint once the
stashed bytes since the last one pass a threshold, everything between two
checkpoints is recomputed (each forward node copied once, when the backward pass
first needs that segment), and thresholds are swept; a second family keeps every
output of a costly op (conv, matmul) and recomputes only the cheap ones between
them (normalisation, activation). Each plan's activation peak is the arena that
passes/memory_plan.py places for the rewritten schedule (passes/graph_memory.py);
among the plans within the budget the one with the fewest extra FLOPs (ir/costs.py)
wins. Both numbers are estimates: fusion and algorithm selection change the program.

`plan_cheap_recompute` needs no budget: it drops only stashed values that cheap ops (elementwise, broadcast,
layout, normalisation: no conv or matmul) make again from values the backward pass keeps anyway, and only
where that lowers the most bytes live at once — a ReLU's output made again from the x (one replica) or the
centred input x - mean (synchronised BatchNorm) that the BatchNormalization before it keeps for its backward, a
LayerNormalization's output from its input.

Copies compute exactly what their originals do, so common-subexpression elimination
would merge them back (passes/cse.py numbers a node by op, attributes and inputs):
run recompute after CSE, as compiler/recompute.py's pipeline places it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable

from tessel.ir.analysis import total_flops, weight_derived
from tessel.ir.costs import flops
from tessel.ir.errors import TesselError
from tessel.ir.graph import Graph, Node, Value
from tessel.ir.op_traits import Pattern, op_traits
from tessel.ir.optimizer_ops import NEXT_VALUE_OF
from tessel.ir.verify import verify

from .base import PassResult, is_pure
from .fuse import is_kernel
from .graph_memory import activation_sizes, node_step, plan_graph_memory, plan_schedule
from .memory_plan import DEFAULT_ALIGNMENT, MemoryPlan, StepUse, bound_bytes, plan_lifetimes

ESTIMATED = "estimated"
# Thresholds swept per family of plans (Chen et al. sweep the segment budget the same way).
THRESHOLDS = 16
# Suffix of a copy's values and node.
COPY_SUFFIX = "/recompute"


class RecomputeError(TesselError):
    """The training step does not fit its memory budget, even recomputing activations.

    `budget_bytes` is the activation budget, `floor_bytes` the smallest arena recomputation reaches (None when
    there is no room for activations at all).
    """

    def __init__(self, message: str, *, budget_bytes: int, floor_bytes: int | None):
        self.budget_bytes, self.floor_bytes = budget_bytes, floor_bytes
        super().__init__(message)


def _over_budget(budget_bytes: int, floor_bytes: int, peak_bytes: int) -> RecomputeError:
    return RecomputeError(
        f"the training step's activations need {_mib(peak_bytes)} and recomputing activations brings them down "
        f"to {_mib(floor_bytes)} at best (estimated), over the budget of {_mib(budget_bytes)}: give the device "
        "more memory or use a smaller batch", budget_bytes=budget_bytes, floor_bytes=floor_bytes)


@dataclass(frozen=True)
class RecomputePlan:
    """Which stashed values to recompute, and what that is predicted to cost and save (estimated)."""

    dropped: tuple[str, ...]      # forward values the backward pass reads from a copy instead
    held: tuple[str, ...]         # forward values only copies read late (kept rather than recomputed)
    copies: tuple[str, ...]       # forward nodes copied, in the order the copies run
    budget_bytes: int
    peak_before: int              # activation arena without recomputation
    peak_after: int               # activation arena with it
    bound_after: int              # most bytes live at once with it: no placement of the arena does better
    floor_bytes: int              # the smallest arena any plan the planner tried reaches
    extra_flops: int              # FLOPs of the copies
    step_flops: int               # FLOPs of the step without recomputation
    strategy: str                 # how the checkpoints were chosen

    def to_json(self) -> dict:
        """The plan as a JSON-ready dict; every predicted number carries its source ("estimated")."""
        return {
            "budget_bytes": self.budget_bytes,
            "peak": {"before_bytes": self.peak_before, "after_bytes": self.peak_after,
                     "bound_after_bytes": self.bound_after, "floor_bytes": self.floor_bytes, "source": ESTIMATED},
            "flops": {"extra": self.extra_flops, "step": self.step_flops, "source": ESTIMATED},
            "strategy": self.strategy,
            "dropped": list(self.dropped),
            "held": list(self.held),
            "copies": list(self.copies),
        }

    def summary(self) -> str:
        """One line for people: what is recomputed, the peak before and after, the extra work."""
        if not self.dropped:
            return (f"recompute: nothing to recompute, activations {_mib(self.peak_before)} (estimated) within "
                    f"the budget of {_mib(self.budget_bytes)}")
        share = 100 * self.extra_flops / self.step_flops if self.step_flops else 0.0
        return (f"recompute: {len(self.dropped)} activations recomputed by {len(self.copies)} copied nodes "
                f"({self.strategy}): activation peak {_mib(self.peak_before)} -> {_mib(self.peak_after)} "
                f"(bound {_mib(self.bound_after)}; smallest reachable {_mib(self.floor_bytes)}) within the budget "
                f"of {_mib(self.budget_bytes)}, +{self.extra_flops / 1e6:.1f} MFLOP ({share:.1f}% of the step); "
                "all estimated")


def plan_recompute(graph: Graph, budget_bytes: int, *, persistent: Collection[str] = (), loss: str | None = None,
                   alignment: int = DEFAULT_ALIGNMENT) -> RecomputePlan:
    """The cheapest recomputation (in extra FLOPs) that brings the activation arena of `graph` within `budget_bytes`.

    `graph` is a training step: forward nodes up to the one producing `loss` (default: the first graph output,
    as compiler/training.py orders them), backward and update nodes after it. `persistent` names inputs whose
    buffers live outside the arena (parameters, optimizer slots, running statistics). A graph already within
    the budget gets a plan that drops nothing. Raises RecomputeError, naming the smallest arena reached, when no
    plan fits.
    """
    step = _StepShape(graph, persistent, loss)
    baseline = plan_graph_memory(graph, persistent, alignment=alignment)
    step_flops = total_flops(graph)
    if baseline.arena_bytes <= budget_bytes:
        return RecomputePlan((), (), (), budget_bytes, baseline.arena_bytes, baseline.arena_bytes,
                             baseline.bound_bytes, baseline.arena_bytes, 0, step_flops, "none")
    candidates = _candidates(step, alignment)
    if not candidates:
        raise _over_budget(budget_bytes, baseline.arena_bytes, baseline.arena_bytes)
    placed: dict[int, MemoryPlan] = {}

    def arena(candidate: _Candidate) -> MemoryPlan:
        # Placing is the costly part: only for plans whose bound already fits, cheapest first.
        if id(candidate) not in placed:
            placed[id(candidate)] = plan_schedule(graph, candidate.steps, candidate.sizes, alignment=alignment)
        return placed[id(candidate)]

    chosen = next((c for c in sorted(candidates, key=lambda c: (c.extra_flops, c.bound))
                   if c.bound <= budget_bytes and arena(c).arena_bytes <= budget_bytes), None)
    arena(min(candidates, key=lambda c: c.bound))
    floor = min([baseline.arena_bytes] + [memory.arena_bytes for memory in placed.values()])
    if chosen is None:
        raise _over_budget(budget_bytes, floor, baseline.arena_bytes)
    memory = arena(chosen)
    return RecomputePlan(tuple(v.name for v in chosen.dropped), chosen.held_names(),
                         tuple(node.name for _, node in chosen.copies), budget_bytes, baseline.arena_bytes,
                         memory.arena_bytes, memory.bound_bytes, floor, chosen.extra_flops, step_flops,
                         chosen.strategy)


def apply_recompute(graph: Graph, plan: RecomputePlan, *, persistent: Collection[str] = (),
                    loss: str | None = None) -> PassResult:
    """Copy the forward nodes `plan` recomputes just before their first backward reader and make the backward
    readers of every dropped value read its copy. `graph` is the one `plan` was made for, unchanged since;
    `persistent` and `loss` as given to plan_recompute."""
    if not plan.dropped:
        return PassResult(graph, False, {"values_recomputed": 0, "nodes_copied": 0})
    step = _StepShape(graph, persistent, loss)
    dropped = [_stashed_value(step, name) for name in plan.dropped]
    key = frozenset(id(v) for v in dropped)
    held = frozenset(id(_forward_value(step, name)) for name in plan.held)
    copy_of: dict[int, Value] = {}
    for before, node in _copy_order(step, key, held):
        inputs = [copy_of.get(id(v), v) if v is not None else None for v in node.inputs]
        types = [v.type if v is not None else None for v in node.outputs]
        copy = graph.add_node(node.op_type, inputs, node.attrs, types, name=f"{node.name}{COPY_SUFFIX}",
                              domain=node.domain, before=before,
                              output_names=[f"{v.name}{COPY_SUFFIX}" if v is not None else "" for v in node.outputs])
        copy_of.update((id(old), new) for old, new in zip(node.outputs, copy.outputs) if old is not None)
    for node in step.backward_nodes():
        for index, value in enumerate(node.inputs):
            if value is not None and id(value) in key:
                graph.set_input(node, index, copy_of[id(value)])
    verify(graph)
    return PassResult(graph, True, {"values_recomputed": len(dropped), "nodes_copied": len(plan.copies)})


# At most this many forward nodes copied to make one dropped value again (a longer chain is not cheap).
MAX_CHEAP_COPIES = 8
# Smaller stashed values are not worth the kernels that make them again.
MIN_CHEAP_BYTES = 4096


def plan_cheap_recompute(graph: Graph, *, persistent: Collection[str] = (), loss: str | None = None,
                         alignment: int = DEFAULT_ALIGNMENT) -> RecomputePlan:
    """Stashed values of the training step `graph` worth recomputing whatever the budget: each (of at least
    MIN_CHEAP_BYTES) is made again by at most MAX_CHEAP_COPIES cheap forward nodes (`_cheap`) from kept values,
    and dropping it lowers the most bytes live at once in the step, with its updates run early as its program
    runs them. Tried largest first; `persistent` and `loss` as for plan_recompute. The plan's peaks (and budget)
    are those bounds, not placed arenas."""
    step = _StepShape(graph, persistent, loss)
    inputs, outputs = [v.name for v in graph.inputs], [v.name for v in graph.outputs]

    def bound_of(dropped: frozenset[int], copies: list[tuple[Node, Node]]) -> int:
        steps, sizes = _rewritten_schedule(step, dropped, copies)
        # The updates write the state in place (compiler/state_program.py): their results take no arena bytes; nor
        # do the links of an elementwise chain of copies, which fusion makes one kernel.
        free = {name for use in steps if use.op in NEXT_VALUE_OF for name in use.writes} | _fused_links(steps)
        sizes = {name: size for name, size in sizes.items() if name not in free}
        storages, _ = plan_lifetimes(_early_updates(steps, step.persistent), sizes, inputs=inputs, outputs=outputs,
                                     alignment=alignment)
        return bound_bytes(storages)

    dropped: frozenset[int] = frozenset()
    copies: list[tuple[Node, Node]] = []
    before = best = bound_of(dropped, copies)
    for value in sorted(step.candidates, key=lambda v: -step.sizes[v.name]):
        if step.sizes[value.name] < MIN_CHEAP_BYTES or _is_view(value) or not _cheap(value.producer):
            continue
        trial = dropped | {id(value)}
        trial_copies = _copy_order(step, trial, frozenset())
        if len(trial_copies) - len(copies) > MAX_CHEAP_COPIES or not all(_cheap(node) for _, node in trial_copies):
            continue
        bound = bound_of(trial, trial_copies)
        if bound < best:
            dropped, copies, best = trial, trial_copies, bound
    names = tuple(v.name for v in step.candidates if id(v) in dropped)
    return RecomputePlan(names, (), tuple(node.name for _, node in copies), best, before, best, best, best,
                         sum(flops(node) for _, node in copies), total_flops(graph), "cheap copies")


def _fused_links(steps: list[StepUse]) -> set[str]:
    """Values a copy writes that only one other copy reads, both elementwise: fusion keeps them in registers."""
    readers: dict[str, list[StepUse]] = {}
    for use in steps:
        for name in use.reads:
            readers.setdefault(name, []).append(use)

    def elementwise_copy(use: StepUse) -> bool:
        return use.name.endswith(COPY_SUFFIX) and op_traits(use.op).pattern <= Pattern.BROADCAST

    return {name for use in steps if elementwise_copy(use) for name in use.writes
            if len(readers.get(name, ())) == 1 and elementwise_copy(readers[name][0])}


def _early_updates(steps: list[StepUse], persistent: Collection[str]) -> list[StepUse]:
    """`steps` with each optimizer update moved up to right after the producers of its inputs and the other
    reads of the state it updates, where the step's program runs it (compiler/state_program.early_updates):
    planned at the graph's end, every gradient would look live until then."""
    producer: dict[str, int] = {}
    readers: dict[str, list[int]] = {}
    for index, use in enumerate(steps):
        for name in use.reads:
            readers.setdefault(name, []).append(index)
        for name in use.writes:
            producer[name] = index
    follows: dict[int, list[StepUse]] = {}
    moved: set[int] = set()
    for index, use in enumerate(steps):
        if use.op not in NEXT_VALUE_OF:
            continue
        state = [name for name in use.reads if name in persistent]
        after = max([producer[name] for name in use.reads if name in producer and producer[name] < index]
                    + [k for name in state for k in readers[name] if k != index], default=-1)
        if after < index:
            follows.setdefault(after, []).append(use)
            moved.add(index)
    placed = list(follows.get(-1, []))
    for index, use in enumerate(steps):
        if index not in moved:
            placed.append(use)
        placed.extend(follows.get(index, []))
    return placed


def _cheap(node: Node) -> bool:
    """A forward node worth running twice rather than keeping its output: pure, no more than a pass over its
    operands (elementwise, broadcast, layout, a reduction or normalisation; not a conv or matmul), and reading
    no operand larger than what it makes.

    The last condition keeps what a copy costs per byte it saves near one pass over those bytes. A downsampling
    pool fails it: ResNet-18's stem MaxPool (3x3, stride 2) reads 4x the 26 MB it would save, with 9 compares
    per output, and made again it cost 87 ms of a 2.7 s step on one core (measured) where a ReLU copy over the
    same bytes costs a few ms."""
    if not (is_pure(node) and not node.domain and op_traits(node.op_type).pattern <= Pattern.REDUCTION):
        return False
    made = max((v.type.nbytes for v in node.outputs if v is not None), default=0)
    return all(v is None or v.type.nbytes <= made for v in node.inputs)


class _StepShape:
    """Where a step graph's forward pass ends, and which forward values the backward pass reads."""

    def __init__(self, graph: Graph, persistent: Collection[str], loss: str | None):
        self.graph = graph
        self.persistent = set(persistent)
        self.position = {id(node): i for i, node in enumerate(graph.nodes)}
        loss_value = graph.lookup(loss) if loss is not None else (graph.outputs[0] if graph.outputs else None)
        if loss is not None and loss_value is None:
            raise ValueError(f"recompute: the graph has no value '{loss}' (the loss)")
        producer = loss_value.producer if loss_value is not None else None
        self.split = self.position[id(producer)] if producer is not None else -1
        self.resident = weight_derived(graph)
        self.outputs = {id(v) for v in graph.outputs}
        self.stashed = [v for node in graph.nodes[:self.split + 1] for v in node.outputs
                        if v is not None and self._read_late(v)]
        self.stashed_ids = {id(v) for v in self.stashed}
        self.sizes = activation_sizes(graph, self.persistent)
        self.candidates = [v for v in self.stashed if self.recomputable(v)]

    def _read_late(self, value: Value) -> bool:
        return any(self.position[id(node)] > self.split for node, _ in value.uses if node.graph is self.graph)

    def recomputable(self, value: Value) -> bool:
        """True when a copy of the value's producer can make the value again, and holding it costs arena bytes."""
        node = value.producer
        return (node is not None and node.graph is self.graph and self.position[id(node)] <= self.split
                and is_pure(node) and id(value) not in self.outputs and value.name in self.sizes
                and id(value) not in self.resident)

    def backward_nodes(self) -> list[Node]:
        """The nodes after the loss (in the current graph order)."""
        return [node for node in self.graph.nodes if self.position.get(id(node), -1) > self.split]

    def forward_values(self) -> list[Value]:
        """Outputs of the nodes up to the loss, in graph order."""
        return [v for node in self.graph.nodes[:self.split + 1] for v in node.outputs if v is not None]

    def candidate_plans(self) -> Iterable[tuple[str, list[Value], frozenset[int]]]:
        """(strategy, values to drop, values held for the copies) for every threshold of both families."""
        bytes_of = {id(v): 0 if _is_view(v) else self.sizes[v.name] for v in self.candidates}
        total = sum(bytes_of.values())
        smallest = min((b for b in bytes_of.values() if b), default=0)
        if not total:
            return
        ratio = (total / smallest) ** (1 / (THRESHOLDS - 1))
        thresholds = sorted({int(smallest * ratio ** k) for k in range(THRESHOLDS)} | {total})
        costly = frozenset(id(v) for v in self.forward_values() if _costly(v.producer))
        for keep_costly in (False, True):
            family = "segments" if not keep_costly else "segments keeping conv/matmul outputs"
            held = costly if keep_costly else frozenset()
            for threshold in thresholds:
                kept = self._checkpoints(bytes_of, threshold, keep_costly)
                yield f"{family}, threshold {threshold} B", [v for v in self.candidates if id(v) not in kept], held

    def _checkpoints(self, bytes_of: dict[int, int], threshold: int, keep_costly: bool) -> set[int]:
        """Chen et al.'s checkpoints: a value is kept once the stashed bytes since the last kept one exceed
        `threshold`; with `keep_costly`, outputs of convs and matmuls are always kept."""
        kept: set[int] = set()
        since = 0
        for value in self.candidates:
            if keep_costly and _costly(value.producer):
                kept.add(id(value))
                since = 0
                continue
            since += bytes_of[id(value)]
            if since > threshold:
                kept.add(id(value))
                since = 0
        return kept


def _is_view(value: Value) -> bool:
    node = value.producer
    return node is not None and op_traits(node.op_type).view and not is_kernel(node)


def _costly(node: Node) -> bool:
    """A conv, matmul or opaque op: its output is worth keeping rather than computing twice."""
    traits = op_traits(node.op_type)
    return traits.pattern in (Pattern.OUT_EWISE_FUSABLE, Pattern.OPAQUE) or bool(node.domain)


def _stashed_value(step: _StepShape, name: str) -> Value:
    value = step.graph.lookup(name)
    if value is None or not any(v is value for v in step.candidates):
        raise ValueError(f"recompute: '{name}' is not a recomputable forward value the backward pass reads")
    return value


def _forward_value(step: _StepShape, name: str) -> Value:
    value = step.graph.lookup(name)
    if value is None or value.producer is None or step.position.get(id(value.producer), step.split + 1) > step.split:
        raise ValueError(f"recompute: '{name}' is not a value of the forward pass")
    return value


def _copy_order(step: _StepShape, dropped: frozenset[int], held: frozenset[int]) -> list[tuple[Node, Node]]:
    """(backward node, forward node to copy just before it), in the order the copies run.

    A backward node reading a dropped value gets a copy of its producer, made before the first such reader;
    a copy reads the kept values (checkpoints, `held` values, graph inputs and outputs, what cannot be
    recomputed) and copies of the rest, made before it. Every forward node is copied at most once.
    """
    copied: set[int] = set()
    order: list[tuple[Node, Node]] = []

    def needs_copy(value: Value | None) -> bool:
        if value is None or not step.recomputable(value) or id(value) in held:
            return False
        return id(value) in dropped or id(value) not in step.stashed_ids

    for reader in step.backward_nodes():
        for value in reader.inputs:
            if value is None or id(value) not in dropped or id(value.producer) in copied:
                continue
            # Depth first over the producers still to copy, each after the copies it reads.
            stack: list[tuple[Node, bool]] = [(value.producer, False)]
            while stack:
                node, ready = stack.pop()
                if id(node) in copied:
                    continue
                if ready:
                    copied.add(id(node))
                    order.append((reader, node))
                    continue
                stack.append((node, True))
                stack.extend((v.producer, False) for v in node.inputs
                             if needs_copy(v) and id(v.producer) not in copied)
    return order


@dataclass
class _Candidate:
    """One plan the planner weighs: what it drops and holds, the copies, the rewritten schedule and its bound."""

    strategy: str
    dropped: list[Value]
    held: frozenset[int]
    copies: list[tuple[Node, Node]]
    steps: list[StepUse]
    sizes: dict[str, int]
    extra_flops: int
    bound: int

    def held_names(self) -> tuple[str, ...]:
        """The held values some copy reads."""
        return tuple(dict.fromkeys(v.name for _, node in self.copies for v in node.inputs
                                   if v is not None and id(v) in self.held))


def _candidates(step: _StepShape, alignment: int) -> list[_Candidate]:
    """Every distinct plan of both families, with the bound of its rewritten schedule."""
    result = []
    seen: set[tuple[frozenset[int], frozenset[int]]] = set()
    for strategy, dropped, held in step.candidate_plans():
        key = frozenset(id(v) for v in dropped)
        if not key or (key, held) in seen:
            continue
        seen.add((key, held))
        copies = _copy_order(step, key, held)
        steps, sizes = _rewritten_schedule(step, key, copies)
        storages, _ = plan_lifetimes(steps, sizes, inputs=[v.name for v in step.graph.inputs],
                                     outputs=[v.name for v in step.graph.outputs], alignment=alignment)
        result.append(_Candidate(strategy, dropped, held, copies, steps, sizes,
                                 sum(flops(node) for _, node in copies), bound_bytes(storages)))
    return result


def _rewritten_schedule(step: _StepShape, dropped: frozenset[int],
                        copies: list[tuple[Node, Node]]) -> tuple[list[StepUse], dict[str, int]]:
    """The steps and arena sizes of the step graph as apply_recompute would rewrite it, without rewriting it."""
    copy_name: dict[int, str] = {}
    before: dict[int, list[Node]] = {}
    for reader, node in copies:
        before.setdefault(id(reader), []).append(node)
    sizes = dict(step.sizes)
    steps = []
    for node in step.graph.nodes:
        for forward in before.get(id(node), ()):
            reads = [copy_name.get(id(v), v.name) if v is not None else None for v in forward.inputs]
            writes = []
            for out in forward.outputs:
                if out is None:
                    writes.append(None)
                    continue
                copy_name[id(out)] = name = f"{out.name}{COPY_SUFFIX}"
                sizes[name] = out.type.nbytes
                writes.append(name)
            steps.append(node_step(forward, reads, writes, name=f"{forward.name}{COPY_SUFFIX}"))
        if step.position[id(node)] > step.split:
            reads = [copy_name[id(v)] if v is not None and id(v) in dropped else (v.name if v is not None else None)
                     for v in node.inputs]
            steps.append(node_step(node, reads))
        else:
            steps.append(node_step(node))
    return steps, sizes


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.1f} KiB"
