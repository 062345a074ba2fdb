"""What placement reads and writes: the machine file, the planner's tasks and the placement report.

compiler/worker_programs.py applies the placement; this module gives it the
tasks (one per node) and turns the plan into reports/placement.json and .md.
Node times come from the profile database (runtime/profile_db.py: kernel key
and thread count → median milliseconds, measured through the backend by
running the model once on this machine); a node with no measurement gets a
FLOP/byte roofline estimate and is marked estimated. Link costs come from
`tessel calibrate` (runtime/calibrate.py, cached) or, until then, a default
marked estimated.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from tessel.ir.costs import bytes_moved, flops
from tessel.ir.graph import Graph, Node
from tessel.passes.fuse import is_kernel
from tessel.passes.partition import Transfers
from tessel.passes.machine import Link, Machine, Task
from tessel.passes.placement import Placement
from tessel.runtime.profile_db import ESTIMATE_BYTES_PER_S, ESTIMATE_FLOPS_PER_S

from .provenance import link_text, predicted, share, source
from .sizes import format_bytes


def read_machine_file(path: str | os.PathLike) -> tuple[int, list[int | None], Link | None]:
    """A JSON machine description: {"devices": N, "memory": "2GiB" or [per device], "link": {"alpha_s", "beta_s_per_byte"}}.

    Returns (devices, memory per device or None, link or None); raises ValueError naming what is wrong.
    """
    from .sizes import parse_bytes

    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the machine description ({exc})") from None
    devices = doc.get("devices")
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"{path}: 'devices' must be a positive number")
    memory = doc.get("memory")
    sizes = memory if isinstance(memory, list) else [memory] * devices
    if len(sizes) != devices:
        raise ValueError(f"{path}: 'memory' lists {len(sizes)} sizes for {devices} devices")
    parsed = [None if m is None else (parse_bytes(m) if isinstance(m, str) else int(m)) for m in sizes]
    link = doc.get("link")
    if link is not None:
        try:
            link = Link(float(link["alpha_s"]), float(link["beta_s_per_byte"]), measured=True)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: 'link' needs numbers alpha_s and beta_s_per_byte") from None
    return devices, parsed, link


def build_tasks(graph: Graph, step_ms: Mapping[str, tuple[float, bool]], once: Sequence[str] = ()) -> list[Task]:
    """One task per top-level node: its time (measured, or a roofline estimate), weights and inputs.

    Nodes in `once` run at load, not per run: they take no time.
    """
    tasks = []
    for node in graph.nodes:
        measured = step_ms.get(node.name)
        if measured is not None and measured[0] is not None:
            seconds, estimated = measured[0] / 1e3, False
        elif node.name in once or not is_kernel(node):
            seconds, estimated = 0.0, False
        else:
            seconds, estimated = max(flops(node) / ESTIMATE_FLOPS_PER_S, bytes_moved(node) / ESTIMATE_BYTES_PER_S), True
        weights = sum(v.type.nbytes for v in _constants_read(node))
        inputs: dict[str, int] = {}
        for value in node.dependencies():
            if value.producer is not None and value.graph is graph and not value.is_constant:
                inputs[value.producer.name] = inputs.get(value.producer.name, 0) + value.type.nbytes
        out_bytes = sum(v.type.nbytes for v in node.outputs if v is not None)
        tasks.append(Task(node.name, node.op_type, seconds, weights, out_bytes, tuple(inputs.items()), estimated))
    return tasks


def _constants_read(node: Node):
    seen = {}
    for value in node.dependencies():
        if value.is_constant:
            seen[id(value)] = value
    for sub in node.subgraphs():
        for inner in sub.walk_nodes():
            for value in inner.inputs:
                if value is not None and value.is_constant:
                    seen[id(value)] = value
    return list(seen.values())


@dataclass
class PlacementReport:
    """What the placement decided and predicted, ready for reports/placement.json and .md."""

    placement: Placement
    transfers: Transfers
    machine: Machine
    tasks: list[Task]
    device_weights: list[int]
    device_arena: list[int]

    def to_json(self) -> dict[str, Any]:
        """Stable keys: planner, devices, node placement, transfers, per-device totals, prediction and bound."""
        p = self.placement
        devices = self.machine.devices
        # Data placement runs every node on every device; hybrid, the nodes before its cut.
        everywhere = {t.name for t in (self.tasks if p.replicated else self.tasks[:p.cut or 0])}
        compute = [0.0] * devices
        for task in self.tasks:
            if task.name in everywhere:
                for d in range(devices):
                    compute[d] += task.seconds / devices
            else:
                compute[p.device[task.name]] += task.seconds
        link = self.machine.link
        measured_tasks = sum(1 for t in self.tasks if not t.estimated)
        return {
            "planner": p.planner,
            "predicted_source": _prediction_source(p.planner, measured_tasks == len(self.tasks), link.measured),
            "node_times": {"measured": measured_tasks, "total": len(self.tasks)},
            "alternatives": [{"name": name, "predicted_ms": 1e3 * seconds,
                              "source": _prediction_source(name, measured_tasks == len(self.tasks), link.measured)}
                             for name, seconds in p.alternatives],
            "devices": self.machine.devices,
            "microbatches": p.microbatches,
            "link": {"alpha_s": self.machine.link.alpha, "beta_s_per_byte": self.machine.link.beta,
                     "measured": self.machine.link.measured},
            "predicted_makespan_s": p.makespan,
            "predicted_throughput_per_s": p.throughput,
            "predicted_steady_s": p.steady_seconds,
            "bound_s": p.bound,
            "makespan_over_bound": round(p.quality, 4),
            "estimated_tasks": sum(1 for t in self.tasks if t.estimated),
            "per_device": [
                {"device": d, "compute_s": compute[d], "busy_s": p.busy_seconds[d] if p.busy_seconds else None,
                 "weights_bytes": self.device_weights[d], "arena_bytes": self.device_arena[d],
                 "nodes": sum(1 for n, v in p.device.items() if v == d or n in everywhere)}
                for d in range(devices)
            ],
            "transfers": [{"tensor": t, "from": a, "to": b, "bytes": n} for t, a, b, n in self.transfers.pairs],
            "transfer_bytes": self.transfers.bytes,
            "nodes": {t.name: {"device": "all" if t.name in everywhere else p.device[t.name], "op": t.op, "start_s": p.start[t.name],
                               "finish_s": p.finish[t.name], "estimated": t.estimated} for t in self.tasks},
            "notes": p.notes,
        }


def _prediction_source(planner: str, tasks_measured: bool, link_measured: bool) -> str:
    """A plan's prediction is measured when every node time it adds up was, and (but for `single`, which sends
    nothing) the link cost too."""
    return source(tasks_measured and (link_measured or planner == "single"))


def placement_markdown(doc: Mapping[str, Any]) -> str:
    """The placement report for people."""
    lines = [
        "# Placement", "",
        f"Planner **{doc['planner']}** on {doc['devices']} devices, {doc['microbatches']} micro-batch(es). "
        f"Predicted {1e3 * doc['predicted_makespan_s']:.2f} ms per batch against a bound of "
        f"{1e3 * doc['bound_s']:.2f} ms ({'work / devices' if doc['planner'] in ('data', 'hybrid') else 'max of critical path and work / devices'}): ratio {doc['makespan_over_bound']:.2f}; "
        f"{1e3 * doc['predicted_steady_s']:.2f} ms per batch when batches stream back to back. "
        f"The prediction is {predicted(doc['predicted_source'])}: "
        f"{share(doc['node_times']['measured'], doc['node_times']['total'], 'node times')}; {link_text(doc['link'])}.",
        "", "| alternative | predicted ms | source |", "|---|---:|---|",
        *[f"| {a['name']}{' (chosen)' if k == 0 else ''} | {a['predicted_ms']:.2f} | {a['source']} |"
          for k, a in enumerate(doc["alternatives"])], "",
        "| device | nodes | compute ms | busy ms | weights | arena |", "|---:|---:|---:|---:|---:|---:|",
    ]
    for d in doc["per_device"]:
        busy = f"{1e3 * d['busy_s']:.2f}" if d["busy_s"] is not None else "-"
        lines.append(f"| {d['device']} | {d['nodes']} | {1e3 * d['compute_s']:.2f} | {busy} | "
                     f"{format_bytes(d['weights_bytes'])} | {format_bytes(d['arena_bytes'])} |")
    lines += ["", f"## Transfers ({len(doc['transfers'])}, {format_bytes(doc['transfer_bytes'])} per micro-batch"
              f"{'; the scatter of the inputs and gather of the outputs' if doc['planner'] == 'data' else ''}"
              f"{'; the scatter of the inputs and gather at the cut' if doc['planner'] == 'hybrid' else ''})", "",
              "| tensor | from | to | bytes |", "|---|---:|---:|---:|"]
    lines += [f"| {t['tensor']} | {t['from']} | {t['to']} | {format_bytes(t['bytes'])} |" for t in doc["transfers"]]
    measured = doc.get("measured")
    if measured:
        lines += ["", "## Measured", "",
                  f"{measured['seconds_per_batch'] * 1e3:.2f} ms per batch over {measured['runs']} streamed runs on "
                  f"{measured['workers']} workers ({measured['threads']} thread(s) each): prediction error "
                  f"{100 * measured['prediction_error']:+.1f}%; one run alone {measured['latency_s'] * 1e3:.2f} ms "
                  f"(prediction error {100 * measured['latency_prediction_error']:+.1f}%)."]
    if doc["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in doc["notes"]]
    return "\n".join(lines) + "\n"


__all__ = ["PlacementReport", "build_tasks", "placement_markdown", "read_machine_file"]
