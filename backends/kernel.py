"""Kernel specs: what one compiled TVM function computes (backends/lower.py builds it).

A `KernelSpec` is everything that decides the generated code: op, attributes,
input types (and the data of compile-time inputs), output types. Its JSON text,
with the target, the TVM version and `schedule_version()`, keys the kernel cache.
A kernel's arguments are its runtime inputs, in order, then its outputs.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tessel.ir.types import TensorType, numpy_dtype

from .target import TargetSpec
from .tvm_env import version as tvm_version


BACKEND_ROOT = Path(__file__).resolve().parent


def backend_sources() -> list[Path]:
    """The backend's own source files, its subpackages' (lowering/, cpu/, cuda/) included, in a fixed order: the
    Python modules and the data they generate code from (cuda/conv_configs.json)."""
    return sorted([*BACKEND_ROOT.rglob("*.py"), *BACKEND_ROOT.rglob("*.json")])


@functools.lru_cache(maxsize=1)
def schedule_version() -> str:
    """A hash of the backend's own sources: any change to lowering or scheduling invalidates cached kernels."""
    digest = hashlib.sha256()
    for path in backend_sources():
        digest.update(path.relative_to(BACKEND_ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


ARG, DATA = "arg", "data"
# Attributes of a fused kernel whose arguments / results are NCHW[b]c buffers: the channel block of
# each (0: as typed). Its members see NCHW; the kernel converts at its edges (passes/conv_layout.py).
ARG_BLOCKS, RESULT_BLOCKS = "tessel_arg_blocks", "tessel_result_blocks"
# The algorithm chosen for an anchor op (backends/cpu/algorithms.py); absent: its default one.
ALGORITHM = "tessel_algorithm"
# The precision of an anchor op's dot products where it is not the model's float32: BF16 (bf16 products, f32
# accumulation; backends/cpu/bf16.py). Absent on every float32 kernel, whose specs (and cache keys) it leaves alone.
PRECISION, BF16 = "tessel_precision", "bf16"
# The alignment in bytes a kernel assumes of each argument's data (its runtime inputs, then its outputs): a
# kernel-level attribute (backends/lower.py keeps it from the op's lowering rule). Set only on kernels that take a
# model input or output (or a view of one; compiler/program.py), at NUMPY_ALIGNMENT for those arguments: the
# runtime then reads a caller's array, and writes a fresh output array, in place when it is that aligned
# (runtime/native_host.py). Absent on every other kernel, whose specs (and cache keys) it leaves alone.
ARG_ALIGNMENT = "tessel_arg_alignment"
# TVM's default assumption of every buffer argument (`llvm.assume` align 64 on its data pointer).
DEFAULT_ALIGNMENT = 64
# What numpy's default allocator gives (malloc on 64-bit Linux): an array numpy makes (a caller's input, a run's
# fresh output) is this aligned.
NUMPY_ALIGNMENT = 16


def arg_alignments(spec: "KernelSpec") -> tuple[int, ...] | None:
    """The alignment in bytes the kernel assumes of each argument (runtime inputs, then outputs), or None when it
    assumes DEFAULT_ALIGNMENT of all of them."""
    given = dict(spec.attrs).get(ARG_ALIGNMENT)
    return tuple(given) if given else None


@dataclass(frozen=True)
class KernelInput:
    """One input: its type, whether it is a kernel argument or compile-time data, and that data."""

    type: str
    role: str
    data: np.ndarray | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        doc: dict[str, Any] = {"type": self.type, "role": self.role}
        if self.data is not None:
            doc["data"] = self.data.reshape(-1).tolist()
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "KernelInput":
        """Read what `to_json` wrote."""
        data = None
        if "data" in doc:
            t = TensorType.parse(doc["type"])
            data = np.asarray(doc["data"], dtype=numpy_dtype(t.dtype)).reshape(t.shape)
        return cls(doc["type"], doc["role"], data)


# Where a fused member's runtime input comes from: ("arg", kernel argument, 0) or ("member", member, output).
Source = tuple[str, int, int]


@dataclass(frozen=True)
class KernelMember:
    """One op of a fused kernel: its own spec, and per input where its runtime value comes from."""

    spec: "KernelSpec"
    sources: tuple[Source | None, ...]


@dataclass(frozen=True)
class KernelSpec:
    """What one kernel computes: one op, or (op_type "Fused") several ops in `body` returning `results`."""

    op_type: str
    attrs: tuple[tuple[str, Any], ...]
    inputs: tuple[KernelInput | None, ...]
    outputs: tuple[str | None, ...]
    body: tuple[KernelMember, ...] = ()
    results: tuple[tuple[int, int], ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (stable: it keys the cache)."""
        doc = {
            "op_type": self.op_type,
            "attrs": {name: _attr_json(value) for name, value in self.attrs},
            "inputs": [i.to_json() if i is not None else None for i in self.inputs],
            "outputs": list(self.outputs),
        }
        if self.body:
            doc["body"] = [{"spec": m.spec.to_json(), "sources": [list(s) if s else None for s in m.sources]} for m in self.body]
            doc["results"] = [list(r) for r in self.results]
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "KernelSpec":
        """Read what `to_json` wrote."""
        body = tuple(
            KernelMember(cls.from_json(m["spec"]), tuple(tuple(s) if s else None for s in m["sources"]))
            for m in doc.get("body", ())
        )
        return cls(
            doc["op_type"],
            tuple((name, _attr_value(value)) for name, value in doc["attrs"].items()),
            tuple(KernelInput.from_json(i) if i is not None else None for i in doc["inputs"]),
            tuple(doc["outputs"]),
            body,
            tuple(tuple(r) for r in doc.get("results", ())),
        )

    def members(self) -> tuple[KernelMember, ...]:
        """The ops this kernel runs: its body, or itself reading its arguments in order."""
        if self.body:
            return self.body
        sources, arg = [], 0
        for item in self.inputs:
            if item is not None and item.role == ARG:
                sources.append(("arg", arg, 0))
                arg += 1
            else:
                sources.append(None)
        return (KernelMember(self, tuple(sources)),)

    def result_refs(self) -> tuple[tuple[int, int], ...]:
        """(member, output) of each kernel output."""
        if self.body:
            return self.results
        return tuple((0, k) for k, out in enumerate(self.outputs) if out is not None)

    def key(self, target: TargetSpec) -> str:
        """The cache key: a hash of the spec, target, TVM version and schedule version."""
        text = json.dumps([self.to_json(), str(target), tvm_version(), schedule_version()], sort_keys=True)
        return f"{self.op_type.lower()}-{hashlib.sha256(text.encode()).hexdigest()[:24]}"

    @property
    def arg_count(self) -> int:
        """Number of runtime input arguments."""
        return sum(1 for i in self.inputs if i is not None and i.role == ARG)


def _attr_json(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return {"tensor": TensorType.of(value).spec(), "data": value.reshape(-1).tolist()}
    if isinstance(value, tuple):
        return list(value)
    return value


def _attr_value(value: Any) -> Any:
    if isinstance(value, dict) and "tensor" in value:
        t = TensorType.parse(value["tensor"])
        return np.asarray(value["data"], dtype=numpy_dtype(t.dtype)).reshape(t.shape)
    if isinstance(value, list):
        return tuple(value)
    return value
