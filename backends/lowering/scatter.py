"""ScatterElements and ScatterND as hand-written TIR kernels (a scatter has no TE form).

The kernel copies the data to the output, then applies the updates one after
another, in index order: a later update of the same element wins, or combines
under `reduction`. Every index is asserted in range before anything is written
(lowering/index_checks.py), so a bad index fails the run instead of writing
outside the output. CPU only: the assertions read the indices on the host.
"""
from __future__ import annotations

import contextlib

from ..tvm_env import tvm
from .context import LowerContext
from .index_checks import IndexCheck, add_index_checks
from .rnn import PrimFuncResult

_tvm = tvm()
from tvm.script.ir_builder import IRBuilder  # noqa: E402
from tvm.script.ir_builder import tirx as T  # noqa: E402

_COMBINE = {
    "none": lambda old, new: new,
    "add": lambda old, new: old + new,
    "mul": lambda old, new: old * new,
    "max": lambda old, new: T.max(old, new),
    "min": lambda old, new: T.min(old, new),
}


@contextlib.contextmanager
def _loops(shape):
    """Serial loops over `shape`; yields the index variables."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(T.serial(0, extent)) for extent in shape]


def _readers(ctx: LowerContext) -> tuple[dict[int, object], dict[int, int]]:
    """Per present input, how to read it (a kernel argument's buffer, or a one-element constant), and the
    kernel argument number of each argument input."""
    readers, arg_numbers = {}, {}
    for k, t in enumerate(ctx.input_types):
        if t is None:
            continue
        constant = ctx.data(k)
        if constant is not None:
            value = constant.reshape(-1)[0].item()
            readers[k] = lambda *_, v=value, dtype=t.dtype: _tvm.tirx.const(v, dtype)
        else:
            arg_numbers[k] = len(arg_numbers)
            buffer = T.arg(f"in{arg_numbers[k]}", T.buffer(t.shape, t.dtype))
            readers[k] = lambda *index, b=buffer: b[tuple(index)]
    return readers, arg_numbers


def _wrapped(index, dim: int, dtype: str):
    """The position an index (checked to lie in [-dim, dim-1]) writes: negative values count from the end."""
    tir = _tvm.tirx
    return tir.Cast("int32", tir.Select(index < tir.const(0, dtype), index + tir.const(dim, dtype), index))


def _constant_check(ctx: LowerContext, check: IndexCheck) -> None:
    constant = ctx.data(1)
    bad = check.first_violation(constant) if constant is not None else None
    if bad is not None:
        index, bound, axis = bad
        raise ctx.fail(f"constant index {index} out of range [{-bound}, {bound - 1}] on axis {axis}")


def _scatter(ctx: LowerContext, nd: bool):
    if ctx.gpu:
        raise ctx.fail("has no CUDA kernel; compile it for llvm")
    data_type, index_type, update_type = ctx.input_types[0], ctx.input_types[1], ctx.input_types[2]
    dims = list(data_type.shape)
    combine = _COMBINE[ctx.attr("reduction", "none")]
    if nd:
        width = index_type.shape[-1]
        bounds, axis = tuple(dims[:width]), 0
    else:
        axis = ctx.attr("axis", 0)
        axis = axis + len(dims) if axis < 0 else axis
        bounds = (dims[axis],)
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("main")
            read, arg_numbers = _readers(ctx)
            out = T.arg("out0", T.buffer(ctx.output_types[0].shape, ctx.output_types[0].dtype))
            with _loops(dims) as i:
                T.buffer_store(out, read[0](*i), i)
            if nd:
                with _loops(index_type.shape[:-1]) as position, _loops(dims[width:]) as rest:
                    target = [_wrapped(read[1](*position, j), dims[j], index_type.dtype) for j in range(width)] + list(rest)
                    T.buffer_store(out, combine(out[tuple(target)], read[2](*position, *rest)), target)
            else:
                with _loops(update_type.shape) as position:
                    target = list(position)
                    target[axis] = _wrapped(read[1](*position), dims[axis], index_type.dtype)
                    T.buffer_store(out, combine(out[tuple(target)], read[2](*position)), target)
    func = ib.get()
    checks = []
    if 1 in arg_numbers:
        checks.append(IndexCheck(ctx.op_type, arg_numbers[1], bounds, axis, arg_numbers.get(0)))
    else:
        _constant_check(ctx, IndexCheck(ctx.op_type, 1, bounds, axis, None))
    return [PrimFuncResult(add_index_checks(func, checks))]


RULES = {
    "ScatterElements": lambda ctx: _scatter(ctx, nd=False),
    "ScatterND": lambda ctx: _scatter(ctx, nd=True),
}
