"""Kernel specs and kernel building: one IR node → one compiled TVM function.

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
from typing import Any, Sequence

import numpy as np

from ir.types import TensorType, numpy_dtype

from .target import TargetSpec
from .tvm_env import version as tvm_version


@functools.lru_cache(maxsize=1)
def schedule_version() -> str:
    """A hash of the backend's own sources: any change to lowering or scheduling invalidates cached kernels."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.rglob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


ARG, DATA = "arg", "data"


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


@dataclass(frozen=True)
class KernelSpec:
    """What one kernel computes."""

    op_type: str
    attrs: tuple[tuple[str, Any], ...]
    inputs: tuple[KernelInput | None, ...]
    outputs: tuple[str | None, ...]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (stable: it keys the cache)."""
        return {
            "op_type": self.op_type,
            "attrs": {name: _attr_json(value) for name, value in self.attrs},
            "inputs": [i.to_json() if i is not None else None for i in self.inputs],
            "outputs": list(self.outputs),
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "KernelSpec":
        """Read what `to_json` wrote."""
        return cls(
            doc["op_type"],
            tuple((name, _attr_value(value)) for name, value in doc["attrs"].items()),
            tuple(KernelInput.from_json(i) if i is not None else None for i in doc["inputs"]),
            tuple(doc["outputs"]),
        )

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


def build(spec: KernelSpec, target: TargetSpec):
    """Lower, schedule and compile one kernel; returns TVM's Executable."""
    from .lowering import RULES, LowerContext, LoweringError
    from .lowering.context import SelfScheduled
    from .lowering.rnn import PrimFuncResult
    from .tvm_env import tvm

    tvm_mod = tvm()
    te, tir = tvm_mod.te, tvm_mod.tirx
    rule = RULES.get(spec.op_type)
    if rule is None:
        raise LoweringError(f"op {spec.op_type} has no TVM lowering")
    placeholders, tensors, types, data = [], [], [], []
    for index, item in enumerate(spec.inputs):
        if item is None:
            tensors.append(None)
            types.append(None)
            data.append(None)
            continue
        t = TensorType.parse(item.type)
        types.append(t)
        data.append(item.data)
        if item.role == ARG:
            placeholder = te.placeholder(t.shape, t.dtype, name=f"in{index}")
            placeholders.append(placeholder)
            tensors.append(placeholder)
        else:
            tensors.append(_constant_tensor(te, tir, item.data, t, f"const{index}"))
    out_types = [TensorType.parse(o) if o is not None else None for o in spec.outputs]
    ctx = LowerContext(spec.op_type, dict(spec.attrs), tensors, types, data, out_types, gpu=target.is_gpu)
    results = rule(ctx)
    own_schedule = None
    if isinstance(results, SelfScheduled):
        results, own_schedule = results.outputs, results.schedule
    if len(results) == 1 and isinstance(results[0], PrimFuncResult):
        # A hand-written kernel: already scheduled, arguments already in kernel order.
        return _compile(results[0].func.with_attr("global_symbol", "main"), target, scheduled=True)
    outputs = []
    for index, (tensor, want) in enumerate(zip(results, out_types)):
        if want is None:
            continue
        if tensor is None:
            raise LoweringError(f"{spec.op_type}: output {index} was not produced")
        got = tuple(int(d) for d in tensor.shape)
        if got != want.shape:
            raise LoweringError(f"{spec.op_type}: output {index} lowered to shape {list(got)}, expected {list(want.shape)}")
        if tensor.dtype != want.dtype:
            tensor = tvm_mod.topi.cast(tensor, want.dtype)
        if any(tensor is p for p in placeholders) or not isinstance(tensor.op, te.ComputeOp):
            source = tensor
            tensor = te.compute(source.shape, lambda *i, s=source: s(*i), name=f"copy{index}")
        outputs.append(tensor)
    func = te.create_prim_func(placeholders + outputs)
    if own_schedule is not None and target.kind == "llvm":
        sch = tvm_mod.s_tir.Schedule(func)
        own_schedule(sch)
        return _compile(sch.mod["main"], target, scheduled=True)
    return _compile(func, target, scheduled=False)


def _compile(func, target: TargetSpec, scheduled: bool):
    from .tvm_env import tvm

    if target.kind == "llvm":
        from .schedules import cpu

        return tvm().compile(func if scheduled else cpu.schedule(func), target=_tvm_target(target))
    from .schedules import gpu

    return gpu.compile(func, target, scheduled)


# Compile-time inputs up to this many elements can also be read as tensors (as selects over their values).
MAX_INLINE_CONSTANT = 64


def _constant_tensor(te, tir, values: np.ndarray, t: TensorType, name: str):
    """A compile-time input as a TE tensor whose elements are constants in the generated code.

    Larger ones (which rules only read as data) become unbound placeholders: reading
    them as tensors makes kernel creation fail loudly.
    """
    flat = [v.item() for v in values.reshape(-1)]
    if not flat or len(flat) > MAX_INLINE_CONSTANT:
        return te.placeholder(t.shape, t.dtype, name=name)
    strides = [int(np.prod(t.shape[k + 1:], dtype=np.int64)) for k in range(len(t.shape))]

    def element(*index):
        position = sum((i * s for i, s in zip(index, strides)), tir.const(0, "int64")) if index else 0
        expr = tir.const(flat[-1], t.dtype)
        for k in range(len(flat) - 2, -1, -1):
            expr = tir.Select(position == k, tir.const(flat[k], t.dtype), expr)
        return expr

    return te.compute(t.shape, element, name=name)


_TARGETS: dict[str, Any] = {}


def _tvm_target(target: TargetSpec):
    from .target import tvm_target

    if str(target) not in _TARGETS:
        _TARGETS[str(target)] = tvm_target(target)
    return _TARGETS[str(target)]
