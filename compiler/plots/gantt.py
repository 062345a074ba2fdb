"""The placement's Gantt chart: one lane per worker, one bar per node over its predicted time, coloured by op
kind; micro-batches in sub-rows of a lane (and hatched), transfers as dark bars under the compute bars."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from tessel.ir.schema import FUSED, TESSEL_DOMAIN

from .style import HATCHES, OTHER_COLOR, TRANSFER_COLOR, op_colors, new_figure, save, source_label

LANE_HEIGHT = 0.9  # inches per worker lane
COMPUTE, TRANSFER = 0.6, 0.22  # shares of a sub-row's height


@dataclass(frozen=True)
class GraphFacts:
    """What the chart needs from the graph besides placement.json: which node computes each tensor (to time
    its transfer) and each node's op kind for the legend (a fused node: its members' ops, e.g. Conv+Add+Relu)."""

    producers: dict[str, str]
    kinds: dict[str, str]


def graph_facts(graph) -> GraphFacts:
    """The facts of the graph the placement planned (read before placement adds its Send/Recv nodes)."""
    producers = {v.name: node.name for node in graph.nodes for v in node.outputs if v is not None}
    kinds = {node.name: "+".join(n.op_type for body in node.subgraphs() for n in body.walk_nodes())
             for node in graph.nodes if node.domain == TESSEL_DOMAIN and node.op_type == FUSED}
    return GraphFacts(producers, kinds)


def transfer_windows(placement: Mapping[str, Any], producers: Mapping[str, str]) -> list[dict[str, Any]]:
    """When each transfer of one micro-batch runs, as the placement's simulation counts it (passes/placement.py):
    from its producer's finish (a graph input: from 0) for alpha + beta * bytes seconds.

    `producers` maps a tensor to the node that computes it (absent for graph inputs). Data and hybrid
    placements move inputs by Scatter and results by Gather; the others use Send/Recv pairs.
    """
    nodes, link = placement["nodes"], placement["link"]
    split_batch = placement["planner"] in ("data", "hybrid")
    windows = []
    for t in placement["transfers"]:
        producer = producers.get(t["tensor"])
        start = nodes[producer]["finish_s"] if producer in nodes else 0.0
        if split_batch:
            kind = "Scatter" if producer not in nodes else "Gather"
        else:
            kind = "Send/Recv"
        windows.append({"tensor": t["tensor"], "from": t["from"], "to": t["to"], "kind": kind, "start_s": start,
                        "finish_s": start + link["alpha_s"] + link["beta_s_per_byte"] * t["bytes"]})
    return windows


def micro_batch_interval(placement: Mapping[str, Any]) -> float:
    """Seconds between the starts of consecutive micro-batches: the planner's makespan is the first micro-batch's
    finish plus (K - 1) of these intervals."""
    k = placement.get("microbatches", 1)
    if k <= 1:
        return 0.0
    first = max((n["finish_s"] for n in placement["nodes"].values()), default=0.0)
    return max(placement["predicted_makespan_s"] - first, 0.0) / (k - 1)


def write_gantt(path: Path, placement: Mapping[str, Any], facts: GraphFacts, title: str) -> list[Path]:
    """Write path.png and path.svg from placement.json (compiler/distribute.PlacementReport.to_json); returns them.

    Reads `devices`, `microbatches`, `planner`, `predicted_makespan_s`, `link` ({alpha_s, beta_s_per_byte,
    measured}), `nodes` ({name: {device (or "all"), op, start_s, finish_s, estimated}}) and `transfers`; a node
    on "all" devices (data placement) is drawn in every lane. `facts` from `graph_facts`.
    """
    devices, k = placement["devices"], max(placement.get("microbatches", 1), 1)
    kinds = {name: facts.kinds.get(name, node["op"]) for name, node in placement["nodes"].items()}
    time_by_kind: dict[str, float] = defaultdict(float)
    for name, node in placement["nodes"].items():
        time_by_kind[kinds[name]] += node["finish_s"] - node["start_s"]
    colors = op_colors(time_by_kind)
    windows = transfer_windows(placement, facts.producers)
    figure = new_figure(figsize=(12, 1.6 + LANE_HEIGHT * devices * (1 + 0.35 * (k - 1))))
    ax = figure.subplots()
    used = _compute_bars(ax, placement, {name: colors[kind] for name, kind in kinds.items()})
    _transfer_bars(ax, windows, placement)
    _lanes(ax, devices, k, used)
    ax.set_xlabel("time (ms, predicted)")
    ax.set_xlim(0, max(placement["predicted_makespan_s"] * 1e3, 1e-3) * 1.02)
    ax.legend(handles=_legend(colors, {w["kind"] for w in windows}, k), loc="upper left", bbox_to_anchor=(1.01, 1.0),
              framealpha=0.9)
    ax.set_title(_title(title, placement), loc="left")
    figure.tight_layout()
    return save(figure, path)


def _sub_row(lane: int, mb: int, k: int, share: float, below: float) -> tuple[float, float]:
    """(top, height) of a bar taking `share` of micro-batch `mb`'s sub-row in `lane`, `below` of it left under it
    (a lane is 1.0 high on the y axis, split into k sub-rows)."""
    row = 1.0 / k
    return lane + (mb + 1) * row - row * (below + share), row * share


def _compute_bars(ax, placement: Mapping[str, Any], color: Mapping[str, str]) -> list[bool]:
    """Every node's bar in its lane, once per micro-batch (hatched by micro-batch); whether each lane got any."""
    devices, k = placement["devices"], max(placement.get("microbatches", 1), 1)
    interval = micro_batch_interval(placement)
    # Bars grouped per (lane, micro-batch, colour) so that a large graph is a few artists, not thousands.
    bars: dict[tuple[int, int, str], list[tuple[float, float]]] = defaultdict(list)
    used = [False] * devices
    for name, node in placement["nodes"].items():
        width = node["finish_s"] - node["start_s"]
        if width <= 0:
            continue
        for lane in range(devices) if node["device"] == "all" else [node["device"]]:
            used[lane] = True
            for mb in range(k):
                bars[lane, mb, color[name]].append(((node["start_s"] + mb * interval) * 1e3, width * 1e3))
    margin = (1 - COMPUTE - TRANSFER) / 2
    for (lane, mb, face), spans in bars.items():
        ax.broken_barh(spans, _sub_row(lane, mb, k, COMPUTE, TRANSFER + margin), facecolors=face, edgecolor="white",
                       linewidth=0.3)
    # The micro-batch's hatch over each run of touching bars at once: hatching costs matplotlib per rectangle
    # (seconds for a few thousand bars), and white hatch lines look the same across a white bar edge.
    rows: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for (lane, mb, _), spans in bars.items():
        rows[lane, mb] += spans
    for (lane, mb), spans in rows.items():
        if HATCHES[mb % len(HATCHES)]:
            ax.broken_barh(merged_spans(spans), _sub_row(lane, mb, k, COMPUTE, TRANSFER + margin), facecolors="none",
                           edgecolor="white", linewidth=0.3, hatch=HATCHES[mb % len(HATCHES)])
    return used


def merged_spans(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(start, width) spans joined where they touch or overlap, in start order."""
    merged: list[list[float]] = []
    for start, width in sorted(spans):
        if merged and start <= merged[-1][0] + merged[-1][1] * (1 + 1e-9):
            merged[-1][1] = max(merged[-1][1], start + width - merged[-1][0])
        else:
            merged.append([start, width])
    return [(start, width) for start, width in merged]


def _transfer_bars(ax, windows, placement: Mapping[str, Any]) -> None:
    """Each transfer as a dark bar under the compute bars, in the sender's and the receiver's lane."""
    k = max(placement.get("microbatches", 1), 1)
    interval = micro_batch_interval(placement)
    moves: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for w in windows:
        for mb in range(k):
            span = ((w["start_s"] + mb * interval) * 1e3, max(w["finish_s"] - w["start_s"], 0.0) * 1e3)
            for lane in (w["from"], w["to"]):
                moves[lane, mb].append(span)
    margin = (1 - COMPUTE - TRANSFER) / 2
    for (lane, mb), spans in moves.items():
        ax.broken_barh(spans, _sub_row(lane, mb, k, TRANSFER, margin), facecolors=TRANSFER_COLOR,
                       edgecolor=TRANSFER_COLOR, linewidth=0.5)


def _legend(colors: Mapping[str, str], transfer_kinds: set[str], k: int) -> list:
    """Op kinds (by time taken), 'other ops', the transfer kinds, and the micro-batches' hatches."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=color, label=kind) for kind, color in colors.items() if color != OTHER_COLOR]
    if OTHER_COLOR in colors.values():
        handles.append(Patch(facecolor=OTHER_COLOR, label="other ops"))
    if transfer_kinds:
        handles.append(Patch(facecolor=TRANSFER_COLOR, label=f"transfer ({', '.join(sorted(transfer_kinds))})"))
    if k > 1:
        handles += [Patch(facecolor="white", edgecolor="#555555", hatch=HATCHES[mb % len(HATCHES)],
                          label=f"micro-batch {mb}") for mb in range(k)]
    return handles


def _lanes(ax, devices: int, k: int, used: list[bool]) -> None:
    """Lane names on the y axis (worker 0 on top), micro-batch names beside their sub-rows, lane separators."""
    ax.set_ylim(devices, 0)
    ax.set_yticks([d + 0.5 for d in range(devices)],
                  [f"device {d}" + ("" if used[d] else "\n(no nodes)") for d in range(devices)])
    if k > 1:
        ax.set_yticks([d + (mb + 0.5) / k for d in range(devices) for mb in range(k)],
                      [f"mb {mb}" for _ in range(devices) for mb in range(k)], minor=True, fontsize=7)
        ax.tick_params(axis="y", which="major", pad=34, length=0)
    for d in range(1, devices):
        ax.axhline(d, color="#555555", linewidth=0.8)
    ax.grid(axis="y", visible=False)
    ax.grid(axis="y", which="minor", visible=False)


def _title(title: str, placement: Mapping[str, Any]) -> str:
    """The model and placement, and where the times came from (node times, link, a measured run if any)."""
    nodes = placement["nodes"].values()
    node_source = source_label(sum(1 for n in nodes if n.get("estimated")), len(nodes))
    k = placement.get("microbatches", 1)
    link = "measured" if placement["link"].get("measured") else "estimated"
    lines = [f"{title}: {placement['planner']} placement on {placement['devices']} devices"
             + (f", {k} micro-batches" if k > 1 else ""),
             f"predicted schedule, makespan {placement['predicted_makespan_s'] * 1e3:.2f} ms; "
             f"node times {node_source}, link costs {link}"]
    measured = placement.get("measured")
    if measured:
        lines[-1] += f"; a measured run took {measured['seconds_per_batch'] * 1e3:.2f} ms per batch"
    return "\n".join(lines)
