"""`tessel run --profile`: each kernel call's measured time and the GFLOP/s it achieves.

Times are medians over several runs of each top-level instruction on its own
(runtime/executor.py `profile`); FLOPs are counted at compile time from the
optimized graph (ir/costs.py, a multiply-add counts two) and kept in
reports/compile.json's "node_flops". Compare the GFLOP/s with the machine's FMA
peak measured in the same sitting (`python bench/peak.py`): the machine's speed
varies between runs.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from tessel.ir.graph import Graph

from .artifact import Artifact

PROFILE_RUNS = 10


def node_flops(graph: Graph) -> dict[str, int]:
    """FLOPs per top-level node of a compiled graph (nodes without arithmetic left out)."""
    from tessel.ir.costs import flops

    counts = {node.name: flops(node) for node in graph.nodes}
    return {name: count for name, count in counts.items() if count}


def kernel_profile(artifact: Artifact, inputs: Mapping[str, np.ndarray], runs: int = PROFILE_RUNS) -> list[dict[str, Any]]:
    """Per instruction, slowest first: node, op, median ms, GFLOP and achieved GFLOP/s (None without FLOPs)."""
    counts = artifact.report().get("node_flops", {})
    rows = []
    for node, op, ms in artifact.executor().profile(artifact.with_defaults(inputs), runs):
        gflop = counts.get(node, 0) / 1e9
        rows.append({"node": node, "op": op, "ms": ms, "gflop": gflop,
                     "gflops": gflop / (ms / 1e3) if gflop and ms > 0 else None})
    return rows


def profile_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The profile as a table, with the total time and the GFLOP/s of the whole run."""
    lines = [f"{'node':<40} {'op':<12} {'ms':>9} {'GFLOP':>8} {'GFLOP/s':>8}"]
    for row in rows:
        gflops = f"{row['gflops']:.1f}" if row["gflops"] else "-"
        lines.append(f"{row['node'][:40]:<40} {row['op'][:12]:<12} {row['ms']:>9.3f} {row['gflop']:>8.4f} {gflops:>8}")
    total_ms = sum(row["ms"] for row in rows)
    total_gflop = sum(row["gflop"] for row in rows)
    rate = f", {total_gflop / (total_ms / 1e3):.1f} GFLOP/s" if total_ms > 0 and total_gflop else ""
    lines.append(f"profile: {len(rows)} instructions, {total_ms:.3f} ms, {total_gflop:.4f} GFLOP{rate} (measured; "
                 "compare with bench/peak.py's FMA peak measured now)")
    return lines
