"""Run-time checks of index inputs: an index outside [-n, n-1] stops the kernel, it never reads out of bounds.

A Gather-like rule asks `checked_indices` for its check and the tensor to read
indices from, and `position` for each position to read. Indices that are a
kernel argument (unchanged, or through views and integer casts) are asserted
before the kernel body: the rule's compute carries a `CHECK_ATTR` annotation
describing the check, and the CPU schedule puts a loop of assertions over that
argument first (`add_index_checks`). Indices computed inside the kernel are
stored in a buffer of the kernel's (a block carrying the annotation) and
asserted after the body, their reads clamped meanwhile. A failed assertion
comes out of the kernel call as an exception whose message `parse_check` reads
back; the executor turns it into one line naming the node and the bad index.
GPU kernels clamp every read: a wrong index then reads an element of the same
tensor, never memory outside it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

CHECK_ATTR = "tessel_index_check"
# The assertion's message starts with this; the rest is `IndexCheck.describe()`.
MARKER = "tessel index check:"
_FIELDS = re.compile(r"(\w+)=([^;]*)")


@dataclass(frozen=True)
class IndexCheck:
    """One checked index input: kernel argument `arg` of `op` indexes axis `axis` of argument `data`.

    With one bound n, every index must lie in [-n, n-1]. With several (GatherND),
    the indices' last axis holds coordinates: component j indexes axis `axis + j`
    and must lie within `bounds[j]`.
    """

    op: str
    arg: int
    bounds: tuple[int, ...]
    axis: int
    data: int | None
    # Indices computed inside the kernel (arg -1) are stored in this buffer of the kernel's and asserted
    # after its body (each read clamped meanwhile); set by the schedule, not part of the description.
    buffer: str = ""

    def describe(self) -> str:
        """The check as 'key=value;...' text (the annotation and the assertion message carry it)."""
        data = "" if self.data is None else str(self.data)
        bounds = ",".join(map(str, self.bounds))
        return f"op={self.op};arg={self.arg};bounds={bounds};axis={self.axis};data={data}"

    @classmethod
    def parse(cls, text: str) -> "IndexCheck":
        """Read what `describe` wrote."""
        fields = dict(_FIELDS.findall(text))
        data = fields.get("data", "")
        bounds = tuple(int(b) for b in fields["bounds"].split(","))
        return cls(fields["op"], int(fields["arg"]), bounds, int(fields["axis"]), int(data) if data else None)

    def first_violation(self, values: np.ndarray) -> tuple[int, int, int] | None:
        """(index, its bound, the data axis it indexes) of the first value of the index argument out of range."""
        width = len(self.bounds)
        rows = values.reshape(-1, width)
        limits = np.asarray(self.bounds, dtype=np.int64)
        bad = np.argwhere((rows < -limits) | (rows >= limits))
        if not bad.size:
            return None
        row, column = bad[0]
        return int(rows[row, column]), self.bounds[column], self.axis + int(column)


def parse_check(message: str) -> IndexCheck | None:
    """The check a failed kernel call reports in its error message, or None when the failure is another one."""
    at = message.find(MARKER)
    if at < 0:
        return None
    try:
        return IndexCheck.parse(message[at + len(MARKER):].splitlines()[0])
    except (KeyError, ValueError):
        return None


def _tvm():
    from ..tvm_env import tvm

    return tvm()


def argument_of(tensor) -> int | None:
    """The kernel argument whose elements are exactly `tensor`'s values (through views and integer casts), or None.

    Kernel arguments are TE placeholders named `in<k>` (backends/lower.py).
    """
    te = _tvm().te
    while True:
        op = tensor.op
        if isinstance(op, te.PlaceholderOp):
            match = re.fullmatch(r"in(\d+)", op.name)
            return int(match.group(1)) if match else None
        if not isinstance(op, te.ComputeOp) or len(op.input_tensors) != 1 or not _keeps_values(op, tensor.dtype):
            return None
        tensor = op.input_tensors[0]


# TOPI ops that only move or repeat their input's elements (Slice is not one: it drops some).
_VIEWS = ("T_reshape", "T_squeeze", "T_expand_dims", "T_transpose", "T_broadcast_to")


def _keeps_values(op, dtype) -> bool:
    """Whether `op` (one input) yields exactly its input's values: a view, a copy, or a cast between integer types."""
    tir = _tvm().tirx
    source = op.input_tensors[0]
    if op.name in _VIEWS:
        return source.dtype == dtype
    if op.name != "compute" or len(op.body) != 1:
        return False
    body = op.body[0]
    if isinstance(body, tir.Cast):
        if not (str(source.dtype).startswith("int") and str(dtype).startswith("int")):
            return False
        body = body.value
    loads = getattr(body, "op", None)
    if loads is None or loads.name != "te.tensor_load":
        return False
    axes = [iv.var for iv in op.axis]
    indices = list(body.args[1:])
    return len(indices) == len(axes) and all(i.same_as(a) for i, a in zip(indices, axes))


def checked_indices(ctx, indices, bounds: tuple[int, ...], axis: int, data):
    """(check, tensor to read the indices from) for a rule's indices (input 1, indexing `data` from `axis` on,
    within `bounds`: one for every index, or one per component of the indices' last axis).

    Indices that are a kernel argument are asserted before the kernel body. Indices computed inside the
    kernel are first stored (a block carrying the check) and asserted after the body; `position` clamps
    their reads meanwhile. On a GPU the check is None: `position` clamps. Constant indices are checked now.
    """
    constant = ctx.data(1)
    if constant is not None:
        _check_constant(ctx, IndexCheck(ctx.op_type, 1, bounds, axis, None), constant)
        return None, indices
    if ctx.gpu:
        return None, indices
    arg = argument_of(indices)
    if arg is not None:
        return IndexCheck(ctx.op_type, arg, bounds, axis, argument_of(data)), indices
    check = IndexCheck(ctx.op_type, -1, bounds, axis, argument_of(data))
    stored = _tvm().te.compute(indices.shape, lambda *i: indices(*i), name="checked_indices",
                               attrs={CHECK_ATTR: check.describe()})
    return check, stored


def check_attrs(check: IndexCheck | None) -> dict[str, str]:
    """The attributes of the compute that reads with the check (the CPU schedule reads them)."""
    return {CHECK_ATTR: check.describe()} if check is not None and check.arg >= 0 else {}


def position(indices, coordinates, dim: int, check: IndexCheck | None):
    """Where the index `indices[coordinates]` reads on an axis of length `dim`: negative values count from
    its end; indices not asserted before the body are clamped into the axis."""
    tir = _tvm().tirx
    index = indices[tuple(coordinates)]
    dim_expr = tir.const(dim, indices.dtype)
    wrapped = tir.Select(index < 0, index + dim_expr, index)
    if check is not None and check.arg >= 0:
        return wrapped
    return tir.max(tir.min(wrapped, dim_expr - 1), tir.const(0, indices.dtype))


def _check_constant(ctx, check: IndexCheck, values: np.ndarray) -> None:
    """Compile-time indices out of range fail the compile (they would fail every run)."""
    bad = check.first_violation(values)
    if bad is not None:
        index, bound, axis = bad
        raise ctx.fail(f"constant index {index} out of range [{-bound}, {bound - 1}] on axis {axis}")


def add_index_checks(func, checks: list[IndexCheck]):
    """`func` with a loop of assertions per check before its body (inside its root block, if it has one);
    the checks of indices stored in one of its buffers go after the body."""
    if not checks:
        return func
    tvm = _tvm()
    tir, s_tir = tvm.tirx, tvm.s_tir
    params = {p.name: p for p in func.params}
    before = [_assertions(tir, params[f"in{c.arg}"], c) for c in checks if c.arg >= 0]
    realize = func.body
    if not isinstance(realize, s_tir.SBlockRealize):
        return func.with_body(tir.SeqStmt([*before, realize])) if before else func
    block = realize.block
    stored = {b.name: b for b in block.alloc_buffers}
    after = [_assertions(tir, stored[c.buffer], c) for c in checks if c.arg < 0 and c.buffer in stored]
    body = tir.SeqStmt([*before, block.body, *after])
    block = s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, body, block.init,
                         block.alloc_buffers, block.match_buffers, block.annotations)
    return func.with_body(s_tir.SBlockRealize(realize.iter_values, realize.predicate, block))


def _assertions(tir, buffer, check: IndexCheck):
    """for each element v of `buffer`: assert -bound <= v < bound (TVM raises the message as IndexError)."""
    from tvm.ir import StringImm

    shape = [int(d) for d in buffer.shape]
    dtype = str(buffer.dtype)
    loop_vars = [tir.Var(f"check{k}", "int32") for k in range(len(shape))]
    value = tir.BufferLoad(buffer, loop_vars)
    bound = tir.const(check.bounds[-1], dtype)
    for component in range(len(check.bounds) - 2, -1, -1):  # per coordinate along the last axis
        bound = tir.Select(loop_vars[-1] == component, tir.const(check.bounds[component], dtype), bound)
    inside = tir.all(value >= -bound, value < bound)
    # AssertStmt's Python constructor passes its arguments in the wrong order in TVM 0.27: call the FFI directly.
    stmt = tir._ffi_api.AssertStmt(inside, StringImm("IndexError"), [StringImm(MARKER + check.describe())], None)
    for var, extent in reversed(list(zip(loop_vars, shape))):
        stmt = tir.For(var, 0, extent, tir.ForKind.SERIAL, stmt)
    # TVM's UnrollLoop counts stores, not assertions: a loop of assertions looks free and is unrolled
    # whole (a million indices took minutes to compile). A negative step budget keeps it a loop.
    return tir.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, stmt.body,
                   annotations={"pragma_auto_unroll_max_step": tir.IntImm("int32", -1)})
