"""Re-sizing a kernel to a micro-batch: the same ops on fewer samples; accumulating a batch-summing op's pieces."""
from __future__ import annotations

from tessel.ir.schema import FUSED
from tessel.ir.types import TensorType

from .kernel import ARG, KernelInput, KernelMember, KernelSpec

# Ops whose outputs sum over the batch (no batch axis): a micro-batch gives a partial result, to be summed.
BATCH_SUMMING = ("ConvGradFilter",)
# The inputs sliced with the batch of ops whose other inputs (weights at run time) are kernel arguments too.
BATCHED_INPUTS = {"ConvTranspose": (0,), "ConvGradFilter": (0, 1)}


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
        batched = batched and member.spec.op_type not in BATCH_SUMMING
        outputs = tuple(resized(o) if batched and o is not None else o for o in member.spec.outputs)
        if batched:
            batched_outputs.update((m, k) for k, o in enumerate(outputs) if o is not None)
        members.append(KernelMember(KernelSpec(member.spec.op_type, member.spec.attrs, tuple(inputs), outputs), member.sources))
    if not spec.body:
        only = members[0].spec
        return KernelSpec(spec.op_type, spec.attrs, only.inputs, only.outputs)
    outputs = tuple(resized(o) if ref in batched_outputs else o for o, ref in zip(spec.outputs, spec.results))
    return KernelSpec(spec.op_type, spec.attrs, tuple(arg_inputs), outputs, tuple(members), spec.results)


def accumulating(spec: KernelSpec) -> KernelSpec:
    """A one-op batch-summing kernel that adds its result to a running sum: one more argument (the sum so far, its
    output's type) and output = sum so far + this micro-batch's partial result.

    The sum so far may be the output's own buffer (the caller passes it as both): the addition reads and writes
    each element at the same index. The partial result is the workspace the accumulation adds.
    """
    if spec.body or spec.op_type not in BATCH_SUMMING or len(spec.outputs) != 1:
        raise ValueError(f"only a one-output {'/'.join(BATCH_SUMMING)} kernel accumulates, not {spec.op_type}")
    result = spec.outputs[0]
    arg_inputs = tuple(item for item in spec.inputs if item is not None and item.role == ARG)
    partial = spec.members()[0]
    add = KernelSpec("Add", (), (KernelInput(result, ARG), KernelInput(result, ARG)), (result,))
    total = KernelMember(add, (("arg", len(arg_inputs), 0), ("member", 0, 0)))
    return KernelSpec(FUSED, (), arg_inputs + (KernelInput(result, ARG),), (result,), (partial, total), ((1, 0),))
