"""Algorithm and micro-batch selection in the compile driver: find the layers, time their candidates, choose, report.

A layer is a top-level kernel node whose anchor op (Conv, MatMul, Gemm) has
several algorithms (backends/cpu/algorithms.py), or a training step's backward
convolution: ConvTranspose (the data gradient, alone or with elementwise ops
after it; its micro-batches are slices of dy and dx) and ConvGradFilter (the
filter gradient, alone; its micro-batches are slices of x and dy, each piece
after the first adding its partial dW to the output, as μ-cuDNN accumulates
weight gradients). Each (algorithm, micro-batch size) candidate is compiled
through the kernel cache and timed through the backend on this machine; times
and workspaces are kept in the profile database (kernel key → milliseconds). Candidates left untimed (the profile budget ran out, or the
target cannot run here) get an estimate, marked as such. passes/algo_select.py
then chooses: per layer (DP, each layer within the workspace limit) or across
layers (ILP, the workspaces together within the budget).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from tessel.backends.cpu.algorithms import ALGORITHM_OPS, BACKWARD_OPS, algorithms, backward_algorithms
from tessel.backends.micro_batch import BATCH_SUMMING
from tessel.backends.builder import build_kernels
from tessel.backends.cache import KernelCache
from tessel.backends.kernel import KernelSpec
from tessel.backends.lower import workspace_bytes
from tessel.ir.analysis import weight_derived
from tessel.ir.costs import bytes_moved, flops
from tessel.ir.graph import Graph, Node, Value
from tessel.ir.op_traits import Pattern, op_traits
from tessel.passes.algo_select import (AlgoSelectError, Candidate, Config, ILPResult, best_single, layer_pareto,
                                micro_batch_sizes, select_ilp)
from tessel.passes.fuse import is_kernel, kernel_members
from tessel.passes.op_patterns import pattern
from tessel.runtime.profile import time_kernel
from tessel.runtime.profile_db import ESTIMATE_BYTES_PER_S, ESTIMATE_FLOPS_PER_S, ProfileDB

from .program import PACKED_SUFFIX, Program, ProgramBuilder, run_time_weights
from .provenance import budget_text, chosen_source, share, weight_growth
from .sizes import format_bytes
# Relative cost of each algorithm per (direct) FLOP for candidates never timed: a prior, reported as an
# estimate, from ResNet-18's layers timed on a 2-core x86 machine (Winograd does fewer multiplies); cuda's "gemm"
# is set well below "direct" because ResNet-18 at batch 1 took 0.8 ms with it (untimed tiles, an H200) against
# 3.3 ms with dlight's "direct" schedule (an H100).
ESTIMATE_FACTOR = {"nchwc": 1.0, "packed": 1.0, "direct": 1.1, "im2col": 1.5, "winograd": 0.7, "gemm": 0.3,
                   "grouped_gemm": 1.0, "generic": 5.0}
SLICE_ALIGNMENT = {"llvm": 64, "cuda": 256}
# What one kernel call costs beyond its work (argument passing, waking the thread pool), for estimates.
ESTIMATE_CALL_S = 10e-6
# What building a few candidate kernels at once takes before any build was seen (a build worker imports TVM first):
# seconds on a busy 2-core machine.
BUILD_ROUND_PRIOR_S = 5.0


class AlgoSelectionError(ValueError):
    """The selection cannot satisfy the request (nothing fits the workspace limit, no budget for the ILP)."""


@dataclass(frozen=True)
class Layer:
    """A node with a choice of algorithms; `sizes` are the micro-batch sizes it may run; `summing`: its micro-batches
    give partial outputs that are summed (a filter gradient), not slices of the output."""

    node: Node
    anchor: str
    batch: int
    algorithms: tuple[str, ...]
    sizes: tuple[int, ...]
    summing: bool = False


def find_layers(graph: Graph, target_kind: str, policy: str) -> list[Layer]:
    """The top-level kernel nodes with several algorithms, and the micro-batch sizes each allows."""
    derived = weight_derived(graph)
    layers = []
    for node in graph.nodes:
        if not is_kernel(node) or not node.outputs or node.outputs[0] is None or not node.outputs[0].type.rank:
            continue
        members, outer = kernel_members(node)
        if any(m.op_type in BACKWARD_OPS for m in members):
            layer = _backward_layer(node, members, outer, target_kind, policy)
            layers += [layer] if layer is not None else []
            continue
        anchors = [m for m in members if m.op_type in ALGORITHM_OPS and not m.domain]
        if len(anchors) != 1:
            continue
        anchor = anchors[0]
        values = [outer.get(id(v), v) if v is not None else None for v in anchor.inputs]
        choices = algorithms(anchor.op_type, anchor.attrs, [v.type if v is not None else None for v in values],
                             [v.const if v is not None else None for v in values], target_kind)
        if not choices:
            continue
        batch = node.outputs[0].type.shape[0]
        splittable = _per_sample(node, members, outer, derived, batch, SLICE_ALIGNMENT.get(target_kind, 64))
        sizes = tuple(micro_batch_sizes(batch, policy)) if splittable else (batch,)
        layers.append(Layer(node, anchor.op_type, batch, choices, sizes))
    return layers


def _backward_layer(node: Node, members: Sequence[Node], outer: Mapping[int, Value], target_kind: str,
                    policy: str) -> Layer | None:
    """A backward convolution's kernel as a layer: a ConvGradFilter alone (a fused consumer would see partial
    sums), a ConvTranspose alone or with elementwise ops after it. Its batch divides when every sliced value (all
    but weights) is batch-led with its samples at aligned addresses."""
    anchors = [m for m in members if m.op_type in BACKWARD_OPS]
    anchor = anchors[0]
    summing = anchor.op_type in BATCH_SUMMING
    if len(anchors) != 1 or (summing and len(members) > 1):
        return None
    values = [outer.get(id(v), v) if v is not None else None for v in anchor.inputs]
    choices = backward_algorithms(anchor.op_type, anchor.attrs, [v.type if v is not None else None for v in values],
                                  target_kind)
    if not choices or not values[0].type.rank:
        return None
    batch = values[0].type.shape[0]
    weights = run_time_weights(node)
    sliced = [v for v in node.inputs if v is not None and not v.is_constant and v.name not in weights]
    sliced += [] if summing else [v for v in node.outputs if v is not None]
    alignment = SLICE_ALIGNMENT.get(target_kind, 64)
    aligned = all(v.type.rank and v.type.shape[0] == batch and (v.type.nbytes // batch) % alignment == 0
                  for v in sliced)
    per_sample = all(m is anchor or (not m.domain and pattern(m) in (Pattern.ELEMWISE, Pattern.BROADCAST)
                                     and all(v is None or not v.is_constant or v.type.rank < m.outputs[0].type.rank
                                             or v.type.shape[0] == 1 for v in m.inputs))
                     for m in members)
    sizes = tuple(micro_batch_sizes(batch, policy)) if batch >= 2 and aligned and per_sample else (batch,)
    return Layer(node, anchor.op_type, batch, choices, sizes, summing)


def _per_sample(node: Node, members: Sequence[Node], outer: Mapping[int, Value], derived: set[int], batch: int,
                alignment: int) -> bool:
    """True when the node's batch can run in slices of axis 0: per-sample ops, batch-led activations, aligned slices."""
    if batch < 2:
        return False
    activations = [v for v in node.inputs if v is not None and id(v) not in derived]
    for value in activations + [v for v in node.outputs if v is not None]:
        if not value.type.rank or value.type.shape[0] != batch or (value.type.nbytes // batch) % alignment:
            return False
    for member in members:
        elementwise = pattern(member) in (Pattern.ELEMWISE, Pattern.BROADCAST)
        if member.domain or (not op_traits(member.op_type).per_sample and not elementwise):
            return False
        if member.op_type == "Gemm" and member.attrs.get("transA", 0):
            return False
        rank = member.outputs[0].type.rank
        for index, v in enumerate(member.inputs):
            if v is None:
                continue
            source = outer.get(id(v), v)
            weight = id(source) in derived or v.is_constant
            if member.op_type in ALGORITHM_OPS and index == 0 and weight:
                return False
            # A weight indexed by the batch axis (not broadcast over it) cannot be sliced with the batch.
            if weight and member.op_type not in ALGORITHM_OPS and v.type.rank == rank and v.type.shape[0] != 1:
                return False
    return True


@dataclass
class Timing:
    """The candidates of every layer (by node name) and how the profiling went.

    `measured` counts candidates with a measured time, `cached` those of them whose time came from the profile
    database (measured by an earlier compile); `estimated` the rest. `seconds` is the profiling's wall time (building
    and timing kernels) against `budget_s`; `enumerate_seconds` the time spent making the candidates' specs before it.
    """

    candidates: dict[str, list[Candidate]]
    measured: int
    estimated: int
    seconds: float
    budget_exhausted: bool
    cached: int = 0
    budget_s: float | None = None
    enumerate_seconds: float = 0.0


@dataclass(frozen=True)
class _Work:
    """One candidate to measure: its layer, (algorithm, micro-batch size), kernel spec and key."""

    layer: Layer
    pair: tuple[str, int]
    spec: KernelSpec
    key: str


def time_candidates(layers: Sequence[Layer], builder: ProgramBuilder, target, cache: KernelCache, db: ProfileDB,
                    budget_s: float | None = None, remeasure: bool = False, runs: int = 5,
                    progress: Callable[[int, int], None] | None = None,
                    jobs: int | None = None) -> Timing:
    """Time and size every (algorithm, micro-batch) candidate of every layer.

    First makes every candidate's spec and reads its workspace (from the scheduled kernel, kept in the profile
    database). Then measures what the database lacks (everything, with `remeasure`): compiles the candidates through
    the cache, a few at a time, and times each on random data (median of `runs`). With `budget_s` the clock is
    checked before each group of builds, before each candidate and between a candidate's runs, and no build starts
    that the builds so far say would end past the budget; what is left unmeasured is estimated, and counted as such.
    Whole-batch candidates are measured before the micro-batch ones, which are estimated from them when the budget
    runs out. Only llvm kernels can run here; cuda ones are estimated. A batch-summing layer's micro-batch is timed
    and sized as a piece that adds to the sum (the first piece only writes it, a little cheaper).
    """
    from tessel.backends.tvm_env import threads as tvm_threads

    threads = tvm_threads()
    began = time.perf_counter()
    work: list[_Work] = []
    for layer in layers:
        for algorithm in layer.algorithms:
            for size in layer.sizes:
                spec = builder.candidate(layer.node, algorithm, size)[0]
                key = spec.key(target)
                if db.workspace(key) is None:
                    db.put_workspace(key, workspace_bytes(spec, target))
                work.append(_Work(layer, (algorithm, size), spec, key))
    started = time.perf_counter()
    deadline = None if budget_s is None else started + budget_s
    wanted = [w for w in work if remeasure or db.get(w.key, threads) is None] if target.kind == "llvm" else []
    # Whole-batch candidates first, and those already compiled before those to build; layer order within each.
    wanted.sort(key=lambda w: (w.pair[1] != w.layer.batch, not cache.has(w.key)))
    times, exhausted = _measure(wanted, target, cache, runs, deadline, jobs, progress)
    db.put({ProfileDB.key(key, threads): ms for key, ms in times.items()})
    candidates: dict[str, list[Candidate]] = {}
    measured = estimated = cached = 0
    for layer in layers:
        rows = []
        for w in (w for w in work if w.layer is layer):
            ms = times.get(w.key, db.get(w.key, threads))
            if ms is not None:
                rows.append(Candidate(*w.pair, ms / 1e3, db.workspace(w.key), True))
                cached += w.key not in times
        rows += _estimates(layer, rows, {w.pair: db.workspace(w.key) for w in work if w.layer is layer})
        measured += sum(r.measured for r in rows)
        estimated += sum(not r.measured for r in rows)
        candidates[layer.node.name] = rows
    return Timing(candidates, measured, estimated, time.perf_counter() - started, exhausted, cached, budget_s,
                  started - began)


def _measure(wanted: Sequence[_Work], target, cache: KernelCache, runs: int, deadline: float | None,
             jobs: int | None, progress: Callable[[int, int], None] | None) -> tuple[dict[str, float], bool]:
    """Build and time `wanted` in order until `deadline`: (kernel key → ms, whether the deadline cut the
    measuring short)."""
    group = max(1, jobs or os.cpu_count() or 1)  # kernels built at once
    times: dict[str, float] = {}
    rounds, build_s, cut = 0, 0.0, False
    for first in range(0, len(wanted), group):
        chunk = wanted[first:first + group]
        missing = {w.key: w.spec for w in chunk if not cache.has(w.key)}
        # A build cannot be stopped halfway: start one only when the builds so far (or, before any, the prior) say
        # it ends in time.
        expected = build_s / rounds if rounds else BUILD_ROUND_PRIOR_S
        if missing and deadline is not None and time.perf_counter() + expected > deadline:
            missing, chunk, cut = {}, [w for w in chunk if cache.has(w.key)], True
        if missing:
            begin = time.perf_counter()
            build_kernels(missing, target, cache, jobs)
            build_s += time.perf_counter() - begin
            rounds += 1
        for w in chunk:
            if deadline is not None and time.perf_counter() >= deadline:
                return times, True
            ms = time_kernel(cache.library(w.key), w.spec, runs, deadline)
            if ms is not None:
                times[w.key] = ms
        if progress:
            progress(min(first + group, len(wanted)), len(wanted))
    return times, cut or (deadline is not None and time.perf_counter() >= deadline)


def _estimates(layer: Layer, timed: Sequence[Candidate], workspaces: Mapping[tuple[str, int], int]) -> list[Candidate]:
    """Estimates for the candidates not timed: the same algorithm's time scaled by batch, else a roofline prior."""
    have = {(c.algorithm, c.batch) for c in timed}
    rows = []
    for algorithm in layer.algorithms:
        known = [c for c in timed if c.algorithm == algorithm]
        for size in layer.sizes:
            if (algorithm, size) in have:
                continue
            if known:
                nearest = min(known, key=lambda c: abs(c.batch - size))
                work = max(nearest.seconds - ESTIMATE_CALL_S, 0.0) * size / nearest.batch
            else:
                compute = ESTIMATE_FACTOR.get(algorithm, 2.0) * flops(layer.node) / ESTIMATE_FLOPS_PER_S
                work = size / layer.batch * max(compute, bytes_moved(layer.node) / ESTIMATE_BYTES_PER_S)
            seconds = ESTIMATE_CALL_S + work
            rows.append(Candidate(algorithm, size, seconds, workspaces[(algorithm, size)], False))
    return rows


@dataclass
class Selection:
    """The chosen configuration per layer, the single-algorithm baseline, and the ILP's account."""

    mode: str
    policy: str
    limit: int | None
    limit_source: str
    layers: list[Layer]
    chosen: dict[str, Config]
    baseline: dict[str, Config | None]
    ilp: ILPResult | None = None
    baseline_ilp: ILPResult | None = None

    def pieces(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """node name → pieces, for build_program."""
        return {name: config.pieces for name, config in self.chosen.items()}


def select(layers: Sequence[Layer], timing: Timing, mode: str, limit: int | None, limit_source: str,
           policy: str) -> Selection:
    """Choose every layer's configuration: `dp` (each within `limit`) or `ilp` (all within `limit` together)."""
    fronts, baseline = {}, {}
    for layer in layers:
        rows = timing.candidates[layer.node.name]
        front = layer_pareto(layer.batch, rows, limit, policy if len(layer.sizes) > 1 else "undivided")
        if not front:
            smallest = min(c.workspace for c in rows if c.batch == min(layer.sizes))
            raise AlgoSelectionError(
                f"layer '{layer.node.name}' ({layer.anchor}): no algorithm fits the workspace limit "
                f"{format_bytes(limit)}; the smallest needs {format_bytes(smallest)}; raise --workspace-limit")
        fronts[layer.node.name] = front
        baseline[layer.node.name] = best_single(layer.batch, rows, limit)
    if mode == "dp":
        chosen = {name: front[0] for name, front in fronts.items()}
        return Selection(mode, policy, limit, limit_source, list(layers), chosen, baseline)
    if limit is None:
        raise AlgoSelectionError("--algo-select ilp divides a workspace budget among the layers: "
                                 "give --workspace-limit or --device-memory")
    names = [layer.node.name for layer in layers]
    try:
        result = select_ilp([fronts[n] for n in names], limit)
    except AlgoSelectError as exc:
        raise AlgoSelectionError(f"--algo-select ilp: {exc}") from None
    chosen = {n: fronts[n][c] for n, c in zip(names, result.choice)}
    # The baseline under the same budget: every layer undivided, one algorithm each, chosen by the same ILP.
    singles = [layer_pareto(layer.batch, timing.candidates[layer.node.name], limit, "undivided") for layer in layers]
    baseline_ilp = None
    if all(singles):
        try:
            baseline_ilp = select_ilp(singles, limit)
            baseline = {n: singles[k][c] for k, (n, c) in enumerate(zip(names, baseline_ilp.choice))}
        except AlgoSelectError:
            baseline = {n: None for n in names}
    else:
        baseline = {n: None for n in names}
    return Selection(mode, policy, limit, limit_source, list(layers), chosen, baseline, result, baseline_ilp)


def weight_layouts(selection: Selection, default: Program, chosen: Program, builder: ProgramBuilder) -> dict:
    """What the chosen algorithms hold for each layer's weights at run time, against the program without selection
    (a layout made at load, as Winograd's, is stored smaller: runtime/load_transforms.py).

    An algorithm may pack a weight its own way (`<weight>::packed<shape>`); a layer whose pieces run different
    algorithms holds one layout per algorithm. Per layer (node name → entry): each layout held, the algorithms
    reading it, its bytes and whether it is extra (the program without selection does not hold it); the bytes
    of the extra layouts and the layer's weight bytes with and without selection.
    """
    layouts = {}
    for layer in selection.layers:
        bases = {v.name for v in layer.node.inputs if v is not None and v.is_constant}
        readers: dict[str, set[str]] = {}
        for algorithm, size in selection.chosen[layer.node.name].pieces:
            for name in builder.candidate(layer.node, algorithm, size)[1]:
                readers.setdefault(name, set()).add(algorithm)

        def held(program: Program) -> dict[str, int]:
            return {name: int(array.nbytes) for name, array in program.weights.items()
                    if name.split(PACKED_SUFFIX)[0] in bases}

        mine, before = held(chosen), held(default)
        rows = [{"name": name, "algorithms": sorted(readers.get(name, ())), "bytes": size, "extra": name not in before}
                for name, size in sorted(mine.items())]
        layouts[layer.node.name] = {"layouts": rows,
                                    "extra_layout_bytes": sum(r["bytes"] for r in rows if r["extra"]),
                                    "weight_bytes": sum(mine.values()), "default_weight_bytes": sum(before.values())}
    return layouts


def report(selection: Selection, timing: Timing, default: Program, chosen: Program, builder: ProgramBuilder) -> dict:
    """reports/algo.json: per layer the choice, its time and workspace, the baseline, where the numbers came from,
    and the weight layouts it holds (`weight_layouts`); in total, the weight bytes with and without selection."""
    weights = weight_layouts(selection, default, chosen, builder)
    rows = []
    for layer in selection.layers:
        name = layer.node.name
        config, base = selection.chosen[name], selection.baseline[name]
        rows.append({
            "node": name, "op": layer.anchor, "batch": layer.batch, "algorithms": list(layer.algorithms),
            "micro_batches": "summed" if layer.summing else "sliced",
            "micro_batch_sizes": list(layer.sizes),
            "chosen": {"pieces": [list(p) for p in config.pieces], "describe": config.describe(),
                       "seconds": config.seconds, "workspace_bytes": config.workspace,
                       "source": "measured" if config.measured else "estimated"},
            "best_single": None if base is None else {
                "algorithm": base.pieces[0][0], "seconds": base.seconds, "workspace_bytes": base.workspace,
                "source": "measured" if base.measured else "estimated"},
            "speedup": None if base is None or config.seconds <= 0 else base.seconds / config.seconds,
            "weights": weights[name],
        })
    total = sum(r["chosen"]["seconds"] for r in rows)
    base_rows = [r for r in rows if r["best_single"] is not None]
    base_total = sum(r["best_single"]["seconds"] for r in base_rows) if len(base_rows) == len(rows) else None
    # ILP: the layers' workspaces are held together; DP: one at a time, in a shared workspace.
    workspaces = [r["chosen"]["workspace_bytes"] for r in rows] or [0]
    doc = {
        "mode": selection.mode, "policy": selection.policy,
        "workspace_limit_bytes": selection.limit, "workspace_limit_source": selection.limit_source,
        "layers": rows,
        "total_seconds": total,
        "total_source": chosen_source(rows, "chosen"),
        "best_single_total_seconds": base_total,
        "best_single_source": chosen_source(rows, "best_single"),
        "workspace_bytes": sum(workspaces) if selection.mode == "ilp" else max(workspaces),
        "weight_bytes": sum(int(a.nbytes) for a in chosen.weights.values()),
        "default_weight_bytes": sum(int(a.nbytes) for a in default.weights.values()),
        "extra_layout_bytes": sum(w["extra_layout_bytes"] for w in weights.values()),
        "profiling": {"measured": timing.measured, "from_profile_database": timing.cached,
                      "estimated": timing.estimated, "seconds": round(timing.seconds, 3), "budget_s": timing.budget_s,
                      "budget_exhausted": timing.budget_exhausted,
                      "enumerate_seconds": round(timing.enumerate_seconds, 3)},
    }
    if selection.ilp is not None:
        doc["ilp"] = selection.ilp.to_json()
        if selection.baseline_ilp is not None:
            doc["baseline_ilp"] = selection.baseline_ilp.to_json()
    return doc


def markdown(doc: dict) -> str:
    """reports/algo.md."""
    limit = doc["workspace_limit_bytes"]
    limit_text = format_bytes(limit) if limit is not None else "none"
    held = "total" if doc["mode"] == "ilp" else "largest"
    lines = [f"# Algorithm and micro-batch selection ({doc['mode']}, sizes: {doc['policy']})", "",
             f"Workspace limit: {limit_text} ({doc['workspace_limit_source']}); "
             f"{held} workspace chosen: {format_bytes(doc['workspace_bytes'])}.",
             f"{_candidates_text(doc['profiling'])}; {budget_text(doc['profiling'])}.", ""]
    base = doc["best_single_total_seconds"]
    lines.append(f"Layers total: {1e3 * doc['total_seconds']:.3f} ms chosen ({doc['total_source']})"
                 + (f" vs {1e3 * base:.3f} ms ({doc['best_single_source']}) with the best single algorithm per layer "
                    f"({base / doc['total_seconds']:.2f}x)." if base else "."))
    growth = weight_growth(doc['default_weight_bytes'], doc['weight_bytes'], doc['extra_layout_bytes'])
    lines.append(f"Held at run time: {growth}.")
    if "ilp" in doc:
        ilp = doc["ilp"]
        lines.append(f"ILP: objective {1e3 * ilp['objective_s']:.3f} ms, LP bound {1e3 * ilp['lp_bound_s']:.3f} ms, "
                     f"gap {100 * ilp['gap']:.2f}%, solved in {1e3 * ilp['solve_seconds']:.1f} ms.")
    lines += ["", "| layer | op | batch | chosen | ms | workspace | best single | ms | speedup | source | extra layouts |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["layers"]:
        base, chosen = r["best_single"], r["chosen"]
        base_ms = f"{1e3 * base['seconds']:.3f}" if base else "-"
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        lines.append(
            f"| {r['node']} | {r['op']}{' (pieces summed)' if r['micro_batches'] == 'summed' else ''} | {r['batch']} | {chosen['describe']} | {1e3 * chosen['seconds']:.3f} | "
            f"{format_bytes(chosen['workspace_bytes'])} | {base['algorithm'] if base else 'none fits'} | {base_ms} | "
            f"{speedup} | {chosen['source']} | {_extra_layouts(r['weights'])} |")
    return "\n".join(lines) + "\n"


def _candidates_text(profiling: dict) -> str:
    """'95 of 219 candidates measured, 43% (74 of them by earlier compiles), 124 estimated'."""
    total = profiling["measured"] + profiling["estimated"]
    return (f"{share(profiling['measured'], total, 'candidates')} ({profiling['from_profile_database']} of them by "
            f"earlier compiles, kept in the profile database), {profiling['estimated']} estimated")


def _extra_layouts(weights: dict) -> str:
    """A table cell: each extra layout's algorithms and bytes, and the layer's weight bytes without and with
    selection (a layout the selection replaced is no longer held); '-' for none."""
    extra = [f"{'+'.join(r['algorithms']) or '?'} {format_bytes(r['bytes'])}" for r in weights["layouts"] if r["extra"]]
    if not extra:
        return "-"
    return (f"{', '.join(extra)} (layer's weights {format_bytes(weights['default_weight_bytes'])} → "
            f"{format_bytes(weights['weight_bytes'])})")
