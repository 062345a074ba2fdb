"""The optimizer update ops (ir/optimizer_ops.py): SGDUpdate and AdamWUpdate.

Each is one hand-written loop over the parameter's elements (every operand has the parameter's shape, so the loop
is flat): it reads the parameter, its gradient and its slots once and writes every result, one kernel per
parameter. The step's program runs an update in place (compiler/state_program.py: the new parameter and slots
overwrite the old ones), so each iteration first binds every operand element to a local, then computes, then
stores: no element is stored before every load of it, whatever the code generator keeps in registers. A CPU runs
the loop in parallel when it is long enough (LLVM vectorizes it), a GPU one thread per element. The arithmetic is
the one ir/optimizer_ops.py spells out for the numpy reference, built here on TIR expressions.
"""
from __future__ import annotations

import contextlib
import math

from tessel.ir.optimizer_ops import adamw_update, sgd_update

from ..tvm_env import tvm
from .context import MIN_PARALLEL_WORK, LowerContext
from .rnn import PrimFuncResult

_tvm = tvm()
tir = _tvm.tirx

from tvm.script.ir_builder import IRBuilder  # noqa: E402
from tvm.script.ir_builder import tirx as T  # noqa: E402

GPU_THREADS = 256


def _update(ctx: LowerContext, tensors: list[int], scalars: list[int], arithmetic) -> list[PrimFuncResult]:
    """The update kernel whose results are those of `arithmetic(attrs, elements, scalar values, const)`, given the
    positions of the tensor inputs (read elementwise) and of the scalar inputs (0-d)."""
    dtype = ctx.out_dtype()
    count = math.prod(ctx.out_shape())
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("main")
            buffers = {}
            for k, t in enumerate(ctx.input_types):
                if t is not None and ctx.data(k) is None:
                    buffers[k] = T.arg(f"in{len(buffers)}", T.buffer(t.shape, t.dtype))
            results = [T.arg(f"out{j}", T.buffer(t.shape, t.dtype)) for j, t in enumerate(ctx.output_types)]
            flat = {k: T.decl_buffer((count,), dtype, data=buffers[k].data) for k in tensors}
            flat_results = [T.decl_buffer((count,), dtype, data=r.data) for r in results]
            values = [_scalar(ctx, buffers, k, dtype) for k in scalars]
            with contextlib.ExitStack() as loop:
                index = _element_loop(loop, count, ctx.gpu)
                elements = [T.Bind(flat[k][index]) for k in tensors]
                computed = arithmetic(ctx.attrs, elements, values, lambda number: tir.const(number, dtype))
                for view, value in zip(flat_results, [r for r in computed if r is not None], strict=True):
                    T.buffer_store(view, value, [index])
    return [PrimFuncResult(ib.get())]


def _element_loop(stack: contextlib.ExitStack, count: int, gpu: bool):
    """Enter the loop over `count` elements on `stack`; the element's index."""
    if not gpu:
        return stack.enter_context(T.parallel(0, count) if count >= MIN_PARALLEL_WORK else T.serial(0, count))
    block = stack.enter_context(T.launch_thread("blockIdx.x", -(-count // GPU_THREADS)))
    thread = stack.enter_context(T.launch_thread("threadIdx.x", GPU_THREADS))
    index = block * GPU_THREADS + thread
    stack.enter_context(T.If(index < count))
    stack.enter_context(T.Then())
    return index


def _scalar(ctx: LowerContext, buffers: dict, k: int, dtype: str):
    """The 0-d input `k`'s value in the parameter's type (a constant when known at compile time)."""
    constant = ctx.data(k)
    if constant is not None:
        return tir.const(float(constant.reshape(-1)[0]), dtype)
    value = buffers[k][()]
    return value if str(ctx.input_types[k].dtype) == dtype else value.astype(dtype)


def sgd_update_rule(ctx: LowerContext):
    """(param'[, momentum_buffer']): torch.optim.SGD's update, elementwise."""
    # Inputs: param, grad, lr[, momentum_buffer[, grad_coef]].
    count = len(ctx.inputs)
    tensors = [0, 1] + ([3] if count > 3 else [])
    scalars = [2] + ([4] if count > 4 else [])

    def arithmetic(attrs, elements, scalar_values, const):
        param, grad, *buffer = elements
        lr, *grad_coef = scalar_values
        return sgd_update(attrs, param, grad, lr, buffer[0] if buffer else None,
                          grad_coef[0] if grad_coef else None, const=const)

    return _update(ctx, tensors, scalars, arithmetic)


def adamw_update_rule(ctx: LowerContext):
    """(param', exp_avg', exp_avg_sq'): torch.optim.AdamW's update, elementwise."""

    def arithmetic(attrs, elements, scalar_values, const):
        return adamw_update(attrs, *elements, *scalar_values, sqrt=tir.sqrt, const=const)

    return _update(ctx, [0, 1, 2, 3], list(range(4, len(ctx.inputs))), arithmetic)


RULES = {
    "SGDUpdate": sgd_update_rule,
    "AdamWUpdate": adamw_update_rule,
}
