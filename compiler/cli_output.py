"""What the `tessel` commands print on stdout: lines for a person, or with --json one JSON document for a script."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .provenance import algo_line, placement_line
from .sizes import format_bytes


def print_json(document: Mapping[str, Any]) -> None:
    """The one JSON document of a --json command on stdout."""
    json.dump(document, sys.stdout, indent=1)
    sys.stdout.write("\n")


def compile_lines(model: str, output: Path, report: dict[str, Any], sha256: str, dump_after: list[str]) -> list[str]:
    """The compile command's summary: what was built, its memory, placement and algorithms, where reports are."""
    memory = report["memory"]
    lines = [f"compiled {model} for {report['target']}: {report['kernels']} kernels ({report['kernels_cached']} from "
             f"cache), {report['kernel_calls']} kernel calls per run, activations {format_bytes(memory['arena_bytes'])} "
             f"(bound {format_bytes(memory['bound_bytes'])}), weights {format_bytes(memory['weights_bytes'])}, both "
             f"{memory['source']} -> {output}",
             f"artifact sha256 {sha256} (publish it; 'tessel run --expect-sha256' checks it)"]
    if report["conv_layout"]["blocked_values"]:
        lines.append(f"{report['conv_layout']['blocked_values']} activations kept in NCHW[16]c between conv kernels")
    precision = report.get("precision", {})
    if precision.get("requested", "fp32") in ("bf16", "auto"):
        lines.append(precision_line(precision, output / "reports" / "compile.json"))
    if "placement" in report:
        lines.append(placement_line(report["placement"], report["devices"], output / "reports" / "placement.md"))
    if "algo" in report:
        lines.append(algo_line(report["algo"], output / "reports" / "algo.md"))
    lines.extend(f"note: {note}" for note in report.get("notes", ()))
    lines.extend(f"graph after {name}: {output / 'reports' / f'after_{name}.txt'} and .onnx" for name in dump_after)
    return lines


def precision_line(precision: Mapping[str, Any], where: Path) -> str:
    """What a compile asked for bf16 ran in: the precision used, why, and the ops in bf16 (all listed in `where`)."""
    line = f"precision {precision['used']} (asked {precision['requested']}: {precision['reason']})"
    nodes = precision.get("bf16_nodes") or {}
    if not nodes:
        return line
    ops = sorted(set(nodes.values()))
    return (f"{line}: {len(nodes)} {'/'.join(ops)} node(s) run bf16 products with float32 sums "
            f"({100 * precision['bf16_flop_share']:.1f}% of the FLOPs, estimated), the rest float32; listed in {where}")


def output_summary(array: np.ndarray) -> dict[str, Any]:
    """An output's dtype, shape and, for numbers, its range."""
    summary: dict[str, Any] = {"dtype": str(array.dtype), "shape": list(array.shape)}
    if array.size and array.dtype != bool:
        summary.update(min=float(array.min()), max=float(array.max()))
    return summary


def output_line(name: str, summary: Mapping[str, Any]) -> str:
    """An output's line in `tessel run`."""
    values = f" min {summary['min']:.6g} max {summary['max']:.6g}" if "min" in summary else ""
    return f"{name}: {summary['dtype']}[{','.join(map(str, summary['shape']))}]{values}"


def latency_summary(times: list[float]) -> dict[str, Any]:
    """The median and minimum of timed runs, in seconds."""
    return {"runs": len(times), "median_s": float(np.median(times)), "min_s": min(times)}


def latency_line(latency: Mapping[str, Any]) -> str:
    """The timed runs' line in `tessel run`."""
    return (f"latency over {latency['runs']} runs: median {1e3 * latency['median_s']:.3f} ms, "
            f"min {1e3 * latency['min_s']:.3f} ms")
