"""Which algorithms can run a conv or matmul kernel, and re-sizing a kernel to a micro-batch.

Conv (dense, 2-D, float32) on llvm: "nchwc" (weights packed at compile time,
register-tiled; the default), "im2col" (column buffer + GEMM), "direct" (the
same register tiles reading the input in place: no workspace) and, for 3×3
stride-1 convs, "winograd" (F(4×4, 3×3)); on cuda: "direct" and "im2col" (dlight schedules).
Matmul with constant weights on llvm: "packed" (the default) and "direct".
The chosen one is the ALGORITHM attribute of the op in its kernel spec.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from tessel.ir.types import TensorType

from .kernel import ARG, KernelInput, KernelMember, KernelSpec
from .lowering.packing import ALGORITHM, conv_blocks, plan_packing
from .lowering.winograd import applies as winograd_applies

# The ops with several algorithms to choose from (where `algorithms` finds them applicable).
ALGORITHM_OPS = ("Conv", "MatMul", "Gemm")


def algorithms(op_type: str, attrs: Mapping[str, Any], input_types: Sequence[TensorType | None],
               constants: Sequence[np.ndarray | None], target_kind: str) -> tuple[str, ...]:
    """The algorithms that can run this op, its default first; () when there is no choice to make."""
    if op_type not in ALGORITHM_OPS or not input_types or input_types[0] is None or input_types[0].dtype != "float32":
        return ()
    if len(constants) < 2 or constants[1] is None:
        return ()
    packs = plan_packing(op_type, {k: v for k, v in attrs.items() if k != ALGORITHM}, input_types, constants) is not None
    if op_type == "Conv":
        if attrs.get("group", 1) != 1 or input_types[0].rank != 4:
            return ()
        if target_kind != "llvm":
            return ("direct", "im2col")
        out_channels, in_channels = constants[1].shape[:2]
        # Direct writes whole channel blocks straight to the output: the channels must fill them.
        whole_blocks = out_channels % conv_blocks(out_channels, in_channels)[1] == 0
        choices = ("nchwc", "im2col") + (("direct",) if whole_blocks else ()) if packs else ("im2col",)
        spatial = constants[1].shape[2:]
        if winograd_applies(spatial, attrs.get("strides") or (1, 1), attrs.get("dilations") or (1, 1)):
            choices += ("winograd",)
        return choices
    if target_kind == "llvm" and packs:
        return ("packed", "direct")
    return ()


def resize_batch(spec: KernelSpec, batched_args: frozenset[int], size: int) -> KernelSpec:
    """The same kernel for a micro-batch: axis 0 of the `batched_args` and of what the ops make from them set to `size`.

    Every op of the kernel must be per-sample along axis 0 (the caller checks):
    an op's outputs are batched when any of its runtime inputs is.
    """
    def resized(type_spec: str) -> str:
        t = TensorType.parse(type_spec)
        return TensorType(t.dtype, (size,) + t.shape[1:]).spec()

    arg_inputs, arg = [], 0
    for item in spec.inputs:
        if item is not None and item.role == ARG:
            arg_inputs.append(KernelInput(resized(item.type), ARG) if arg in batched_args else item)
            arg += 1
        else:
            arg_inputs.append(item)
    batched_outputs: set[tuple[int, int]] = set()
    members = []
    for m, member in enumerate(spec.members()):
        inputs = []
        batched = False
        for item, source in zip(member.spec.inputs, member.sources):
            is_batched = source is not None and (
                source[1] in batched_args if source[0] == "arg" else (source[1], source[2]) in batched_outputs)
            batched = batched or is_batched
            inputs.append(KernelInput(resized(item.type), item.role, item.data) if is_batched else item)
        outputs = tuple(resized(o) if batched and o is not None else o for o in member.spec.outputs)
        if batched:
            batched_outputs.update((m, k) for k, o in enumerate(outputs) if o is not None)
        members.append(KernelMember(KernelSpec(member.spec.op_type, member.spec.attrs, tuple(inputs), outputs), member.sources))
    if not spec.body:
        only = members[0].spec
        return KernelSpec(spec.op_type, spec.attrs, only.inputs, only.outputs)
    outputs = tuple(resized(o) if ref in batched_outputs else o for o, ref in zip(spec.outputs, spec.results))
    return KernelSpec(spec.op_type, spec.attrs, tuple(arg_inputs), outputs, tuple(members), spec.results)
