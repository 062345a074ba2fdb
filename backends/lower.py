"""Kernel building: a `KernelSpec` (backends/kernel.py) lowered by its ops' rules (the algorithm variant the
spec chose, from backends/cpu/, else the target-neutral rule), scheduled for its target (backends/cpu/ or
backends/cuda/) and compiled by TVM.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from tessel.ir.types import TensorType

from .kernel import ARG, ARG_ALIGNMENT, ARG_BLOCKS, DEFAULT_ALIGNMENT, RESULT_BLOCKS, KernelSpec
from .target import TargetSpec


def build(spec: KernelSpec, target: TargetSpec):
    """Lower, schedule and compile one kernel (one op or a fused group); returns TVM's Executable."""
    func, scheduled = schedule_kernel(spec, target)
    alignments = dict(spec.attrs).get(ARG_ALIGNMENT)
    if alignments and target.kind == "llvm":
        from .cpu import schedule as cpu_schedule

        # Scheduled first: the schedule sees the same function as every other kernel's.
        func, scheduled = _with_alignments(func if scheduled else cpu_schedule.schedule(func), alignments), True
    return _compile(func, target, scheduled)


def _with_alignments(func, alignments: Sequence[int]):
    """`func` with its first parameters' buffers assuming `alignments` (bytes) of their data pointers: TVM emits `llvm.assume` align and aligned vector accesses from each buffer's data_alignment."""
    if all(a == DEFAULT_ALIGNMENT for a in alignments):
        return func
    from .tvm_env import tvm

    tir = tvm().tirx
    from tvm.tirx.transform.common import BufferReplacer

    replaced = {}
    for param, alignment in zip(func.params, alignments):
        t = param.ty
        if alignment != t.data_alignment:
            replaced[param] = tir.decl_buffer(list(t.shape), t.dtype, param.name, data_alignment=alignment,
                                              elem_offset=t.elem_offset, offset_factor=t.offset_factor)
    return BufferReplacer(replaced)(func) if replaced else func


def workspace_bytes(spec: KernelSpec, target: TargetSpec) -> int:
    """Bytes of the intermediate buffers the kernel allocates beyond its inputs and outputs.

    Read from the scheduled PrimFunc (no compilation): every global buffer it
    allocates, except the register tiles made by cache_write (named `*_global`),
    which shrink to one tile when the kernel is lowered.
    """
    func, scheduled = schedule_kernel(spec, target)
    if not hasattr(func.body, "block"):  # a kernel written by hand (lowering/rnn.py's PrimFuncResult): no sblocks
        from .tvm_env import tvm

        allocated = tvm().s_tir.analysis.calculate_allocated_bytes(func)
        return sum(int(per_scope.get("global", 0)) for per_scope in allocated.values())
    if not scheduled and target.kind == "llvm":
        from .cpu import schedule as cpu_schedule

        func = cpu_schedule.schedule(func)
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
    from .lowering.half_accumulate import widen_half_accumulation
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
        rule = _rule(op, target)
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
        whole = (len(members) == 1 and not any(layouts.get(ARG_BLOCKS) or ())
                 and not any(layouts.get(RESULT_BLOCKS) or ()) and all(i is None or i.role == ARG for i in op.inputs))
        ctx = LowerContext(op.op_type, op_attrs(op), tensors, types, data, out_types, gpu=target.is_gpu,
                           arch=target.arch, tf32=target.tf32, whole_kernel=whole)
        results = rule(widen_half_accumulation(ctx, tvm_mod.topi))
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
        from .cpu import schedule as cpu_schedule

        return cpu_schedule.schedule_around(func, *anchor), True
    if anchor is not None:
        from .cuda import schedule as cuda_schedule

        return cuda_schedule.schedule_around(func, *anchor), True
    return func, False


def op_attrs(op: KernelSpec) -> dict[str, Any]:
    """An op's own attributes, as its lowering rule reads them: without the kernel-level ARG_ALIGNMENT (a kernel of
    one op carries it among them)."""
    return {name: value for name, value in op.attrs if name != ARG_ALIGNMENT}


def _unblocked(te, blocked, block: int, name: str):
    """The NCHW view of an NCHW[block]c placeholder (inlined into its readers)."""
    n, cb, h, w, _ = (int(d) for d in blocked.shape)
    return te.compute((n, cb * block, h, w), lambda ni, c, y, x: blocked[ni, c // block, y, x, c % block], name=name)


def _blocked(te, tensor, block: int, name: str):
    """An NCHW result written as NCHW[block]c."""
    n, c, h, w = (int(d) for d in tensor.shape)
    return te.compute((n, c // block, h, w, block), lambda ni, cb, y, x, ci: tensor[ni, cb * block + ci, y, x], name=name)


def _rule(op: KernelSpec, target: TargetSpec):
    """The lowering rule of one op: the variant of the algorithm its spec chose (a GPU's own first), else the op's
    target-neutral rule."""
    from .cpu.variants import variant_rule
    from .cuda.conv import gpu_rule
    from .lowering import RULES, LoweringError

    attrs = op_attrs(op)
    rule = (gpu_rule(op.op_type, attrs) if target.is_gpu else None) or variant_rule(op.op_type, attrs) \
        or RULES.get(op.op_type)
    if rule is None:
        raise LoweringError(f"op {op.op_type} has no TVM lowering")
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
        from .cpu import schedule as cpu_schedule

        return tvm().compile(func if scheduled else cpu_schedule.schedule(func), target=_tvm_target(target))
    from .cuda import schedule as cuda_schedule

    return cuda_schedule.compile(func, target, scheduled)


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
