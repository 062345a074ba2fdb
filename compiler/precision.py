"""The precision a compile runs its dot products in: float32 as written, or bf16 (`precision="bf16"` / `"auto"`).

"bf16" runs every conv the bf16 kernels take (dense 2-D convs with constant weights and at least 16 output
channels: backends/cpu/packing.py) with bf16 products and f32 accumulation, but those Winograd runs by default,
which stay float32 Winograd (fewer multiply-adds beat bf16's rate: compiler/program.py); every other op, and every
epilogue, stays float32. "auto" chooses bf16 where the target is this CPU, the CPU has avx512_bf16, and
those convs hold at least BF16_MIN_FLOP_SHARE of the model's FLOPs (estimated, ir/costs.py); float32
otherwise. The choice, its reason and the bf16 nodes go in reports/compile.json ("precision").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from tessel.backends.cpu.bf16 import CPU_FLAG, cpu_has_bf16
from tessel.ir.costs import flops
from tessel.ir.graph import Graph
from tessel.passes.fuse import kernel_members

FP32, BF16, AUTO = "fp32", "bf16", "auto"
# "auto" takes bf16 only where the convs it would run in bf16 are most of the work: elsewhere the model's time
# goes to float32 kernels bf16 does not speed up, and its outputs would lose precision for little.
BF16_MIN_FLOP_SHARE = 0.5


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision used, the one asked for, why, and the nodes run in bf16 with their share of the FLOPs."""

    requested: str
    used: str
    reason: str
    bf16_nodes: Mapping[str, str]
    bf16_flop_share: float

    def to_json(self) -> dict[str, Any]:
        """compile.json's "precision" entry (the FLOP share is estimated: analytic counts)."""
        return {"requested": self.requested, "used": self.used, "reason": self.reason,
                "bf16_nodes": dict(self.bf16_nodes), "bf16_flop_share": round(self.bf16_flop_share, 4),
                "bf16_flop_share_source": "estimated"}


def flop_share(graph: Graph, names: Mapping[str, str]) -> float:
    """The share of `graph`'s FLOPs (estimated) in the nodes named in `names`, fused members included."""
    total = part = 0
    for node in graph.nodes:
        total += flops(node)
        members, _ = kernel_members(node)
        part += sum(flops(member) for member in members if member.name in names)
    return part / total if total else 0.0


def choose_precision(requested: str, graph: Graph, target_kind: str, bf16_nodes: Callable[[], Mapping[str, str]],
                     has_bf16: Callable[[], bool] = cpu_has_bf16) -> PrecisionChoice:
    """The precision of a compile asked for `requested` ("fp32", "bf16" or "auto"; "fp64" compiles as "fp32" here:
    its graph is float64 already). `bf16_nodes()` lists the nodes a bf16 program would run in bf16."""
    if requested not in (BF16, AUTO):
        return PrecisionChoice(requested, requested, "as requested", {}, 0.0)
    why_not = bf16_unavailable(target_kind, has_bf16)
    if why_not is not None:  # "bf16" itself was refused with the options (compiler/options.py)
        return PrecisionChoice(requested, FP32, why_not, {}, 0.0)
    nodes = bf16_nodes()
    share = flop_share(graph, nodes)
    if not nodes:
        return PrecisionChoice(requested, FP32, "no conv the bf16 kernels take (dense 2-D, constant weights, "
                               "at least 16 output channels)", {}, 0.0)
    if requested == AUTO and share < BF16_MIN_FLOP_SHARE:
        return PrecisionChoice(requested, FP32, f"the convs bf16 would run hold {share:.0%} of the FLOPs "
                               f"(auto needs {BF16_MIN_FLOP_SHARE:.0%})", {}, share)
    reason = "as requested" if requested == BF16 else f"{CPU_FLAG}; those convs hold {share:.0%} of the FLOPs"
    return PrecisionChoice(requested, BF16, reason, nodes, share)


def bf16_unavailable(target_kind: str, has_bf16: Callable[[], bool] = cpu_has_bf16) -> str | None:
    """Why bf16 kernels cannot run for this target on this machine; None when they can."""
    if target_kind != "llvm":
        return f"the bf16 kernels are CPU (llvm) kernels; the target is {target_kind}"
    if not has_bf16():
        return f"this CPU lacks {CPU_FLAG}"
    return None
