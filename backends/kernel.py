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

from tessel.ir.types import TensorType, numpy_dtype

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
# Attributes of a fused kernel whose arguments / results are NCHW[b]c buffers: the channel block of
# each (0: as typed). Its members see NCHW; the kernel converts at its edges (passes/conv_layout.py).
ARG_BLOCKS, RESULT_BLOCKS = "tessel_arg_blocks", "tessel_result_blocks"


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


def build(spec: KernelSpec, target: TargetSpec):
    """Lower, schedule and compile one kernel (one op or a fused group); returns TVM's Executable."""
    func, scheduled = schedule_kernel(spec, target)
    return _compile(func, target, scheduled)


def workspace_bytes(spec: KernelSpec, target: TargetSpec) -> int:
    """Bytes of the intermediate buffers the kernel allocates beyond its inputs and outputs.

    Read from the scheduled PrimFunc (no compilation): every global buffer it
    allocates, except the register tiles made by cache_write (named `*_global`),
    which shrink to one tile when the kernel is lowered.
    """
    func, scheduled = schedule_kernel(spec, target)
    if not scheduled and target.kind == "llvm":
        from .schedules import cpu

        func = cpu.schedule(func)
    total = 0
    for buffer in func.body.block.alloc_buffers:
        if buffer.scope() == "global" and not buffer.name.endswith("_global"):
            count = 1
            for d in buffer.shape:
                count *= int(d)
            total += count * TensorType(str(buffer.dtype), ()).itemsize
    return total


def schedule_kernel(spec: KernelSpec, target: TargetSpec):
    """Lower one kernel to a PrimFunc: (func, scheduled) — scheduled when its rules brought their own schedule."""
    from .lowering import LowerContext, LoweringError
    from .lowering.context import SelfScheduled
    from .lowering.rnn import PrimFuncResult
    from .tvm_env import tvm

    tvm_mod = tvm()
    te, tir = tvm_mod.te, tvm_mod.tirx
    args = [TensorType.parse(i.type) for i in spec.inputs if i is not None and i.role == ARG]
    placeholders = [te.placeholder(t.shape, t.dtype, name=f"in{k}") for k, t in enumerate(args)]
    layouts = dict(spec.attrs)
    arg_tensors = [_unblocked(te, p, b, f"unblock{k}") if b else p
                   for k, (p, b) in enumerate(zip(placeholders, layouts.get(ARG_BLOCKS) or [0] * len(args)))]
    produced: dict[tuple[int, int], Any] = {}
    members = spec.members()
    anchor = None
    for m, member in enumerate(members):
        op = member.spec
        rule = _rule(op.op_type)
        tensors, types, data = [], [], []
        for index, (item, source) in enumerate(zip(op.inputs, member.sources)):
            if item is None:
                tensors.append(None)
                types.append(None)
                data.append(None)
                continue
            t = TensorType.parse(item.type)
            types.append(t)
            data.append(item.data)
            if item.role == ARG:
                tensors.append(arg_tensors[source[1]] if source[0] == "arg" else produced[(source[1], source[2])])
            else:
                tensors.append(_constant_tensor(te, tir, item.data, t, f"const{m}_{index}"))
        out_types = [TensorType.parse(o) if o is not None else None for o in op.outputs]
        ctx = LowerContext(op.op_type, dict(op.attrs), tensors, types, data, out_types, gpu=target.is_gpu)
        results = rule(ctx)
        if isinstance(results, SelfScheduled):
            known = [t for t in tensors if t is not None]
            anchor = (results.schedule, _new_op_names(results.outputs, known))
            results = results.outputs
        if len(results) == 1 and isinstance(results[0], PrimFuncResult):
            if len(members) > 1:
                raise LoweringError(f"{op.op_type} is a hand-written kernel and cannot be fused")
            # Already scheduled, arguments already in kernel order.
            return results[0].func.with_attr("global_symbol", "main"), True
        for index, (tensor, want) in enumerate(zip(results, out_types)):
            if want is None:
                continue
            if tensor is None:
                raise LoweringError(f"{op.op_type}: output {index} was not produced")
            got = tuple(int(d) for d in tensor.shape)
            if got != want.shape:
                raise LoweringError(f"{op.op_type}: output {index} lowered to shape {list(got)}, expected {list(want.shape)}")
            produced[(m, index)] = tvm_mod.topi.cast(tensor, want.dtype) if tensor.dtype != want.dtype else tensor
    outputs = []
    result_blocks = layouts.get(RESULT_BLOCKS) or [0] * len(spec.result_refs())
    for index, (ref, block) in enumerate(zip(spec.result_refs(), result_blocks)):
        tensor = produced[ref]
        if block:
            tensor = _blocked(te, tensor, block, f"block{index}")
        elif any(tensor is p for p in placeholders) or not isinstance(tensor.op, te.ComputeOp):
            source = tensor
            tensor = te.compute(source.shape, lambda *i, s=source: s[i], name=f"copy{index}")
        outputs.append(tensor)
    func = te.create_prim_func(placeholders + outputs)
    if anchor is not None and target.kind == "llvm":
        from .schedules import cpu

        return cpu.schedule_around(func, *anchor), True
    return func, False


def _unblocked(te, blocked, block: int, name: str):
    """The NCHW view of an NCHW[block]c placeholder (inlined into its readers)."""
    n, cb, h, w, _ = (int(d) for d in blocked.shape)
    return te.compute((n, cb * block, h, w), lambda ni, c, y, x: blocked[ni, c // block, y, x, c % block], name=name)


def _blocked(te, tensor, block: int, name: str):
    """An NCHW result written as NCHW[block]c."""
    n, c, h, w = (int(d) for d in tensor.shape)
    return te.compute((n, c // block, h, w, block), lambda ni, cb, y, x, ci: tensor[ni, cb * block + ci, y, x], name=name)


def _rule(op_type: str):
    from .lowering import RULES, LoweringError

    rule = RULES.get(op_type)
    if rule is None:
        raise LoweringError(f"op {op_type} has no TVM lowering")
    return rule


def _new_op_names(outputs: Sequence[Any], known: Sequence[Any]) -> frozenset[str]:
    """Names of the TE ops that compute `outputs` from the `known` tensors (the ops one rule made)."""
    known_ops = [t.op for t in known]
    names: set[str] = set()
    stack = [t for t in outputs if t is not None]
    seen: list[Any] = []
    while stack:
        tensor = stack.pop()
        op = tensor.op
        if any(op.same_as(k) for k in known_ops) or any(op.same_as(s) for s in seen):
            continue
        seen.append(op)
        names.add(op.name)
        stack.extend(op.input_tensors)
    return frozenset(names)


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
