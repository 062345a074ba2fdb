"""Compilation targets: `llvm` for the host CPU, `cuda:sm_XX` for NVIDIA GPUs."""
from __future__ import annotations

import re
from dataclasses import dataclass

from tessel.ir.errors import TesselError


TF32_SUFFIX = "+tf32"
# The first architecture with TF32 tensor cores (Ampere).
TF32_MIN_SM = 80


class TargetError(TesselError):
    """A target string Tessel does not understand."""


@dataclass(frozen=True)
class TargetSpec:
    """What to generate code for: kind ("llvm" or "cuda") and, for CUDA, the arch (e.g. "sm_80") and whether
    convolutions may run on TF32 tensor cores (as PyTorch's `allow_tf32`: inputs rounded to a 10-bit mantissa)."""

    kind: str
    arch: str = ""
    tf32: bool = False

    def __str__(self) -> str:
        text = f"{self.kind}:{self.arch}" if self.arch else self.kind
        return text + TF32_SUFFIX if self.tf32 else text

    @property
    def is_gpu(self) -> bool:
        """True for GPU targets."""
        return self.kind == "cuda"


def parse_target(text: str) -> TargetSpec:
    """Read "llvm", "cpu", "cuda:sm_80" or "cuda:sm_80+tf32"; raise TargetError otherwise."""
    value = text.strip().lower()
    if value in ("llvm", "cpu"):
        return TargetSpec("llvm")
    match = re.fullmatch(r"cuda:(sm_(\d{2,3})a?)(\+tf32)?", value)
    if match:
        if match.group(3) and int(match.group(2)) < TF32_MIN_SM:
            raise TargetError(f"target '{text}': TF32 tensor cores need sm_{TF32_MIN_SM} or newer")
        return TargetSpec("cuda", match.group(1), tf32=bool(match.group(3)))
    if value == "cuda":
        raise TargetError("target 'cuda' needs an architecture, e.g. --target cuda:sm_80")
    raise TargetError(f"unknown target '{text}'; use llvm or cuda:sm_XX (e.g. cuda:sm_80)")


def tvm_target(spec: TargetSpec):
    """The TVM Target object for a spec (imports TVM)."""
    from .tvm_env import tvm

    target_cls = tvm().target.Target
    if spec.kind == "llvm":
        return target_cls.from_device("cpu")
    return target_cls({"kind": "cuda", "arch": spec.arch}, host={"kind": "llvm"})
