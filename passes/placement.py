"""Device placement planners: pure functions from a task graph and a machine to a placement plan.

The task graph has one task per top-level node (a fused group is one task)
with its compute time, the weight bytes it needs resident, and the bytes of
every value it passes to another task. A link costs α + β·bytes. Planners:

- `single`: everything on device 0.
- `pipeline`: contiguous stages of the topological order, one per device,
  minimizing the bottleneck stage (compute plus the transfers at its cuts) under
  per-device memory; with K micro-batches the stages overlap (GPipe-style).
- `list`: earliest-finish-time list scheduling (HEFT: tasks by upward rank,
  each to the device where it finishes first, counting transfers), with
  memory limits and pinned tasks.
- `data`: every device runs every task on its share of the batch; device 0
  scatters the inputs and gathers the outputs (collective costs from
  passes/collectives.py).
- `hybrid`: data parallel up to a cut, then device 0 gathers the activations
  at the cut and runs the rest on the whole batch (the convolutions replicated,
  a large fully-connected tail kept, with its weights, on one device).
Every plan carries a simulated schedule and the bound max(critical path,
total work / devices); `auto` picks the plan with the best predicted time.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .collectives import cost
from .machine import Link, Machine, Task


@dataclass
class Placement:
    """Where each task runs, its simulated schedule, and how good that is."""

    planner: str
    device: dict[str, int]
    start: dict[str, float]
    finish: dict[str, float]
    makespan: float
    bound: float
    microbatches: int = 1
    busy_seconds: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Data parallel: every device runs every task (on its share of the batch); `device` then says 0.
    replicated: bool = False
    # Hybrid: tasks before this position run data parallel, the rest on device 0.
    cut: int | None = None
    # Every plan considered, (planner, predicted makespan), the chosen one first (`auto` considers several).
    alternatives: list[tuple[str, float]] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Predicted batches (of `microbatches` micro-batches) per second."""
        return 1.0 / self.makespan if self.makespan else float("inf")

    @property
    def steady_seconds(self) -> float:
        """Predicted time per batch when batches stream back to back: the busiest device limits it."""
        return self.microbatches * max(self.busy_seconds, default=self.makespan)

    @property
    def quality(self) -> float:
        """Predicted makespan over the bound (1.0 is optimal)."""
        return self.makespan / self.bound if self.bound else 1.0


class PlacementError(ValueError):
    """No placement satisfies the constraints (memory, pins)."""


def parse_pins(pins: Sequence[str]) -> list[tuple[re.Pattern, int]]:
    """'REGEX=DEVICE' constraints, checked: the regex compiles, the device is a number."""
    result = []
    for pin in pins:
        pattern, sep, device = pin.rpartition("=")
        if not sep or not device.isdigit() or not pattern:
            raise PlacementError(f"--pin '{pin}': write REGEX=DEVICE, e.g. --pin '.*Conv.*=0'")
        try:
            result.append((re.compile(pattern), int(device)))
        except re.error as exc:
            raise PlacementError(f"--pin '{pin}': bad regex ({exc})") from None
    return result


def pinned_device(name: str, pins: Sequence[tuple[re.Pattern, int]]) -> int | None:
    """The device the first matching pin names, or None."""
    return next((device for pattern, device in pins if pattern.fullmatch(name) or pattern.search(name)), None)


# ---- bounds and simulation -------------------------------------------------------------------------
def lower_bound(tasks: Sequence[Task], devices: int) -> float:
    """max(critical path, total work / devices): no placement of one micro-batch finishes sooner."""
    return max(_critical_path(tasks), sum(t.seconds for t in tasks) / devices)


def simulate(tasks: Sequence[Task], device: Mapping[str, int], link: Link) -> tuple[dict[str, float], dict[str, float]]:
    """Start and finish of every task when each device runs its tasks in the given (topological) order."""
    free: dict[int, float] = {}
    start: dict[str, float] = {}
    finish: dict[str, float] = {}
    for task in tasks:
        d = device[task.name]
        ready = free.get(d, 0.0)
        for producer, nbytes in task.inputs:
            arrival = finish[producer] + (link.seconds(nbytes) if device[producer] != d else 0.0)
            ready = max(ready, arrival)
        start[task.name] = ready
        finish[task.name] = ready + task.seconds
        free[d] = finish[task.name]
    return start, finish


def busy_seconds(tasks: Sequence[Task], device: Mapping[str, int], machine: Machine) -> list[float]:
    """Per device: its compute plus the transfers it sends or receives, for one micro-batch."""
    busy = [0.0] * machine.devices
    for task in tasks:
        d = device[task.name]
        busy[d] += task.seconds
        for producer, nbytes in task.inputs:
            if device[producer] != d:
                cost = machine.link.seconds(nbytes)
                busy[d] += cost
                busy[device[producer]] += cost
    return busy


def _plan(planner: str, tasks, device, machine, microbatches: int = 1) -> Placement:
    """The plan with its simulated schedule: one micro-batch through the devices, then, with K
    micro-batches, one more every bottleneck interval (the busiest device's time)."""
    start, finish = simulate(tasks, device, machine.link)
    first = max(finish.values(), default=0.0)
    busy = busy_seconds(tasks, device, machine)
    makespan = first + (microbatches - 1) * max(busy, default=0.0)
    work = sum(t.seconds for t in tasks)
    critical = _critical_path(tasks)
    bound = max(critical + (microbatches - 1) * max((t.seconds for t in tasks), default=0.0),
                microbatches * work / machine.devices)
    return Placement(planner, dict(device), start, finish, makespan, bound, microbatches, busy)


def _critical_path(tasks: Sequence[Task]) -> float:
    finish: dict[str, float] = {}
    for task in tasks:
        finish[task.name] = task.seconds + max((finish[p] for p, _ in task.inputs), default=0.0)
    return max(finish.values(), default=0.0)


def _check_memory(tasks: Sequence[Task], device: Mapping[str, int], machine: Machine) -> list[str]:
    used = [0] * machine.devices
    for task in tasks:
        used[device[task.name]] += task.weight_bytes
    return [f"device {d} needs {used[d]} bytes of weights, has {machine.memory[d]}"
            for d in range(machine.devices) if used[d] > machine.memory[d]]


# ---- planners ----------------------------------------------------------------------------------------
def place_single(tasks: Sequence[Task], machine: Machine, pins=(), microbatches: int = 1) -> Placement:
    """Every task on device 0."""
    device = {t.name: 0 for t in tasks}
    plan = _plan("single", tasks, device, machine, microbatches)
    plan.notes += _check_memory(tasks, device, machine)
    return plan


def _cut_bytes(tasks: Sequence[Task]) -> list[int]:
    """cut[i]: bytes produced by tasks before position i and read by tasks at or after it."""
    position = {t.name: i for i, t in enumerate(tasks)}
    delta = [0] * (len(tasks) + 1)
    for i, task in enumerate(tasks):
        for producer, nbytes in task.inputs:
            p = position[producer]
            delta[p + 1] += nbytes
            delta[i + 1] -= nbytes
    cut, running = [0] * (len(tasks) + 1), 0
    for i in range(len(tasks) + 1):
        running += delta[i]
        cut[i] = running
    return cut


def place_pipeline(tasks: Sequence[Task], machine: Machine, pins=(), microbatches: int = 1) -> Placement:
    """Contiguous stages minimizing the bottleneck (stage compute + its boundary transfers), under memory.

    The smallest feasible bottleneck is found by bisection; a greedy sweep checks
    feasibility (extend a stage while it stays under the bottleneck and in memory).
    """
    n, devices = len(tasks), machine.devices
    if n == 0:
        return place_single(tasks, machine)
    prefix = [0.0]
    weights = [0]
    for t in tasks:
        prefix.append(prefix[-1] + t.seconds)
        weights.append(weights[-1] + t.weight_bytes)
    cut = _cut_bytes(tasks)
    comm = [machine.link.seconds(c) if 0 < i < n else 0.0 for i, c in enumerate(cut)]

    def stage_cost(i: int, j: int) -> float:  # tasks i..j-1
        return prefix[j] - prefix[i] + comm[i] + comm[j]

    def furthest(i: int, limit: float, capacity: int) -> int | None:
        """The largest j > i with stage i..j-1 within the limit and the memory, or None."""
        # Compute and weights only grow with j: bisect for the last j they allow, then step back
        # over cuts whose transfer cost is too high.
        j = min(bisect.bisect_right(prefix, prefix[i] + limit - comm[i]) - 1,
                bisect.bisect_right(weights, weights[i] + capacity) - 1, n)
        while j > i and stage_cost(i, j) > limit:
            j -= 1
        return j if j > i else None

    def split(limit: float) -> list[int] | None:
        bounds, i = [0], 0
        for d in range(devices):
            j = furthest(i, limit, machine.memory[d])
            if j is None:
                return None
            bounds.append(j)
            i = j
            if i == n:
                return bounds
        return None

    lo, hi = 0.0, stage_cost(0, n) + 2 * max(comm)
    best = split(hi)
    if best is None:
        raise PlacementError("no pipeline split fits the devices' memory")
    for _ in range(60):
        mid = (lo + hi) / 2
        bounds = split(mid)
        if bounds is None:
            lo = mid
        else:
            hi, best = mid, bounds
        if hi - lo <= 1e-6 * hi:
            break
    device = {}
    for d, (i, j) in enumerate(zip(best, best[1:])):
        for t in tasks[i:j]:
            device[t.name] = d
    return _plan("pipeline", tasks, device, machine, microbatches)


def place_list(tasks: Sequence[Task], machine: Machine, pins=(), microbatches: int = 1) -> Placement:
    """HEFT: tasks by decreasing upward rank, each on the device where it finishes earliest."""
    link, devices = machine.link, machine.devices
    mean_comm = lambda nbytes: link.seconds(nbytes) * (devices - 1) / devices  # noqa: E731
    readers: dict[str, list[tuple[str, int]]] = {}
    for task in tasks:
        for producer, nbytes in task.inputs:
            readers.setdefault(producer, []).append((task.name, nbytes))
    rank: dict[str, float] = {}
    for task in reversed(tasks):
        rank[task.name] = task.seconds + max((mean_comm(b) + rank[r] for r, b in readers.get(task.name, ())), default=0.0)
    position = {t.name: i for i, t in enumerate(tasks)}
    by_name = {t.name: t for t in tasks}
    # Decreasing rank is a topological order; ties keep the graph's order.
    order = sorted(tasks, key=lambda t: (-rank[t.name], position[t.name]))
    free = [0.0] * devices
    memory = [0] * devices
    device: dict[str, int] = {}
    finish: dict[str, float] = {}
    for task in order:
        pinned = pinned_device(task.name, pins)
        candidates = [pinned] if pinned is not None else range(devices)
        best = None
        for d in candidates:
            if memory[d] + task.weight_bytes > machine.memory[d] and pinned is None:
                continue
            ready = free[d]
            for producer, nbytes in task.inputs:
                arrival = finish[producer] + (link.seconds(nbytes) if device[producer] != d else 0.0)
                ready = max(ready, arrival)
            end = ready + task.seconds
            if best is None or end < best[0] - 1e-12:
                best = (end, d)
        if best is None:
            raise PlacementError(f"task '{task.name}' fits on no device ({task.weight_bytes} bytes of weights)")
        end, d = best
        device[task.name] = d
        finish[task.name] = end
        free[d] = end
        memory[d] += task.weight_bytes
    ordered = [by_name[t.name] for t in tasks]
    plan = _plan("list", ordered, device, machine, microbatches)
    plan.notes += _check_memory(tasks, device, machine)
    return plan


def _check_batch_split(planner: str, devices: int, batch: int | None, microbatches: int) -> None:
    """Data and hybrid placement give each device an equal share of the batch, at once."""
    if microbatches > 1:
        raise PlacementError(f"{planner} placement gives each device its share of the batch at once; drop --microbatches")
    if not batch or batch % devices:
        raise PlacementError(f"{planner} placement splits the batch (axis 0) evenly: batch {batch} is not a multiple of "
                             f"{devices} devices; use --batch")


def place_data(tasks: Sequence[Task], machine: Machine, batch: int | None, io_bytes: tuple[int, int] = (0, 0),
               microbatches: int = 1) -> Placement:
    """Data parallelism: each device runs the whole model on batch/devices samples.

    `tasks` carry full-batch times; each device's share is taken as 1/devices of
    them (noted in the plan). Device 0 scatters the inputs (`io_bytes[0]` in
    all) and gathers the outputs (`io_bytes[1]`), one peer after another as
    gloo does (the linear algorithm).
    """
    devices, link = machine.devices, machine.link
    _check_batch_split("data", devices, batch, microbatches)
    weights = sum(t.weight_bytes for t in tasks)
    short = [d for d in range(devices) if weights > machine.memory[d]]
    if short:
        raise PlacementError(f"data placement keeps every weight on every device: device {short[0]} has "
                             f"{machine.memory[short[0]]} bytes, the weights need {weights}")
    scatter, scatter_algorithm = cost("scatter", link, devices, io_bytes[0], "linear")
    gather, gather_algorithm = cost("gather", link, devices, io_bytes[1], "linear")
    share = 1.0 / devices
    compute = sum(t.seconds for t in tasks) * share
    start, finish, clock = {}, {}, scatter
    for task in tasks:
        start[task.name] = clock
        clock += task.seconds * share
        finish[task.name] = clock
    piece = [link.seconds(io_bytes[0] // devices) + link.seconds(io_bytes[1] // devices)]
    busy = [compute + scatter + gather] + [compute + piece[0]] * (devices - 1)
    plan = Placement("data", {t.name: 0 for t in tasks}, start, finish, scatter + compute + gather,
                     sum(t.seconds for t in tasks) / devices, 1, busy, replicated=True)
    plan.notes.append(f"every device runs every node on {batch // devices} of the {batch} samples; node times are the "
                      f"full batch's divided by {devices}")
    plan.notes.append(f"inputs scattered ({scatter_algorithm}, {1e3 * scatter:.3f} ms) and outputs gathered "
                      f"({gather_algorithm}, {1e3 * gather:.3f} ms) by device 0")
    return plan


def place_hybrid(tasks: Sequence[Task], machine: Machine, batch: int | None, io_bytes: tuple[int, int],
                 cuts: Mapping[int, int], microbatches: int = 1) -> Placement:
    """Data parallel for tasks[:i], device 0 alone for tasks[i:], at the best cut i.

    `cuts` maps each admissible cut position to the bytes (whole batch) of the
    values crossing it, which device 0 gathers. The prefix's weights live on
    every device, the rest only on device 0.
    """
    devices, link = machine.devices, machine.link
    _check_batch_split("hybrid", devices, batch, microbatches)
    if not cuts:
        raise PlacementError("hybrid placement found no cut where every value crossing it carries the batch on axis 0")
    scatter, _ = cost("scatter", link, devices, io_bytes[0], "linear")
    prefix_seconds = [0.0]
    prefix_weights = [0]
    for t in tasks:
        prefix_seconds.append(prefix_seconds[-1] + t.seconds)
        prefix_weights.append(prefix_weights[-1] + t.weight_bytes)
    total_seconds, total_weights = prefix_seconds[-1], prefix_weights[-1]
    best = None
    for i, nbytes in sorted(cuts.items()):
        if total_weights > machine.memory[0] or any(prefix_weights[i] > m for m in machine.memory[1:]):
            continue
        gather, _ = cost("gather", link, devices, nbytes, "linear")
        predicted = scatter + prefix_seconds[i] / devices + gather + total_seconds - prefix_seconds[i]
        if best is None or predicted < best[0]:
            best = (predicted, i, gather)
    if best is None:
        raise PlacementError("hybrid placement: no cut fits the devices' memory")
    predicted, cut, gather = best
    share = 1.0 / devices
    start, finish, clock = {}, {}, scatter
    for k, task in enumerate(tasks):
        if k == cut:
            clock += gather
        start[task.name] = clock
        clock += task.seconds * (share if k < cut else 1.0)
        finish[task.name] = clock
    replicated = prefix_seconds[cut] * share
    busy = [predicted] + [replicated + link.seconds(io_bytes[0] // devices) + link.seconds(cuts[cut] // devices)] * (devices - 1)
    plan = Placement("hybrid", {t.name: 0 for t in tasks}, start, finish, predicted, total_seconds / devices, 1, busy,
                     cut=cut)
    plan.notes.append(f"nodes before '{tasks[cut].name}' run on every device on {batch // devices} of the {batch} "
                      f"samples (times divided by {devices}); device 0 gathers {cuts[cut]} bytes there and runs the "
                      f"remaining {len(tasks) - cut} nodes on the whole batch")
    return plan


PLANNERS = {"single": place_single, "pipeline": place_pipeline, "list": place_list}
CHOICES = ("auto", *PLANNERS, "data", "hybrid")


def place(tasks: Sequence[Task], machine: Machine, planner: str = "auto", pins: Sequence[str] = (),
          microbatches: int = 1, batch: int | None = None, io_bytes: tuple[int, int] = (0, 0),
          cuts: Mapping[int, int] | None = None) -> Placement:
    """Place `tasks` (in topological order) with one planner, or the best predicted of all (`auto`).

    `batch` (axis 0 shared by the inputs and outputs, if any) and `io_bytes` (model
    input and output bytes) let `data` placement split the batch, and `cuts`
    (position → bytes crossing) let `hybrid` choose where to stop splitting it;
    `auto` considers both when the batch divides evenly and nothing is pinned.
    """
    parsed = parse_pins(pins)
    for pattern, d in parsed:
        if d >= machine.devices:
            raise PlacementError(f"--pin '{pattern.pattern}={d}': there are only {machine.devices} devices")
    if planner not in CHOICES:
        raise PlacementError(f"placement '{planner}': choose one of {', '.join(CHOICES)}")
    if parsed and planner in ("pipeline", "data", "hybrid"):
        raise PlacementError("--pin works with --placement list or single (pipeline stages are contiguous; "
                             "data and hybrid placement run nodes on every device)")
    if planner in ("data", "hybrid"):
        plan = (place_data(tasks, machine, batch, io_bytes, microbatches) if planner == "data" else
                place_hybrid(tasks, machine, batch, io_bytes, cuts or {}, microbatches))
        plan.alternatives = [(plan.planner, plan.makespan)]
        return plan
    names = list(PLANNERS) if planner == "auto" else [planner]
    plans = []
    for name in names:
        if name == "pipeline" and parsed:
            continue
        try:
            plans.append(PLANNERS[name](tasks, machine, parsed, microbatches))
        except PlacementError:
            if planner != "auto":
                raise
    if planner == "auto" and not parsed and microbatches == 1 and batch and batch % machine.devices == 0:
        for split in (lambda: place_data(tasks, machine, batch, io_bytes, microbatches),
                      lambda: place_hybrid(tasks, machine, batch, io_bytes, cuts or {}, microbatches)):
            try:
                plans.append(split())
            except PlacementError:
                pass
    if not plans:
        raise PlacementError("no planner found a placement within the devices' memory")
    if parsed:
        for plan in plans:
            bad = [n for n, d in plan.device.items() if (p := pinned_device(n, parsed)) is not None and p != d]
            if bad:
                plan.notes.append(f"pins not honoured for {', '.join(bad[:3])}")
        plans = [p for p in plans if not any(n.startswith("pins not") for n in p.notes)] or plans
    best = min(plans, key=lambda p: (p.makespan, p.planner != "single"))
    best.alternatives = [(p.planner, p.makespan) for p in [best] + [p for p in plans if p is not best]]
    return best
