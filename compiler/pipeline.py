"""The optimization pipeline: one ordered list of passes, run with timing, stats and optional checks."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tessel import ir
from tessel.ir.graph import Graph
from tessel.ir.schema import FUSED
from tessel.passes.base import Pass
from tessel.passes.batch_gemms import BATCH_GEMMS
from tessel.passes.constant_fold import CONSTANT_FOLD
from tessel.passes.cse import CSE
from tessel.passes.dce import DCE
from tessel.passes.fuse import FUSE, kernel_count
from tessel.passes.one_hot_gather import ONE_HOT_GATHER
from tessel.passes.pool_concat import POOL_CONCAT
from tessel.passes.pool_taps import POOL_TAPS
from tessel.passes.simplify import SIMPLIFY
from tessel.passes.split_variadic import SPLIT_VARIADIC

# Variadic ops are split right after simplification, so no later pass or kernel sees thousands of inputs. A
# training step's pools keep their taps before CSE and DCE, so recomputation (placed after them) plans the
# step's real memory. Gemms stack after CSE, which makes one value of equal weights. One-hot products become gathers
# once constant folding has made their class ranges constants. Pools move before a channel Concat after DCE (a
# Concat something else reads stays whole) and before fusion, which would put the Concat inside the pool's kernel.
PIPELINE: tuple[Pass, ...] = (SIMPLIFY, SPLIT_VARIADIC, CONSTANT_FOLD, ONE_HOT_GATHER, POOL_TAPS, CSE, DCE, POOL_CONCAT,
                              BATCH_GEMMS, FUSE)
PASS_NAMES = tuple(p.name for p in PIPELINE)


@dataclass
class PassRecord:
    """What one pass did: time, nodes and kernels before and after, its own stats."""

    name: str
    seconds: float
    changed: bool
    nodes_before: int
    nodes_after: int
    kernels_before: int
    kernels_after: int
    stats: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """A JSON-ready dict."""
        return {
            "name": self.name, "seconds": round(self.seconds, 4), "changed": self.changed,
            "nodes_before": self.nodes_before, "nodes_after": self.nodes_after,
            "kernels_before": self.kernels_before, "kernels_after": self.kernels_after, "stats": self.stats,
        }


def select_passes(skip: Sequence[str] = ()) -> tuple[Pass, ...]:
    """The pipeline without the passes named in `skip` (unknown names raise ValueError)."""
    unknown = sorted(set(skip) - set(PASS_NAMES))
    if unknown:
        raise ValueError(f"unknown pass {', '.join(unknown)}; passes are {', '.join(PASS_NAMES)}")
    return tuple(p for p in PIPELINE if p.name not in skip)


def node_count(graph: Graph) -> int:
    """Nodes in the graph and its subgraphs (fused groups count their members)."""
    return sum(1 for _ in graph.walk_nodes()) - sum(1 for n in graph.walk_nodes() if n.op_type == FUSED)


def run_pipeline(graph: Graph, passes: Sequence[Pass] = PIPELINE, *, verify: bool = False,
                 dump_after: Sequence[str] = (), dump_dir: str | Path | None = None) -> tuple[Graph, list[PassRecord]]:
    """Run `passes` in order; verify after each when asked; dump the graph after the named passes.

    A dump writes `<dump_dir>/after_<pass>.txt` (the printed graph) and `after_<pass>.onnx`.
    """
    records = []
    for p in passes:
        nodes, kernels = node_count(graph), kernel_count(graph)
        started = time.perf_counter()
        result = p(graph)
        seconds = time.perf_counter() - started
        graph = result.graph
        if verify:
            ir.verify(graph)
        records.append(PassRecord(p.name, seconds, result.changed, nodes, node_count(graph), kernels,
                                  kernel_count(graph), dict(result.stats)))
        if p.name in dump_after and dump_dir is not None:
            _dump(graph, Path(dump_dir), p.name)
    return graph, records


def pass_report(records: Sequence[PassRecord]) -> str:
    """A Markdown table of what each pass did."""
    lines = ["# Passes", "", "| pass | ms | nodes before | after | kernels before | after | what it did |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in records:
        did = ", ".join(f"{k}: {v}" for k, v in r.stats.items() if v) or "nothing"
        lines.append(f"| {r.name} | {1e3 * r.seconds:.1f} | {r.nodes_before} | {r.nodes_after} | "
                     f"{r.kernels_before} | {r.kernels_after} | {did} |")
    return "\n".join(lines) + "\n"


def _dump(graph: Graph, directory: Path, name: str) -> None:
    import onnx

    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"after_{name}.txt").write_text(ir.format_graph(graph))
    onnx.save(ir.to_onnx(graph), str(directory / f"after_{name}.onnx"))
