"""The native host program: a worker's run loop compiled to machine code with llvmlite when the executor loads.

Every buffer has a fixed address once the executor is made (runtime/memory.py), so each kernel call's
arguments are built once — DLTensor structs and TVMFFIAny argument arrays in memory this object keeps
alive — and the program is straight-line code calling each kernel's C entry with those addresses as
constants (runtime/ffi_abi.py documents the calling convention). Views cost nothing (their buffers share
the address); an If loads its condition from the arena and branches; its branch's results are moved to
the If's outputs; an Assign is a memmove into its state buffer.

The program is one function per segment: a segment is a run of instructions the native code can do
(kernel calls with or without pieces, views, If, Fail, Assign). Transfers and collectives need Python
(torch.distributed) and run between segments. A segment function takes no argument and returns a
status: 0 when it ran to its end, else k + 1 where k indexes `sites`: the kernel call that failed
(its error is raised in the calling thread: ffi_abi.take_raised_error) or the Fail reached.

With `timed`, each kernel call is bracketed by clock_gettime(CLOCK_MONOTONIC) and its nanoseconds are
added to `kernel_ns[k]` (k its site): the kernels' own time, without the host's.

With `inputs` (a one-segment program: no transfers), the program also takes the run's input arrays, one
`PyObject*` per input (ctypes `py_object`; runtime/numpy_abi.py: where it reads their data pointer and
flags), and reads each where it lies when it can: `bound(*arrays, *outputs)` returns -1 (NOT_CONTIGUOUS) before
anything ran when an input array is not C-contiguous, else as a segment does. An input whose data pointer is as
aligned as every kernel reading it assumes (the same remainder as its arena slot modulo that alignment: TVM's
kernels assume 64-byte aligned arguments, `llvm.assume` "align" 64 on each, and those compiled to read a model input
assume numpy's 16, backends/kernel.py ARG_ALIGNMENT) has the address of every DLTensor that reads it or one of its
`aliases` (its views, slices of pieces) set into the array, at the same byte offset; any other array is
copied into the slot (a memmove) and those addresses set back to the slot, and so is an array lying in the
executor's own memory (`owned`). Only kernel arguments are so redirected, all of them read-only: an input read
by a branch condition or a move, or written by anything, is always copied (`in_place[k]`: whether input k may
be read in place). The caller's array is never written; a value the memory plan puts in the input's slot after
its last use is written to the arena as before.

With `outputs`, it then takes one array per model output, the mirror of the inputs: every DLTensor that writes or
reads an output's value (the value a top-level kernel writes, and its views: `BoundOutput.aliases`) is pointed at
the array when it is aligned as those kernels assume (kernels taking a model output assume 16 bytes), else at the
slot, and the slot is copied into the array at the end; an output with no aliases (another output shares its
value; an input, weight or state; written under an If or by an Assign) is copied from its buffer at the end
(`written_in_place[k]`). Given the executor's own buffer as the array, nothing moves. Every run sets every
redirected address again, so no run writes or reads an array another run was given. The no-argument
function of segment 0 (`run(0)`, `function`) runs the same code on the slots as they are written.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from . import ffi_abi
from .instructions import Assign, Fail, If, Instruction, KernelCall, View

CLOCK_MONOTONIC = 1
NOT_CONTIGUOUS = -1
ALIGNMENT = 64


@dataclass(frozen=True)
class BoundInput:
    """A model input the program takes per run: `buffer` its arena slot, `aliases` the names kernels read it by
    (itself and its views; empty: never read in place)."""

    buffer: np.ndarray
    aliases: frozenset[str] = frozenset()


@dataclass(frozen=True)
class BoundOutput:
    """A model output the program writes into an array it is given per run: `buffer` where the plan keeps it,
    `aliases` the names kernels write and read it by (the value a kernel writes, and its views, all of its size;
    empty: never written in place, copied from `buffer` at the end)."""

    buffer: np.ndarray
    aliases: frozenset[str] = frozenset()


def native_able(instruction: Instruction) -> bool:
    """Whether the native program runs the instruction (not a transfer or collective, nor an If holding one)."""
    if isinstance(instruction, If):
        return all(native_able(i) for _, branch in instruction.branches() for i in branch.instructions)
    return isinstance(instruction, (KernelCall, View, Fail, Assign))


@dataclass(frozen=True)
class Site:
    """Where a segment can stop: a kernel call (`arg_names` its piece's or its own inputs, `kernel` the key of the
    kernel it calls) or a Fail."""

    instruction: Instruction
    arg_names: tuple[str, ...] = ()
    kernel: str = ""


@dataclass
class _Call:
    entry: int
    arrays: list[np.ndarray]
    site: int
    names: tuple[str, ...]
    kernel: str
    first_arg: int = 0


@dataclass
class _Copy:
    destination: np.ndarray
    source: np.ndarray


@dataclass
class _Branch:
    condition: np.ndarray
    then_steps: list
    else_steps: list
    then_moves: list[tuple[np.ndarray, np.ndarray]]
    else_moves: list[tuple[np.ndarray, np.ndarray]]


class NativeHost:
    """The compiled run loop of one worker: `run(segment)` runs one segment and returns its status."""

    def __init__(self, segments: Sequence[Sequence[Instruction]], buffer: Callable[[str], np.ndarray],
                 entries: Mapping[str, int], timed: bool = False, inputs: Sequence[BoundInput] = (),
                 owned: Sequence[tuple[int, int]] = (), alignments: Mapping[str, Sequence[int]] | None = None,
                 outputs: Sequence[BoundOutput] = ()):
        """`buffer(name)` gives each value's host buffer (its address is baked in), `entries` each kernel key's
        C entry address (ffi_abi.kernel_entry); `inputs`: the arrays `bound` takes (one segment only); `owned`:
        the [start, end) address ranges of the executor's own memory (arena, weights, state). An input array
        overlapping one is copied, never read in place: the run may overwrite it (an output of an earlier run
        taken without a copy, fed back as the next run's state). `alignments`: kernel key → the alignment in bytes
        it assumes of each argument (its inputs, then its outputs), for kernels compiled to assume less than
        ALIGNMENT of some (backends/kernel.py ARG_ALIGNMENT). `outputs`: the output arrays `bound` takes after the
        inputs (one segment only)."""
        import llvmlite.binding as llvm
        import llvmlite.ir as ir

        if (inputs or outputs) and len(segments) != 1:
            raise ValueError("only a one-segment program takes its inputs and outputs")
        self._buffer, self._entries = buffer, entries
        self._alignments = alignments or {}
        self.sites: list[Site] = []
        self._calls: list[_Call] = []
        # Names read or written other than as kernel arguments (conditions, moves, Assigns): never redirected.
        self._special: set[str] = set()
        # Names kernels write: an input is never redirected to one, an output only to the one a kernel writes.
        self._written: set[str] = set()
        plans = [self._plan(list(segment)) for segment in segments]
        self._pack_arguments()
        self._inputs = list(inputs)
        self._outputs = list(outputs)
        self._owned = list(owned)
        self.in_place = [self._redirects(spec) is not None for spec in self._inputs]
        # Whether each output is written where the array given lies (when it is aligned enough), not copied there.
        self.written_in_place = [self._redirects(spec) is not None for spec in self._outputs]
        self.kernel_ns = np.zeros(max(len(self.sites), 1), np.int64) if timed else None
        self._ir = ir
        module = ir.Module("tessel_host")
        for index, steps in enumerate(plans):
            self._emit_segment(module, f"segment{index}", steps, *((self._inputs, self._outputs) if index == 0 else ((), ())))
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        parsed = llvm.parse_assembly(str(module))
        parsed.verify()
        machine = llvm.Target.from_default_triple().create_target_machine(opt=1)
        self._engine = llvm.create_mcjit_compiler(parsed, machine)
        self._engine.finalize_object()
        prototype = ctypes.CFUNCTYPE(ctypes.c_int32)
        self._functions = [prototype(self._engine.get_function_address(f"segment{k}")) for k in range(len(plans))]
        self.bound: Callable[..., int] | None = None
        if self._inputs or self._outputs:
            taking = ctypes.CFUNCTYPE(ctypes.c_int32, *[ctypes.py_object] * (len(self._inputs) + len(self._outputs)))
            self.bound = taking(self._engine.get_function_address("segment0_arrays"))

    def run(self, segment: int) -> int:
        """Run segment `segment`; 0, or 1 + the index in `sites` of where it stopped."""
        return self._functions[segment]()

    @property
    def function(self) -> Callable[[], int]:
        """The first segment's function (the whole program when it has one segment): status = function()."""
        return self._functions[0]

    # ---- planning: instructions → calls with their argument buffers ------------
    def _plan(self, instructions: list[Instruction]) -> list:
        steps: list = []
        for instruction in instructions:
            if isinstance(instruction, View):
                continue
            if isinstance(instruction, KernelCall):
                steps.extend(self._plan_call(instruction))
            elif isinstance(instruction, If):
                branches = dict(instruction.branches())
                outputs = [self._buffer(n) for n in instruction.outputs]
                moves = {field: [(out, self._buffer(r)) for out, r in zip(outputs, branch.results)]
                         for field, branch in branches.items()}
                self._special.update((instruction.condition, *instruction.outputs,
                                    *(r for branch in branches.values() for r in branch.results)))
                steps.append(_Branch(self._buffer(instruction.condition),
                                     self._plan(list(branches["then_branch"].instructions)),
                                     self._plan(list(branches["else_branch"].instructions)),
                                     moves["then_branch"], moves["else_branch"]))
            elif isinstance(instruction, Fail):
                steps.append(self._site(Site(instruction)))
            elif isinstance(instruction, Assign):
                self._special.update((instruction.src, instruction.dst))
                steps.append(_Copy(self._buffer(instruction.dst), self._buffer(instruction.src)))
            else:
                raise ValueError(f"{type(instruction).__name__} at node {instruction.node!r} does not run natively")
        return steps

    def _site(self, site: Site) -> int:
        self.sites.append(site)
        return len(self.sites) - 1

    def _plan_call(self, call: KernelCall) -> list[_Call]:
        self._written.update(call.outputs)
        if not call.pieces:
            names = call.inputs + call.outputs
            return [self._add_call(call.kernel, [self._buffer(n) for n in names], names, Site(call, call.inputs, call.kernel))]
        calls = []
        for piece in call.pieces:
            sliced, start, stop = set(piece.sliced), piece.start, piece.start + piece.size
            names = piece.inputs + call.outputs
            arrays = [self._buffer(n)[start:stop] if n in sliced else self._buffer(n) for n in names]
            calls.append(self._add_call(piece.kernel, arrays, names, Site(call, piece.inputs, piece.kernel)))
        return calls

    def _add_call(self, kernel: str, arrays: list[np.ndarray], names: tuple[str, ...], site: Site) -> _Call:
        for array in arrays:
            if not array.flags.c_contiguous:
                raise ValueError("a kernel argument is not contiguous")
        call = _Call(self._entries[kernel], arrays, self._site(site), names, kernel)
        self._calls.append(call)
        return call

    def _pack_arguments(self) -> None:
        """One DLTensor and one TVMFFIAny per argument, each call's TVMFFIAny contiguous: built once, kept alive."""
        count = sum(len(c.arrays) for c in self._calls)
        dims = sum(a.ndim for c in self._calls for a in c.arrays)
        self._tensors = np.zeros(max(count, 1), ffi_abi.DLTENSOR)
        self._shapes = np.zeros(max(dims, 1), np.int64)
        self._args = np.zeros(max(count, 1), ffi_abi.ANY)
        self._result = np.zeros(1, ffi_abi.ANY)
        slot, dim = 0, 0
        for call in self._calls:
            call.first_arg = slot
            for array in call.arrays:
                code, bits, lanes = ffi_abi.dl_dtype(array.dtype)
                self._shapes[dim:dim + array.ndim] = array.shape
                self._tensors[slot] = (array.ctypes.data, ffi_abi.DEVICE_CPU, 0, array.ndim, code, bits, lanes,
                                       self._shapes.ctypes.data + 8 * dim, 0, 0)
                self._args[slot] = (ffi_abi.TYPE_INDEX_DLTENSOR_PTR, 0,
                                    self._tensors.ctypes.data + slot * ffi_abi.DLTENSOR.itemsize)
                slot, dim = slot + 1, dim + array.ndim

    def _redirects(self, spec: BoundInput | BoundOutput) -> list[tuple[int, int]] | None:
        """(DLTensor index, byte offset from the value's slot) of every kernel argument that reads the input (or
        writes or reads the output), or None when it must stay in its slot (it has no aliases, or one is read or
        written otherwise; an input written at all)."""
        fixed = self._special | self._written if isinstance(spec, BoundInput) else self._special
        if not spec.aliases or spec.aliases & fixed:
            return None
        start = spec.buffer.ctypes.data
        return [(call.first_arg + k, array.ctypes.data - start) for call in self._calls
                for k, (name, array) in enumerate(zip(call.names, call.arrays)) if name in spec.aliases]

    def _alignment(self, spec: BoundInput | BoundOutput) -> int:
        """The alignment (bytes) an array needs to be read (an input) or written (an output) in place: the most any
        kernel taking it assumes of that argument (ALIGNMENT unless the kernel was compiled to assume less), and
        ALIGNMENT when no kernel call takes it (only other instructions, a view nothing calls a kernel on)."""
        return max(((self._alignments.get(call.kernel, ())[k:k + 1] or (ALIGNMENT,))[0] for call in self._calls
                    for k, name in enumerate(call.names) if name in spec.aliases), default=ALIGNMENT)

    # ---- code -------------------------------------------------------------
    def _emit_segment(self, module, name: str, steps: list, inputs: Sequence[BoundInput] = (),
                      outputs: Sequence[BoundOutput] = ()) -> None:
        """The segment's function; with `inputs` or `outputs`, as `NAME_arrays` taking them, and NAME calling it on
        the slots."""
        ir = self._ir
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        taking = len(inputs) + len(outputs)
        function = ir.Function(module, ir.FunctionType(i32, [i8p] * taking), f"{name}_arrays" if taking else name)
        builder = ir.IRBuilder(function.append_basic_block("entry"))
        self._clock = builder.alloca(ir.LiteralStructType([ir.IntType(64), ir.IntType(64)])) if self.kernel_ns is not None else None
        if inputs:
            self._emit_inputs(builder, function, function.args[:len(inputs)], inputs)
        copies = self._emit_outputs(builder, function.args[len(inputs):], outputs) if outputs else []
        self._emit_steps(builder, function, steps)
        for destination, spec in copies:
            self._emit_copy_out(builder, destination, spec)
        builder.ret(ir.Constant(i32, 0))
        if taking:
            # The no-argument entry: every input already in its slot, every output left in its (NULL: the slot).
            plain = ir.Function(module, ir.FunctionType(i32, []), name)
            caller = ir.IRBuilder(plain.append_basic_block("entry"))
            caller.ret(caller.call(function, [ir.Constant(i8p, None)] * taking))

    def _emit_inputs(self, builder, function, arguments, inputs: Sequence[BoundInput]) -> None:
        """Refuse a non-contiguous array; then read each array in place or copy it into its slot, and point the
        DLTensors that read it at where it is."""
        from .numpy_abi import C_CONTIGUOUS, DATA_OFFSET, FLAGS_OFFSET

        ir = self._ir
        i8p, i32, i64 = ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(64)
        base = builder.alloca(i64)
        for argument in arguments:
            given = builder.icmp_unsigned("!=", argument, ir.Constant(i8p, None))
            with builder.if_then(given):
                flags = builder.load(builder.bitcast(builder.gep(argument, [ir.Constant(i64, FLAGS_OFFSET)]), i32.as_pointer()))
                contiguous = builder.icmp_unsigned("!=", builder.and_(flags, ir.Constant(i32, C_CONTIGUOUS)), ir.Constant(i32, 0))
                refused, fine = function.append_basic_block("not_contiguous"), function.append_basic_block("contiguous")
                builder.cbranch(contiguous, fine, refused)
                builder.position_at_end(refused)
                builder.ret(ir.Constant(i32, NOT_CONTIGUOUS))
                builder.position_at_end(fine)
        for argument, spec in zip(arguments, inputs):
            slot = ir.Constant(i64, spec.buffer.ctypes.data)
            redirects = self._redirects(spec)
            builder.store(slot, base)
            given = builder.icmp_unsigned("!=", argument, ir.Constant(i8p, None))
            with builder.if_then(given):
                data = builder.load(builder.bitcast(builder.gep(argument, [ir.Constant(i64, DATA_OFFSET)]), i64.as_pointer()))
                if redirects is None:
                    self._emit_copy(builder, slot, data, spec.buffer.nbytes)
                else:
                    # The slot is ALIGNMENT-aligned, and every argument reading the input lies at the same offset from
                    # the array as from the slot: the array's remainder modulo what the kernels assume decides.
                    alignment = self._alignment(spec)
                    aligned = builder.icmp_unsigned("==", builder.and_(builder.sub(data, slot), ir.Constant(i64, alignment - 1)),
                                                    ir.Constant(i64, 0))
                    end = builder.add(data, ir.Constant(i64, spec.buffer.nbytes))
                    for start, stop in self._owned:
                        apart = builder.or_(builder.icmp_unsigned("<=", end, ir.Constant(i64, start)),
                                            builder.icmp_unsigned(">=", data, ir.Constant(i64, stop)))
                        aligned = builder.and_(aligned, apart)
                    with builder.if_else(aligned) as (in_place, copied):
                        with in_place:
                            builder.store(data, base)
                        with copied:
                            self._emit_copy(builder, slot, data, spec.buffer.nbytes)
            if redirects:
                self._emit_redirects(builder, builder.load(base), redirects)

    def _emit_redirects(self, builder, address, redirects: list[tuple[int, int]]) -> None:
        """Point each DLTensor of `redirects` at `address` plus its offset."""
        i64 = self._ir.IntType(64)
        for index, offset in redirects:
            field = self._tensors.ctypes.data + index * ffi_abi.DLTENSOR.itemsize  # `data` is its first field
            builder.store(builder.add(address, self._ir.Constant(i64, offset)), self._pointer(builder, field, i64.as_pointer()))

    def _emit_outputs(self, builder, arguments, outputs: Sequence[BoundOutput]) -> list:
        """Point the DLTensors that write (and read) each output at the array given for it when it is aligned enough,
        else at its slot; returns (where the array's address is kept, or 0 when nothing is to be copied, the output)
        for the copies out of the slots at the end. The arrays are C-contiguous ones the executor made (or its own
        buffers: then nothing moves)."""
        from .numpy_abi import DATA_OFFSET

        ir = self._ir
        i8p, i64 = ir.IntType(8).as_pointer(), ir.IntType(64)
        copies = []
        for argument, spec in zip(arguments, outputs):
            slot = ir.Constant(i64, spec.buffer.ctypes.data)
            redirects = self._redirects(spec)
            base, destination = builder.alloca(i64), builder.alloca(i64)
            builder.store(slot, base)
            builder.store(ir.Constant(i64, 0), destination)
            given = builder.icmp_unsigned("!=", argument, ir.Constant(i8p, None))
            with builder.if_then(given):
                data = builder.load(builder.bitcast(builder.gep(argument, [ir.Constant(i64, DATA_OFFSET)]), i64.as_pointer()))
                elsewhere = builder.icmp_unsigned("!=", data, slot)
                if redirects is None:
                    with builder.if_then(elsewhere):
                        builder.store(data, destination)
                else:
                    aligned = builder.icmp_unsigned("==", builder.and_(builder.sub(data, slot),
                                                                       ir.Constant(i64, self._alignment(spec) - 1)),
                                                    ir.Constant(i64, 0))
                    with builder.if_else(aligned) as (in_place, copied):
                        with in_place:
                            builder.store(data, base)
                        with copied:
                            builder.store(data, destination)
            if redirects:
                self._emit_redirects(builder, builder.load(base), redirects)
            copies.append((destination, spec))
        return copies

    def _emit_copy_out(self, builder, destination, spec: BoundOutput) -> None:
        """Copy an output from its slot into the array given for it, when one was and it is not written in place."""
        ir = self._ir
        i64 = ir.IntType(64)
        address = builder.load(destination)
        with builder.if_then(builder.icmp_unsigned("!=", address, ir.Constant(i64, 0))):
            self._emit_copy(builder, address, ir.Constant(i64, spec.buffer.ctypes.data), spec.buffer.nbytes)

    def _emit_copy(self, builder, destination, source, nbytes: int) -> None:
        """Copy `nbytes` from address `source` to `destination` (a memmove: the caller's array may overlap the
        slot, as an output of the last run taken without a copy does)."""
        ir = self._ir
        i8p, i64 = ir.IntType(8).as_pointer(), ir.IntType(64)
        module = builder.module
        memmove = module.globals.get("llvm.memmove.p0.p0.i64") or ir.Function(
            module, ir.FunctionType(ir.VoidType(), [i8p, i8p, i64, ir.IntType(1)]), "llvm.memmove.p0.p0.i64")
        builder.call(memmove, [builder.inttoptr(destination, i8p), builder.inttoptr(source, i8p),
                               ir.Constant(i64, nbytes), ir.Constant(ir.IntType(1), 0)])

    def _emit_steps(self, builder, function, steps: list) -> None:
        for step in steps:
            if isinstance(step, _Call):
                self._emit_call(builder, function, step)
            elif isinstance(step, _Branch):
                self._emit_branch(builder, function, step)
            elif isinstance(step, _Copy):
                self._emit_moves(builder, [(step.destination, step.source)])
            else:  # a Fail: stop with its site
                self._emit_stop(builder, function, step)

    def _pointer(self, builder, address: int, type_=None):
        ir = self._ir
        return builder.inttoptr(ir.Constant(ir.IntType(64), address), type_ or ir.IntType(8).as_pointer())

    def _emit_call(self, builder, function, call: _Call) -> None:
        ir = self._ir
        i8p, i32, i64 = ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(64)
        kernel_type = ir.FunctionType(i32, [i8p, i8p, i32, i8p])
        result = self._result.ctypes.data
        builder.store(ir.Constant(i32, ffi_abi.TYPE_INDEX_NONE), self._pointer(builder, result, i32.as_pointer()))
        started = self._now(builder) if self.kernel_ns is not None else None
        status = builder.call(self._pointer(builder, call.entry, kernel_type.as_pointer()),
                              [ir.Constant(i8p, None),
                               self._pointer(builder, self._args.ctypes.data + call.first_arg * ffi_abi.ANY.itemsize),
                               ir.Constant(i32, len(call.arrays)), self._pointer(builder, result)])
        if started is not None:
            slot = self._pointer(builder, self.kernel_ns.ctypes.data + 8 * call.site, i64.as_pointer())
            builder.store(builder.add(builder.load(slot), builder.sub(self._now(builder), started)), slot)
        failed, done = function.append_basic_block("failed"), function.append_basic_block("next")
        builder.cbranch(builder.icmp_signed("!=", status, ir.Constant(i32, 0)), failed, done)
        builder.position_at_end(failed)
        builder.ret(ir.Constant(i32, call.site + 1))
        builder.position_at_end(done)

    def _emit_stop(self, builder, function, site: int) -> None:
        ir = self._ir
        builder.ret(ir.Constant(ir.IntType(32), site + 1))
        # Code after a Fail is unreachable; it goes into a block of its own so the function stays well formed.
        builder.position_at_end(function.append_basic_block("after_fail"))

    def _emit_branch(self, builder, function, branch: _Branch) -> None:
        ir = self._ir
        condition = branch.condition
        if condition.dtype.kind == "f":
            kind = {2: ir.HalfType(), 4: ir.FloatType(), 8: ir.DoubleType()}[condition.dtype.itemsize]
            value = builder.load(self._pointer(builder, condition.ctypes.data, kind.as_pointer()))
            taken = builder.fcmp_unordered("!=", value, ir.Constant(kind, 0.0))
        else:
            kind = ir.IntType(8 * condition.dtype.itemsize)
            value = builder.load(self._pointer(builder, condition.ctypes.data, kind.as_pointer()))
            taken = builder.icmp_unsigned("!=", value, ir.Constant(kind, 0))
        with builder.if_else(taken) as (then, otherwise):
            with then:
                self._emit_steps(builder, function, branch.then_steps)
                self._emit_moves(builder, branch.then_moves)
            with otherwise:
                self._emit_steps(builder, function, branch.else_steps)
                self._emit_moves(builder, branch.else_moves)

    def _emit_moves(self, builder, moves: list[tuple[np.ndarray, np.ndarray]]) -> None:
        ir = self._ir
        i8p, i64 = ir.IntType(8).as_pointer(), ir.IntType(64)
        module = builder.module
        memmove = module.globals.get("llvm.memmove.p0.p0.i64") or ir.Function(
            module, ir.FunctionType(ir.VoidType(), [i8p, i8p, i64, ir.IntType(1)]), "llvm.memmove.p0.p0.i64")
        for destination, source in moves:
            if destination.ctypes.data != source.ctypes.data:
                builder.call(memmove, [self._pointer(builder, destination.ctypes.data),
                                       self._pointer(builder, source.ctypes.data),
                                       ir.Constant(i64, destination.nbytes), ir.Constant(ir.IntType(1), 0)])

    def _now(self, builder):
        """Nanoseconds of CLOCK_MONOTONIC (clock_gettime from the C library, called by address)."""
        ir = self._ir
        i32, i64 = ir.IntType(32), ir.IntType(64)
        clock_type = ir.FunctionType(i32, [i32, self._clock.type])
        address = ctypes.cast(ctypes.CDLL(None).clock_gettime, ctypes.c_void_p).value
        builder.call(self._pointer(builder, address, clock_type.as_pointer()), [ir.Constant(i32, CLOCK_MONOTONIC), self._clock])
        seconds = builder.load(builder.gep(self._clock, [ir.Constant(i32, 0), ir.Constant(i32, 0)]))
        nanoseconds = builder.load(builder.gep(self._clock, [ir.Constant(i32, 0), ir.Constant(i32, 1)]))
        return builder.add(builder.mul(seconds, ir.Constant(i64, 1_000_000_000)), nanoseconds)
