"""Memory planning: tensor lifetimes from the execution order, then offsets in one arena.

Input is the executed schedule (which values each step reads and writes, which
outputs are views of an input, which outputs a kernel may compute in place of
an input) and the byte size of every activation. Views share their source's
storage; an output computed in place shares the storage of an input that dies
at that step. Storages get offsets by two strategies (TFLite's greedy by size
and greedy by breadth, both best-fit); the smaller arena wins. The plan
reports the arena against its lower bound — the most bytes simultaneously live
at any step — and against no reuse at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

DEFAULT_ALIGNMENT = 64
CUDA_ALIGNMENT = 256


@dataclass(frozen=True)
class StepUse:
    """What one executed step touches: values read and written, views and in-place candidates."""

    name: str
    op: str
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    # (output, input): the output is the input's buffer, reshaped.
    views: tuple[tuple[str, str], ...] = ()
    # (output, input): the kernel may write the output over the input when the input dies here.
    inplace: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Storage:
    """One block of the arena: the values it holds, when it is live (steps, inclusive), where it is."""

    values: tuple[str, ...]
    nbytes: int
    start: int
    end: int
    offset: int = 0


@dataclass
class MemoryPlan:
    """Offsets of every activation in one arena, and how good the placement is."""

    alignment: int
    arena_bytes: int
    bound_bytes: int
    no_reuse_bytes: int
    strategy: str
    storages: list[Storage]
    offsets: dict[str, int]
    sizes: dict[str, int]
    steps: list[StepUse]
    inplace: list[tuple[str, str]] = field(default_factory=list)
    strategies: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Arena bytes over the lower bound (1.0 is optimal)."""
        return self.arena_bytes / self.bound_bytes if self.bound_bytes else 1.0

    def live_bytes(self) -> list[int]:
        """Bytes of storages live at each step."""
        live = [0] * len(self.steps)
        for s in self.storages:
            for t in range(max(s.start, 0), min(s.end, len(self.steps) - 1) + 1):
                live[t] += s.nbytes
        return live

    def peak_step(self) -> int:
        """The step where the most bytes are live."""
        live = self.live_bytes()
        return max(range(len(live)), key=live.__getitem__) if live else 0

    def live_at(self, step: int) -> list[Storage]:
        """Storages live at `step`, largest first."""
        return sorted((s for s in self.storages if s.start <= step <= s.end), key=lambda s: -s.nbytes)


def _align(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


def plan_memory(steps: Sequence[StepUse], sizes: Mapping[str, int], *, inputs: Sequence[str] = (),
                outputs: Sequence[str] = (), alignment: int = DEFAULT_ALIGNMENT, inplace: bool = True) -> MemoryPlan:
    """Place every value of `sizes` (activations; weights are not in it) in one arena.

    Inputs are live from before the first step, outputs until after the last.
    """
    steps = list(steps)
    storages, merged = plan_lifetimes(steps, sizes, inputs=inputs, outputs=outputs, alignment=alignment,
                                      inplace=inplace)
    view_outputs = {out for step in steps for out, _ in step.views}
    no_reuse = sum(_align(sizes[n], alignment) for n in sizes if n not in view_outputs)
    bound = bound_bytes(storages)
    results = {name: strategy(storages) for name, strategy in STRATEGIES.items()}
    best = min(results, key=lambda k: (_arena(results[k]), k))
    placed = results[best]
    offsets = {v: s.offset for s in placed for v in s.values}
    return MemoryPlan(alignment, _arena(placed), bound, no_reuse, best, placed, offsets, dict(sizes), steps, merged,
                      {k: _arena(v) for k, v in results.items()})


def plan_lifetimes(steps: Sequence[StepUse], sizes: Mapping[str, int], *, inputs: Sequence[str] = (),
                   outputs: Sequence[str] = (), alignment: int = DEFAULT_ALIGNMENT,
                   inplace: bool = True) -> tuple[list[Storage], list[tuple[str, str]]]:
    """The storages of `plan_memory` before placement (values sharing a buffer, their lifetimes, offsets 0) and
    the (output, input) pairs computed in place: enough for `bound_bytes`, which is far cheaper than placing."""
    last = len(steps)
    root = {name: name for name in sizes}

    def find(name: str) -> str:
        while root[name] != name:
            root[name] = root[root[name]]
            name = root[name]
        return name

    for step in steps:
        for out, source in step.views:
            if out in root and source in root:
                root[out] = find(source)
    first_write: dict[str, int] = {name: -1 for name in inputs if name in sizes}
    last_read: dict[str, int] = {name: last for name in outputs if name in sizes}
    for t, step in enumerate(steps):
        for name in step.writes:
            if name in sizes:
                first_write.setdefault(name, t)
        for name in step.reads:
            if name in sizes:
                last_read[name] = max(last_read.get(name, t), t)

    members: dict[str, list[str]] = {}
    for name in sizes:
        members.setdefault(find(name), []).append(name)

    def span(values: Sequence[str]) -> tuple[int, int]:
        start = min(first_write.get(v, last) for v in values)
        end = max(last_read.get(v, first_write.get(v, -1)) for v in values)
        return start, max(start, end)

    merged: list[tuple[str, str]] = []
    reused: set[str] = set()
    for t, step in enumerate(steps if inplace else ()):
        for out, source in step.inplace:
            if out not in sizes or source not in sizes:
                continue
            target, own = find(source), find(out)
            # An output reuses at most one input's buffer, and only one that dies at this step.
            if out in reused or target == own or span(members[target])[1] != t or first_write.get(out) != t:
                continue
            if max(sizes[v] for v in members[own]) > max(sizes[v] for v in members[target]):
                continue
            root[own] = target
            members[target].extend(members.pop(own))
            merged.append((out, source))
            reused.add(out)
    storages = []
    for values in members.values():
        start, end = span(values)
        storages.append(Storage(tuple(sorted(values)), _align(max(sizes[v] for v in values), alignment), start, end))
    return storages, merged


def bound_bytes(storages: Sequence[Storage]) -> int:
    """The most bytes live at once: no placement of these lifetimes can use less."""
    events: dict[int, int] = {}
    for s in storages:
        events[s.start] = events.get(s.start, 0) + s.nbytes
        events[s.end + 1] = events.get(s.end + 1, 0) - s.nbytes
    live = peak = 0
    for t in sorted(events):
        live += events[t]
        peak = max(peak, live)
    return peak


def _arena(storages: Sequence[Storage]) -> int:
    return max((s.offset + s.nbytes for s in storages), default=0)


def _overlaps(a: Storage, b: Storage) -> bool:
    return a.start <= b.end and b.start <= a.end


def _best_fit(item: Storage, placed: Sequence[Storage]) -> int:
    """The offset of the smallest gap among time-overlapping placed storages that holds `item`."""
    busy = sorted((p.offset, p.offset + p.nbytes) for p in placed if _overlaps(p, item))
    best, best_gap, cursor = None, None, 0
    for lo, hi in busy:
        gap = lo - cursor
        if gap >= item.nbytes and (best_gap is None or gap < best_gap):
            best, best_gap = cursor, gap
        cursor = max(cursor, hi)
    return best if best is not None else cursor


def _place(order: Sequence[Storage]) -> list[Storage]:
    placed: list[Storage] = []
    for item in order:
        placed.append(Storage(item.values, item.nbytes, item.start, item.end, _best_fit(item, placed)))
    return placed


def greedy_by_size(storages: Sequence[Storage]) -> list[Storage]:
    """Largest storages first, each into the best-fitting gap (TFLite's GreedyBySize)."""
    return _place(sorted(storages, key=lambda s: (-s.nbytes, s.start, s.values)))


def greedy_by_breadth(storages: Sequence[Storage]) -> list[Storage]:
    """Steps with the most live bytes first; at each, its storages largest first (TFLite's GreedyByBreadth)."""
    if not storages:
        return []
    lo = min(s.start for s in storages)
    hi = max(s.end for s in storages)
    breadth = {t: 0 for t in range(lo, hi + 1)}
    for s in storages:
        for t in range(s.start, s.end + 1):
            breadth[t] += s.nbytes
    order, seen = [], set()
    for t in sorted(breadth, key=lambda t: (-breadth[t], t)):
        for s in sorted((s for s in storages if s.start <= t <= s.end), key=lambda s: (-s.nbytes, s.values)):
            if s.values not in seen:
                seen.add(s.values)
                order.append(s)
    return _place(order)


STRATEGIES: dict[str, Callable[[Sequence[Storage]], list[Storage]]] = {
    "greedy_by_size": greedy_by_size,
    "greedy_by_breadth": greedy_by_breadth,
}
