"""The executor: runs one worker's instruction program (runtime/instructions.py).

Every buffer is allocated once, 64-byte aligned, when the executor is made;
weights are loaded once, and so is a training artifact's persistent state (its
buffers live outside the arena and keep what each run's Assigns and updates write:
`state()`, `set_state()`); each run copies the inputs in (the native host of a
one-worker program reads each input array in place instead when it is as aligned
as the kernels assume: runtime/native_host.py), runs the instructions
in order on pre-bound arguments (kernel calls, views, branches, and with other
workers, transfers and collectives over `comm`), and copies the outputs out (that
native host has its kernels write each output into the run's fresh array instead,
where it can).

Two hosts run the instructions. "native" (the default for host memory) compiles
the run loop to machine code when the executor loads (runtime/native_host.py):
one call from Python per run, or per segment between transfers and collectives.
"python" calls a bound closure per instruction: the fallback, what `profile`
times, and the host of artifacts whose buffers live on a GPU.

A Send is not waited for at the end of its run: the next run waits for it
right before it first overwrites the sent bytes (runtime/held_sends.py), so a
pipeline stage starts micro-batch k + 1 while the next stage still takes k.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from tessel.ir.types import TensorType, numpy_dtype

from .artifact_files import PLAN_FILE, read_plan, verify_files, worker_state_names
from .device_inputs import on_gpu, shape_and_dtype
from .early_receives import EarlyReceive
from .errors import ArtifactError, ExecutionError, InputError
from .ffi_abi import kernel_entry, take_raised_error
from .graph_names import member_name
from .held_sends import HeldSends, held_send_names, wait_points
from .instructions import (AllReduce, Assign, Fail, Gather, If, Instruction, KernelCall, Recv, Scatter, Send, View,
                           kernel_keys, program_from_json, reads_within, walk)
from .load_transforms import transformed
from .memory import HostMemory
from .native_host import NOT_CONTIGUOUS, BoundInput, BoundOutput, NativeHost, native_able
from .numpy_abi import layout_holds

Op = Callable[[], None]
HOSTS = ("native", "python")
# The most inputs and outputs the native program takes as arguments, one each (ctypes calls a function of at most
# 1024): a model with more has its inputs copied into their slots and its outputs copied out of theirs.
MAX_TAKEN_ARRAYS = 256


class Executor:
    """Runs one worker's program of an artifact directory: llvm kernels on host memory, cuda kernels on GPU memory."""

    def __init__(self, directory: str | Path, threads: int | None = None, worker: int = 0, comm=None,
                 memory_device: str | None = None, host: str = "native", device: int = 0, kernels_only: bool = False):
        """`worker` picks the program of a multi-worker artifact; `comm` (runtime/comm.py) carries its transfers
        and collectives. `memory_device` ("cpu", "cuda") puts the buffers in TVM memory on that device; by
        default host numpy memory for llvm artifacts and the GPU for cuda ones. `host` ("native", "python")
        picks what runs the instructions; buffers outside host memory always run on the python host
        (`self.host` says which one runs). `device`: the index of that device (a worker's GPU). `kernels_only`
        loads a worker's program without `comm` only to time its kernels (`kernel_site_seconds`): its transfers
        and collectives raise if run, those at load time are left out."""
        from tessel.backends.tvm_env import set_threads, tvm

        if host not in HOSTS:
            raise ValueError(f"host must be one of {', '.join(HOSTS)}, not {host!r}")
        if threads is not None:
            set_threads(threads)
        self._tvm = tvm()
        self.directory = Path(directory)
        self.artifact_plan = read_plan(self.directory)
        verify_files(self.directory, self.artifact_plan)
        workers = self.artifact_plan["workers"]
        if not 0 <= worker < len(workers):
            raise ArtifactError(f"{self.directory}: the artifact has {len(workers)} worker(s), not worker {worker}")
        # The artifact's settings with this worker's program (inputs, outputs, values, memory, weights).
        self.plan = {**{k: v for k, v in self.artifact_plan.items() if k != "workers"}, **workers[worker]}
        self.worker = worker
        self.instructions = program_from_json(self.plan["instructions"])
        self._comm = comm
        self._kernels_only = kernels_only
        self._arriving: dict[str, tuple[np.ndarray, Callable[[], None]]] = {}
        memory = self.plan.get("memory", {"arena_bytes": 0, "offsets": {}})
        # One arena holds every activation at its planned offset: no allocation per run.
        self._memory = self._make_memory(int(memory["arena_bytes"]), memory_device, device)
        self._kernels = self._load_kernels()
        self._buffers: dict[str, Any] = {}
        self._tensors: dict[str, Any] = {}
        self._types = {name: TensorType.parse(spec) for name, spec in self.plan["values"].items()}
        self._offsets: dict[str, int] = memory["offsets"]
        self._load_weights()
        self._load_state()
        # The run's top-level Recvs (not those in an If's branch) can post the next run's receive early.
        self._top_receives = {id(i) for i in self.instructions if isinstance(i, Recv) and not i.runs_at_load}
        self._early: list[EarlyReceive] = []
        # Instructions that read only weights run once, now; the others on every run.
        at_load = [i for i in self.instructions if i.runs_at_load and (not kernels_only or native_able(i))]
        for op in self._bind(at_load):
            op()
        self.run_instructions = [i for i in self.instructions if not i.runs_at_load]
        # Asynchronous all-reduces started and not yet waited for: result name -> its wait.
        self._reducing: dict[str, Callable[[], None]] = {}
        self._unread_results = self._unread_reductions()
        self._read_next = {id(self.run_instructions[k]) for k in reductions_read_next(self.run_instructions)}
        # Top-level Sends stay in flight past the run's end, until the next run first writes their bytes.
        self._held = HeldSends()
        self._held_names = held_send_names(self.run_instructions) if comm is not None else ()
        self._ops = self._bind(self.run_instructions)
        self._send_waits = wait_points(self.run_instructions, self._held_names, self.plan["inputs"], self._buffer)
        self._inputs = [(name, self._buffer(name), self._types[name].shape, np.dtype(numpy_dtype(self._types[name].dtype)))
                        for name in self.plan["inputs"]]
        self._input_names = frozenset(self.plan["inputs"])
        self._timed = None
        self._assemble_steps(native=host == "native" and isinstance(self._memory, HostMemory))
        self.host = "native" if self._native is not None else "python"

    def _assemble_steps(self, native: bool, per_instruction: bool = False) -> None:
        """The run's steps: one per instruction on the python host; with `native`, native segments (each
        instruction one of its own when `per_instruction`) and the Python instructions between them; each step
        waiting for the held sends and all-reduces it needs."""
        # The instructions each step runs: one each, until the native host joins them into segments.
        self._covered: list[list[Instruction]] = [[i] for i in self.run_instructions]
        self._native = None
        self._steps: list[Op] = self._ops
        self._whole_native: Callable[[], int] | None = None
        # The whole native program taking the input arrays themselves (reading them in place when it can), then the
        # output arrays (writing them in place when it can, else copying into them).
        self._taking_inputs: Callable[..., int] | None = None
        if native:
            self._use_native_host(per_instruction)
        if self._send_waits.before:
            self._steps = self._waiting_for_sends(self._steps, self._covered)
        if any(isinstance(i, AllReduce) for i in self.run_instructions):
            self._steps = self._waiting_for_reductions(self._steps, self._covered)

    def _make_memory(self, arena_bytes: int, memory_device: str | None, device: int):
        if memory_device is None and not str(self.plan["target"]).startswith("cuda"):
            return HostMemory(arena_bytes)
        from .device_memory import DeviceMemory

        return DeviceMemory(self._tvm.device(memory_device or "cuda", device), arena_bytes)

    # ---- loading ------------------------------------------------------------
    def _load_kernels(self) -> dict[str, Any]:
        if str(self.plan["target"]).startswith("cuda"):
            from tessel.backends.tvm_env import enable_cuda

            enable_cuda()  # a runtime-only TVM registers no CUDA module loader by itself
        kernels = {}
        self._entries: dict[str, int] = {}
        # The alignment in bytes each kernel assumes of each argument's data, where the plan says (else ALIGNMENT).
        self._alignments: dict[str, tuple[int, ...]] = {
            key: tuple(entry["arg_alignment"]) for key, entry in self.plan["kernels"].items() if "arg_alignment" in entry}
        used = set(kernel_keys(self.instructions))
        for key, entry in self.plan["kernels"].items():
            if key not in used:
                continue
            path = self.directory / entry["file"]
            try:
                kernels[key] = self._tvm.runtime.load_module(str(path))["main"]
                if not str(self.plan["target"]).startswith("cuda"):
                    self._entries[key] = kernel_entry(path)
            except Exception as exc:  # noqa: BLE001 - a broken library must not crash the caller
                raise ArtifactError(f"{path}: cannot load kernel library ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from exc
        return kernels

    def _load_weights(self) -> None:
        path = self.directory / self.plan["weights"]["file"]
        try:
            with np.load(path, allow_pickle=False) as weights:
                at_load = self.plan["weights"].get("at_load", {})
                for name in self.plan["weights"]["names"]:
                    array = weights[name]
                    if name in at_load:  # stored in its own form (runtime/load_transforms.py)
                        array = transformed(at_load[name], array)
                    self._buffers[name] = self._memory.weight(array)
        except (OSError, ValueError, KeyError) as exc:
            raise ArtifactError(f"{path}: cannot read weights ({exc})") from exc

    def _load_state(self) -> None:
        state = self.artifact_plan.get("state")
        # This worker's state names, in the plan's order: parameters, optimizer slots, running statistics.
        self.state_names: tuple[str, ...] = tuple(worker_state_names(self.artifact_plan, self.worker)) if state else ()
        if state is None:
            return
        path = self.directory / state["file"]
        try:
            with np.load(path, allow_pickle=False) as arrays:
                for name in self.state_names:
                    self._buffers[name] = self._memory.weight(arrays[name])
        except (OSError, ValueError, KeyError) as exc:
            raise ArtifactError(f"{path}: cannot read the state ({exc})") from exc

    def state(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Copies of the persistent state's current values by name (all of them, or those in `names`)."""
        return {name: self._memory.read(self._buffers[name]) for name in (self.state_names if names is None else names)}

    def set_state(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite state values by name (others keep theirs); each must have the type the plan gives it."""
        unknown = sorted(set(values) - set(self.state_names))
        if unknown:
            raise InputError(f"'{unknown[0]}' is not a state value of this artifact; it holds "
                             f"{', '.join(self.state_names) or 'no state'}")
        for name, array in values.items():
            array, want = np.asarray(array), self._types[name]
            if array.shape != want.shape or array.dtype != numpy_dtype(want.dtype):
                raise InputError(f"state '{name}' is {array.dtype}[{','.join(map(str, array.shape))}], "
                                 f"the artifact holds {want.spec()}")
            if name in self._held_names:
                self._held.wait([name])
            self._memory.write(self._buffers[name], array)

    def _buffer(self, name: str):
        if name not in self._buffers:
            t = self._types[name]
            dtype = numpy_dtype(t.dtype)
            if name in self._offsets:
                self._buffers[name] = self._memory.at(self._offsets[name], t.shape, dtype)
            else:
                self._buffers[name] = self._memory.empty(t.shape, dtype)
        return self._buffers[name]

    @property
    def arena_bytes(self) -> int:
        """Size of the activation arena."""
        return self._memory.arena_bytes

    def poison(self) -> None:
        """Fill the arena with NaN bit patterns: a kernel reading memory nobody wrote gives NaN (a test aid)."""
        self.finish_sends()
        self._memory.fill(0xFF)

    def _tensor(self, name: str):
        if name not in self._tensors:
            self._tensors[name] = self._memory.tensor(self._buffer(name))
        return self._tensors[name]

    # ---- binding ------------------------------------------------------------
    def _bind(self, instructions: list[Instruction]) -> list[Op]:
        return [self._bind_one(instruction) for instruction in instructions]

    def _bind_one(self, instruction: Instruction) -> Op:
        if isinstance(instruction, View):
            t = self._types[instruction.output]
            self._buffers[instruction.output] = self._memory.reshape(self._buffer(instruction.input), t.shape)
            return _nothing
        if isinstance(instruction, KernelCall):
            return self._bind_pieces(instruction) if instruction.pieces else self._bind_kernel(instruction)
        if isinstance(instruction, If):
            return self._bind_if(instruction)
        if isinstance(instruction, Assign):
            memory, source, destination = self._memory, self._buffer(instruction.src), self._buffer(instruction.dst)
            return lambda: memory.copy(destination, source)
        if isinstance(instruction, Fail):
            message = instruction.message

            def fail() -> None:
                raise ExecutionError(message)

            return fail
        if self._comm is None and self._kernels_only:
            return _refused(instruction)
        if self._comm is None:
            raise ArtifactError(f"{self.directory}: worker {self.worker} exchanges tensors with other workers; "
                                "run it with its workers (tessel run DIR, or Artifact.run)")
        if isinstance(instruction, (Send, Recv)):
            return self._bind_transfer(instruction)
        if isinstance(instruction, Scatter):
            return self._bind_scatter(instruction)
        if isinstance(instruction, Gather):
            return self._bind_gather(instruction)
        if isinstance(instruction, AllReduce):
            return self._bind_all_reduce(instruction)
        raise ArtifactError(f"{PLAN_FILE}: no way to run {type(instruction).__name__} at node {instruction.node!r}")

    def _bind_all_reduce(self, instruction: AllReduce) -> Op:
        """Start the reduction in place, or into `output` (the tensor copied there first), in the background:
        the step that first reads the result waits for it (`_waiting_for_reductions`), so the reduction runs
        while the kernels in between do (a training step's gradients, while the rest of backward runs).
        A reduction the next instruction reads has nothing to overlap: it runs at once on this thread
        (`reductions_read_next`)."""
        comm, memory, reduction, name = self._comm, self._memory, instruction.reduction, instruction.tensor
        source = self._buffer(instruction.tensor)
        result = instruction.output or instruction.tensor
        # A result nothing reads gets a buffer of its own: no later value shares its bytes, so the run's end waits.
        target = self._memory.empty(source.shape, source.dtype) if result in self._unread_results else self._buffer(result)
        reducing, at_once = self._reducing, id(instruction) in self._read_next
        if instruction.compression != "none" and not isinstance(memory, HostMemory):
            raise ArtifactError(f"{self.directory}: all-reduce '{name}' is compressed ({instruction.compression}), "
                                "which runs on host memory only; compile without compression for a GPU")

        def start_all_reduce() -> None:
            if target is not source:
                memory.copy(target, source)
            if instruction.compression != "none":
                reducing[result] = comm.start_compressed_mean(target, instruction, name)
            elif at_once:
                comm.all_reduce(target, reduction, name)
                reducing[result] = _nothing
            else:
                reducing[result] = comm.start_all_reduce(target, reduction, name)

        return start_all_reduce

    def _unread_reductions(self) -> frozenset[str]:
        """The results of all-reduces into another value that nothing reads (a peer's copy of the loss, where the loss
        has an all-reduce of its own)."""
        read_later = set(self.plan["outputs"])
        unread = set()
        for instruction in reversed(self.run_instructions):
            if isinstance(instruction, AllReduce) and instruction.output and instruction.output not in read_later:
                unread.add(instruction.output)
            read_later |= reads_within(instruction)
        return frozenset(unread)

    def _waiting_for_reductions(self, steps: list[Op], covered: list[list[Instruction]]) -> list[Op]:
        """The steps (each running the instructions `covered` lists), each one that first reads the result of an
        earlier step's all-reduce waiting for that reduction before it runs. A result nothing reads is waited for
        at the run's end when it has a buffer of its own (`_unread_reductions`), else at once: its buffer is free
        for other values right after."""
        read_later = set(self.plan["outputs"]) | self._unread_results
        unread: list[list[str]] = []
        for instructions in reversed(covered):
            results = [i.output or i.tensor for i in instructions if isinstance(i, AllReduce)]
            unread.append([name for name in results if name not in read_later])
            read_later |= set().union(*(reads_within(i) for i in instructions))
        unread.reverse()
        started: set[str] = set()
        waiting = []
        for step, instructions, at_once in zip(steps, covered, unread):
            read = set().union(*(reads_within(i) for i in instructions))
            due = sorted(started & read)
            started -= read
            waiting.append(self._around_reductions(due, step, at_once) if due or at_once else step)
            started |= {i.output or i.tensor for i in instructions if isinstance(i, AllReduce)} - set(at_once)
        return waiting

    def _around_reductions(self, before: list[str], step: Op, after: list[str]) -> Op:
        """`step`, after waiting for the reductions `before` names, then waiting for those `after` names."""
        reducing = self._reducing

        def wait_around_step() -> None:
            for name in before:
                reducing.pop(name)()
            step()
            for name in after:
                reducing.pop(name)()

        return wait_around_step

    def _waiting_for_sends(self, steps: list[Op], covered: list[list[Instruction]]) -> list[Op]:
        """The steps, each one that first overwrites a held send's bytes waiting for that send before it runs
        (the native host cuts its segments there)."""
        index = {id(instruction): k for k, instruction in enumerate(self.run_instructions)}
        before = self._send_waits.before
        waiting = []
        for step, instructions in zip(steps, covered):
            names = before.get(index[id(instructions[0])]) if instructions else None
            waiting.append(self._after_sends(names, step) if names else step)
        return waiting

    def _after_sends(self, names: tuple[str, ...], step: Op) -> Op:
        """`step`, after waiting for the held sends of `names`."""
        wait = self._held.wait

        def wait_then_step() -> None:
            wait(names)
            step()

        return wait_then_step

    def receive_early(self) -> None:
        """From the next run on, each top-level Recv posts the receive of the run after as soon as its tensor is in
        (runtime/early_receives.py): only for a worker that runs this program again and again until its process
        ends."""
        for receive in self._early:
            receive.enable()

    def finish_sends(self) -> None:
        """Wait for every send still in flight (before this worker stops, or writes buffers between runs)."""
        self._held.wait_all()
        if self._comm is not None:
            self._comm.wait_sends()

    def _finish_reductions(self) -> None:
        """Wait for every all-reduce still running (those whose result only a program output reads)."""
        pending = list(self._reducing.values())
        self._reducing.clear()
        for wait in pending:
            wait()

    def _bind_kernel(self, call: KernelCall) -> Op:
        fn = self._kernels[call.kernel]
        args = [self._tensor(n) for n in call.inputs + call.outputs]

        def run_kernel() -> None:
            try:
                fn(*args)
            except IndexError as exc:
                raise self._index_error(call, call.inputs, exc) from None

        return run_kernel

    def _bind_pieces(self, call: KernelCall) -> Op:
        """A micro-batched layer: each piece's kernel on its slice of axis 0 (views of the same buffers)."""
        calls = []
        for piece in call.pieces:
            sliced, start, stop = set(piece.sliced), piece.start, piece.start + piece.size
            args = [self._memory.tensor(self._memory.rows(self._buffer(n), start, stop)) if n in sliced else self._tensor(n)
                    for n in piece.inputs + call.outputs]
            calls.append((self._kernels[piece.kernel], args, piece.inputs))

        def run_pieces() -> None:
            for fn, args, inputs in calls:
                try:
                    fn(*args)
                except IndexError as exc:
                    raise self._index_error(call, inputs, exc) from None

        return run_pieces

    def _index_error(self, call: KernelCall, arg_names: tuple[str, ...], exc: IndexError,
                     fed: Mapping[str, np.ndarray] | None = None) -> Exception:
        """The one-line error for a kernel whose index check failed (other IndexErrors pass unchanged); indices
        that are an input of `fed` (or a view of one) are read from the array given."""
        from tessel.backends.lowering.index_checks import parse_check

        check = parse_check(str(exc))
        if check is None:
            return exc
        # Constants a fused group holds are named '<group>/<name>' in the plan.
        group = f"{call.node}/"
        data = "its data" if check.data is None else f"'{arg_names[check.data].removeprefix(group)}'"
        if check.arg < 0:  # computed inside the kernel: the values are gone, the range is known
            bounds = check.bounds
            where = (f"[{-bounds[0]}, {bounds[0] - 1}] on axis {check.axis}" if len(bounds) == 1 else
                     f"of axes {check.axis}..{check.axis + len(bounds) - 1} (sizes {', '.join(map(str, bounds))})")
            node = member_name(self.directory, call.node, check.op, "")
            return ExecutionError(
                f"node '{node}': an index computed in kernel '{call.node}' is out of range {where} of {data}; "
                f"{check.op} indices must lie in that range")
        indices = arg_names[check.arg]
        root = self._input_roots().get(indices)
        values = (np.asarray(fed[root]).reshape(self._types[indices].shape) if fed and root in fed
                  else self._memory.read(self._buffer(indices)))
        bad = check.first_violation(values)
        index, bound, axis = bad if bad is not None else ("?", check.bounds[0], check.axis)
        node = member_name(self.directory, call.node, check.op, indices)
        return ExecutionError(
            f"node '{node}': index {index} out of range [{-bound}, {bound - 1}] on axis {axis} of {data}; "
            f"{check.op} indices (from '{indices.removeprefix(group)}') must lie in that range")

    def _bind_if(self, instruction: If) -> Op:
        condition = self._buffer(instruction.condition)
        outputs = [self._buffer(n) for n in instruction.outputs]
        branches = {}
        for field, branch in instruction.branches():
            branches[field] = (self._bind(list(branch.instructions)), [self._buffer(n) for n in branch.results])

        memory = self._memory

        def run_if() -> None:
            ops, results = branches["then_branch" if bool(memory.read(condition).reshape(-1)[0]) else "else_branch"]
            for op in ops:
                op()
            self._finish_reductions()
            for out, result in zip(outputs, results):
                memory.copy(out, result)

        return run_if

    def _bind_transfer(self, instruction: Send | Recv) -> Op:
        comm = self._comm
        if isinstance(instruction, Send):
            buffer, peer, tag, name = self._buffer(instruction.tensor), instruction.peer, instruction.tag, instruction.tensor
            if name in self._held_names:
                hold, start_send = self._held.hold, comm.start_send
                return lambda: hold(name, start_send(buffer, peer, tag, name))
            return lambda: comm.send(buffer, peer, tag, name)
        peer, tag, name = instruction.peer, instruction.tag, instruction.output
        if name in self.plan["outputs"]:
            # A model output coming from another worker is received into a fresh array, without
            # waiting: the next micro-batch starts while the last stages finish this one.
            t = self._types[name]
            if not isinstance(self._memory, HostMemory):
                return self._receive_output_on_device(name, peer, tag)

            def receive_output() -> None:
                array = np.empty(t.shape, numpy_dtype(t.dtype))
                self._arriving[name] = (array, comm.start_recv(array, peer, tag, name))

            return receive_output
        buffer = self._buffer(name)
        # Early receives stage the tensor in host memory (np.copyto); device buffers are received where they go, and
        # a tensor that waits in shared memory from its send on is copied from there.
        if (id(instruction) in self._top_receives and isinstance(self._memory, HostMemory)
                and not _buffers_receives(comm, buffer, peer, tag)):
            self._early.append(EarlyReceive(comm, buffer, peer, tag, name))
            return self._early[-1]
        return lambda: comm.recv(buffer, peer, tag, name)

    def _receive_output_on_device(self, name: str, peer: int, tag: int) -> Op:
        """Receive a model output into a fresh device buffer (NCCL writes device memory only); its wait copies
        it into the host array the run returns."""
        comm, memory, t = self._comm, self._memory, self._types[name]
        dtype = numpy_dtype(t.dtype)

        def receive_output() -> None:
            buffer, array = memory.empty(t.shape, dtype), np.empty(t.shape, dtype)
            received = comm.start_recv(buffer, peer, tag, name)

            def wait() -> None:
                received()
                array[...] = memory.read(buffer)

            self._arriving[name] = (array, wait)

        return receive_output

    def _slices(self, whole: str, parts: int) -> list:
        """The `parts` equal slices of axis 0 of value `whole`'s buffer (views, not copies)."""
        rows = self._types[whole].shape[0] // parts
        return [self._memory.rows(self._buffer(whole), r * rows, (r + 1) * rows) for r in range(parts)]

    def _bind_scatter(self, scatter: Scatter) -> Op:
        """The root sends slice r of the whole tensor to worker r and copies its own; the others receive theirs."""
        comm, memory, mine = self._comm, self._memory, self._buffer(scatter.output)
        if scatter.source is None:
            return lambda: comm.recv(mine, scatter.root, scatter.tag + self.worker, scatter.output)
        slices = self._slices(scatter.source, scatter.parts)

        def scatter_slices() -> None:
            for r, part in enumerate(slices):
                if r != scatter.root:
                    comm.send(part, r, scatter.tag + r, scatter.source)
            memory.copy(mine, slices[scatter.root])

        return scatter_slices

    def _bind_gather(self, gather: Gather) -> Op:
        """Each worker sends its slice to the root, which places slice r at rows r of the whole tensor."""
        comm, memory, mine = self._comm, self._memory, self._buffer(gather.input)
        if gather.output is None:
            return lambda: comm.send(mine, gather.root, gather.tag + self.worker, gather.input)
        slices = self._slices(gather.output, gather.parts)

        def gather_slices() -> None:
            memory.copy(slices[gather.root], mine)
            for r, part in enumerate(slices):
                if r != gather.root:
                    comm.recv(part, r, gather.tag + r, gather.input)

        return gather_slices

    # ---- the native host -------------------------------------------------------
    def _segments(self, per_instruction: bool = False) -> list[list[Instruction] | int] | None:
        """The run program cut at each instruction that needs Python: native segments (instruction lists)
        and, between them, the index of each Python instruction; None when an If holds one. A segment also
        starts where the run waits for a held send, and at the first reader of an all-reduce's result (the
        update of one gradient bucket then waits for that bucket only, while the later ones still reduce);
        with `per_instruction`, at every instruction but a view (it costs nothing: it joins the segment before it)."""
        parts: list[list[Instruction] | int] = []
        cuts = set(self._send_waits.before) | reduction_readers(self.run_instructions)
        for index, instruction in enumerate(self.run_instructions):
            if native_able(instruction):
                cut = index in cuts or (per_instruction and not isinstance(instruction, View))
                if not parts or not isinstance(parts[-1], list) or cut:
                    parts.append([])
                parts[-1].append(instruction)
            elif isinstance(instruction, If):
                return None
            else:
                parts.append(index)
        return parts

    def _use_native_host(self, per_instruction: bool = False) -> None:
        parts = self._segments(per_instruction)
        if parts is None:
            return
        segments = [part for part in parts if isinstance(part, list)]
        whole = len(parts) == 1 and self._comm is None
        takes = whole and layout_holds() and len(self.plan["inputs"]) + len(self.plan["outputs"]) <= MAX_TAKEN_ARRAYS
        self._native = self._native_program(segments, takes)
        steps, segment = [], 0
        for part in parts:
            if isinstance(part, list):
                steps.append(self._native_step(segment))
                segment += 1
            else:
                steps.append(self._ops[part])
        self._steps = steps
        self._covered = [part if isinstance(part, list) else [self.run_instructions[part]] for part in parts]
        if whole:
            self._whole_native = self._native.function
            self._taking_inputs = self._native.bound
            self._outputs = [(name, self._buffer(name)) for name in self.plan["outputs"]]
            # Each run's fresh output arrays are made as these are (shape, dtype); copy=False passes the buffers.
            self._output_buffers = [buffer for _, buffer in self._outputs]
            self._output_names = [name for name, _ in self._outputs]

    def _native_program(self, segments: list[list[Instruction]], taking: bool, timed: bool = False) -> NativeHost:
        """The native program of `segments`; `taking`: its whole-run function takes the input arrays (read in place
        where they can be) and the output arrays (written in place where they can be)."""
        return NativeHost(segments, self._buffer, self._entries, timed=timed,
                          inputs=self._bound_inputs() if taking else (),
                          owned=self._owned_ranges() if taking else (), alignments=self._alignments,
                          outputs=self._bound_outputs() if taking else ())

    def _owned_ranges(self) -> list[tuple[int, int]]:
        """The [start, end) address ranges of every buffer this executor holds (the arena, weights, state), the
        overlapping and touching ones merged."""
        # Every buffer is contiguous: it spans nbytes from its data pointer.
        ranges = sorted([self._memory.arena_range(),
                         *((b.ctypes.data, b.ctypes.data + b.nbytes) for b in self._buffers.values())])
        merged: list[tuple[int, int]] = []
        for start, end in ranges:
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return merged

    def _input_roots(self) -> dict[str, str]:
        """Each input, and each view of one (branches included), → the input."""
        root = {name: name for name in self.plan["inputs"]}
        for instruction in walk(self.run_instructions):
            if isinstance(instruction, View) and instruction.input in root:
                root[instruction.output] = root[instruction.input]
        return root

    def _bound_outputs(self) -> list[BoundOutput]:
        """Each output's buffer with the names kernels write and read it by: the value a top-level kernel call
        writes (through the views the output is of) and its views, all of the output's size. No names for an output
        another output shares that value with (each run returns distinct arrays), nor for one that is an input, a
        weight or persistent state (its buffer must keep what the run writes), a view of one, or made at load: those
        are copied out of their buffers."""
        source = {i.output: i.input for i in walk(self.run_instructions) if isinstance(i, View)}
        written = {name for i in self.run_instructions if isinstance(i, KernelCall) for name in i.outputs}

        def root(name: str) -> str:
            while name in source:
                name = source[name]
            return name

        roots = [root(name) for name in self.plan["outputs"]]
        views: dict[str, set[str]] = {}
        for view in source:
            views.setdefault(root(view), set()).add(view)
        bound = []
        for name, of in zip(self.plan["outputs"], roots):
            aliases = frozenset({of, *views.get(of, ())})
            alone = roots.count(of) == 1 and of in written and of not in self._input_names and of not in self.state_names
            same_size = all(self._types[alias].nbytes == self._types[name].nbytes for alias in aliases)
            bound.append(BoundOutput(self._buffer(name), aliases if alone and same_size else frozenset()))
        return bound

    def _bound_inputs(self) -> list[BoundInput]:
        """Each input's slot with the names kernels read it by (itself and its views, branches included); none for
        an input an output aliases: the outputs are copied from their slots, so such an input must be in its own."""
        root = self._input_roots()
        outputs = set(self.plan["outputs"])
        aliases = {name: frozenset(alias for alias, of in root.items() if of == name) for name in self.plan["inputs"]}
        return [BoundInput(self._buffer(name), frozenset() if aliases[name] & outputs else aliases[name])
                for name in self.plan["inputs"]]

    def _native_step(self, segment: int) -> Op:
        run = self._native.run

        def run_segment() -> None:
            status = run(segment)
            if status:
                raise self._native_error(self._native, status)

        return run_segment

    def _native_error(self, native: NativeHost, status: int, fed: Mapping[str, np.ndarray] | None = None) -> Exception:
        """The error a native segment stopped with: the same as the python host raises (`fed`: the input arrays
        of a run that took them, read instead of their slots)."""
        site = native.sites[status - 1]
        if isinstance(site.instruction, Fail):
            return ExecutionError(site.instruction.message)
        exc = take_raised_error()
        if isinstance(exc, IndexError):
            return self._index_error(site.instruction, site.arg_names, exc, fed)
        return exc

    def record_steps(self, recorder) -> None:
        """Time each step of every run from now on: `recorder` (runtime/step_profile.py) wraps them. The native
        host's instructions then run one per segment, so that each span is one instruction's (a segment joining a
        step's forward and backward would be one span of one phase)."""
        if self._native is not None:
            self._assemble_steps(native=True, per_instruction=True)
        self._steps = recorder.timed_steps(self._steps, self._covered, self.run_instructions)
        self._whole_native = self._taking_inputs = None

    def kernel_times(self, inputs: Mapping[str, np.ndarray], runs: int = 20) -> list[float]:
        """Seconds each of `runs` runs spends inside kernels (a timed copy of the native program times each
        call); the rest of a run's time is the host's.

        The timed copy takes the inputs and outputs as `run` does: where `run` reads an input array in place, its
        kernels read it there too (the same addresses, the same caches), else it is copied into its slot; the
        outputs go to fresh arrays. Needs the native host and a program without transfers.
        """
        self._timed_program()
        totals = []
        for _ in range(runs):
            self._timed.kernel_ns[:] = 0
            self._run_timed(self._timed, inputs)
            totals.append(int(self._timed.kernel_ns.sum()) / 1e9)
        return totals

    def kernel_samples(self, inputs: Mapping[str, np.ndarray],
                       runs: int = 20) -> tuple[list[str], np.ndarray, np.ndarray]:
        """(the node of each kernel call site, the seconds each site took in each of `runs` timed runs (runs × sites),
        each timed run's whole seconds as Python's clock sees the call): what `kernel_times` adds up, per kernel, and
        the run around it, so that a run's time outside its kernels (the host's) is its whole time minus its row's
        sum. Every kernel call site is there, in program order: one that did not run (a branch not taken) took 0 s,
        so samples taken by separate calls line up. The timed copy is the one `kernel_times` uses (no run before the
        first sample: warm up first)."""
        if runs < 1:
            raise ValueError(f"kernel_samples needs at least 1 run, not {runs}")
        timed = self._timed_program()
        walls, rows = [], []
        for _ in range(runs):
            timed.kernel_ns[:] = 0
            started = time.perf_counter()
            self._run_timed(timed, inputs)
            walls.append(time.perf_counter() - started)
            rows.append(timed.kernel_ns.copy())
        sites = [k for k, site in enumerate(timed.sites) if site.kernel]
        return [timed.sites[k].instruction.node for k in sites], np.stack(rows)[:, sites] / 1e9, np.array(walls)

    def _timed_program(self) -> NativeHost:
        """The timed copy of the native program (made on first use), taking the inputs and outputs as `run` does."""
        if self._whole_native is None:
            raise ArtifactError(f"{self.directory}: kernel times need the native host on a one-worker program")
        if self._timed is None:
            self._timed = self._native_program([self.run_instructions], self._taking_inputs is not None, timed=True)
        return self._timed

    def _run_timed(self, timed: NativeHost, inputs: Mapping[str, np.ndarray] | None = None) -> None:
        """One run of a timed copy of the native program (its kernel times add up in `timed.kernel_ns`), given
        `inputs` (taken as `run` takes them), or on the slots as they are."""
        if inputs is not None and timed.bound is not None:
            status, _, _ = self._call_taking(timed.bound, inputs, True)
        else:
            if inputs is not None:
                self._write_inputs(inputs)
            status = timed.run(0)
        if status:
            raise self._native_error(timed, status)

    def received_values(self) -> list[str]:
        """The values the run's transfers and collectives write: what other workers bring (a reduction's result
        included)."""
        return sorted({name for i in self.run_instructions if not native_able(i) for name in i.writes()
                       if name in self._types})

    def kernel_site_seconds(self, values: Mapping[str, np.ndarray], runs: int = 3, by_node: bool = False,
                            before_run: Callable[[], None] | None = None) -> list[tuple[str, float]]:
        """(kernel key, or with `by_node` the calling node, seconds) of each kernel call of the run program in
        program order (a call in pieces: one per piece), the median of `runs` timed runs after an untimed one:
        every kernel timed where the step calls it, on the step's own buffers, after the kernels before it (not
        the same kernel again and again, its data left in the caches). Transfers and collectives do not run:
        `values` (by name: the inputs and `received_values`) are written into their buffers before each run, and
        `before_run` (when given) is called right before each run starts."""
        timed = NativeHost([[i for i in self.run_instructions if native_able(i)]], self._buffer, self._entries,
                           timed=True)
        writes = [(self._buffer(name), np.asarray(array)) for name, array in values.items()]
        samples = []
        for _ in range(runs + 1):
            for buffer, array in writes:
                buffer[...] = array
            timed.kernel_ns[:] = 0
            if before_run is not None:
                before_run()
            self._run_timed(timed)
            samples.append(timed.kernel_ns.copy())
        seconds = np.median(np.stack(samples[1:]), axis=0) / 1e9
        # A site that took no time did not run (a branch not taken).
        return [(site.instruction.node if by_node else site.kernel, float(s))
                for site, s in zip(timed.sites, seconds) if site.kernel and s > 0]

    def kernel_profile(self, inputs: Mapping[str, np.ndarray], runs: int = 20) -> list[tuple[str, str, float]]:
        """(node, op, mean microseconds per run) of each kernel call site of the native program, slowest first."""
        self.kernel_times(inputs, 1)
        self._timed.kernel_ns[:] = 0
        for _ in range(runs):
            self._run_timed(self._timed, inputs)
        rows = [(site.instruction.node, site.instruction.op, float(ns) / runs / 1e3)
                for site, ns in zip(self._timed.sites, self._timed.kernel_ns)]
        return sorted(rows, key=lambda row: -row[2])

    # ---- running ------------------------------------------------------------
    @property
    def input_types(self) -> dict[str, TensorType]:
        """Name → type of each model input."""
        return {name: self._types[name] for name in self.plan["inputs"]}

    @property
    def output_types(self) -> dict[str, TensorType]:
        """Name → type of each model output."""
        return {name: self._types[name] for name in self.plan["outputs"]}

    def run(self, inputs: Mapping[str, np.ndarray], copy: bool = True) -> dict[str, np.ndarray]:
        """Run the model once; returns fresh output arrays by name.

        A cuda artifact also takes inputs already on its GPU (any DLPack tensor there: runtime/device_inputs.py),
        copied device to device. With `copy=False` the outputs may be views of the executor's buffers (on the native host
        of a one-worker program they are): valid until the next run, and cheaper on small models. The native host of
        a one-worker program reads a C-contiguous input array where it lies when it is as aligned as the kernels
        reading it assume (numpy's 16 bytes for kernels compiled so) and outside the executor's own memory: the array
        must stay unchanged until `run` returns; with `copy`, its kernels write each output into the fresh array
        returned where they can. An executor runs one call at a time (the session and the artifact call it from
        one thread).
        """
        if self._taking_inputs is not None:
            # The whole run is one native call, given the arrays: it reads the inputs in place or copies them in,
            # and writes the outputs into fresh arrays (or leaves them in its buffers: copy=False).
            status, arrays, outputs = self._call_taking(self._taking_inputs, inputs, copy)
            if status:
                # The error names offending values: an input's come from the caller's array (its slot may hold a
                # later value, or nothing when it was read in place).
                raise self._native_error(self._native, status, dict(zip(self.plan["inputs"], arrays)))
            return dict(zip(self._output_names, outputs))
        if self._whole_native is not None:
            # The whole run is one native call: the inputs go straight into their slots.
            self._write_inputs(inputs)
            status = self._whole_native()
            if status:
                raise self._native_error(self._native, status)
            if copy:
                return {name: buffer.copy() for name, buffer in self._outputs}
            return dict(self._outputs)
        return self.start(inputs)()

    def _call_taking(self, program: Callable[..., int], inputs: Mapping[str, np.ndarray],
                     fresh: bool) -> tuple[int, list[np.ndarray], list[np.ndarray]]:
        """Call a native program taking the arrays: (its status, the input arrays, the output arrays). The outputs
        are fresh arrays (`fresh`), which no earlier run's result shares, or the executor's own buffers."""
        arrays = self._input_arrays(inputs)
        outputs = [np.empty(b.shape, b.dtype) for b in self._output_buffers] if fresh else self._output_buffers
        status = program(*arrays, *outputs)
        if status == NOT_CONTIGUOUS:
            status = program(*map(np.ascontiguousarray, arrays), *outputs)
        return status, arrays, outputs

    def _input_arrays(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """The inputs as numpy arrays in the program's order; the full check only when one is not an exact match."""
        if inputs.keys() != self._input_names:
            self._check_inputs(inputs)
        arrays = []
        for name, _, shape, dtype in self._inputs:
            array = inputs[name]
            # `is` on the dtype: an equal dtype that is another object takes the full check, and passes it.
            if type(array) is not np.ndarray or array.dtype is not dtype or array.shape != shape:
                self._check_inputs(inputs)
                array = np.asarray(array)
            arrays.append(array)
        return arrays

    def _write_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        """Copy the inputs into their host buffers (checked as `_input_arrays` checks them)."""
        for (_, buffer, _, _), array in zip(self._inputs, self._input_arrays(inputs)):
            buffer[...] = array  # same shape and dtype (checked): a plain copy

    def start(self, inputs: Mapping[str, np.ndarray]) -> "PendingOutputs":
        """Run the model once, except for waiting on outputs other devices send; returns the wait.

        Micro-batches call `start` for each and then wait on all of them, so a device
        holding model outputs never idles while later pipeline stages work. This run's Sends are
        still in flight when it returns (runtime/held_sends.py): the next run waits for each
        before it overwrites the sent bytes, and `finish_sends` waits for all of them.
        """
        self._check_inputs(inputs)
        self._held.wait(self._send_waits.before_inputs)
        for name in self.plan["inputs"]:
            self._memory.write(self._buffer(name), _host_or_device(inputs[name], self._memory))
        self._arriving = {}
        for step in self._steps:
            step()
        self._finish_reductions()
        self._held.wait(self._send_waits.at_end)
        if self._comm is not None:
            self._comm.wait_sends()
        local = {name: self._memory.read(self._buffer(name)) for name in self.plan["outputs"] if name not in self._arriving}
        arriving, self._arriving = self._arriving, {}
        return PendingOutputs(self.plan["outputs"], local, arriving)

    def profile(self, inputs: Mapping[str, np.ndarray], runs: int = 5,
                statistic: Callable[[list[float]], float] = np.median) -> list[tuple[str, str, float]]:
        """(node, op, milliseconds) per top-level instruction, slowest first: `statistic` (default the median) of
        its `runs` samples."""
        self.run(inputs)
        samples: list[list[float]] = [[] for _ in self._ops]
        for _ in range(runs):
            # The arena reuses an input's bytes once its last reader ran: every pass starts from the inputs.
            for name in self.plan["inputs"]:
                self._memory.write(self._buffer(name), _host_or_device(inputs[name], self._memory))
            for index, op in enumerate(self._ops):
                started = time.perf_counter()
                op()
                self._memory.sync()
                samples[index].append(1e3 * (time.perf_counter() - started))
        rows = [(i.node, i.op, float(statistic(times))) for i, times in zip(self.run_instructions, samples)]
        return sorted(rows, key=lambda row: -row[2])

    def _check_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        expected = self.input_types
        missing = [n for n in expected if n not in inputs]
        extra = [n for n in inputs if n not in expected]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing {', '.join(map(repr, missing))}")
            if extra:
                parts.append(f"unknown {', '.join(map(repr, extra))}")
            want = ", ".join(f"{n}: {t.spec()}" for n, t in expected.items())
            raise InputError(f"inputs do not match the model ({'; '.join(parts)}); it takes {want}")
        for name, want in expected.items():
            if isinstance(self._memory, HostMemory) and on_gpu(inputs[name]):
                raise InputError(f"input '{name}' is on a GPU; this artifact runs on the CPU: pass it as a numpy array")
            shape, dtype = shape_and_dtype(inputs[name])
            if shape != want.shape or dtype != numpy_dtype(want.dtype):
                have = f"{dtype}[{','.join(map(str, shape))}]"
                raise InputError(f"input '{name}' is {have}, the model takes {want.spec()}")


class PendingOutputs:
    """A started run's outputs (`Executor.start`): called, it waits for those other workers send and returns them
    all by name; `arrived` tells without waiting whether they are all in."""

    def __init__(self, names: list[str], local: dict[str, np.ndarray], arriving: dict[str, tuple[np.ndarray, Op]]):
        self._names, self._local, self._arriving = names, local, arriving

    @property
    def observable(self) -> bool:
        """Whether `arrived` can tell: every output from another worker comes through shared memory (runtime/
        shared_p2p.py; gloo's receives cannot be asked)."""
        return all(hasattr(pending, "arrived") for _, pending in self._arriving.values())

    def arrived(self) -> bool:
        """Whether every output from another worker is in (`observable` ones; calling then returns at once)."""
        return all(pending.arrived() for _, pending in self._arriving.values())

    def __call__(self) -> dict[str, np.ndarray]:
        for _, pending in self._arriving.values():
            pending()
        return {name: self._local[name] if name in self._local else self._arriving[name][0] for name in self._names}


def _buffers_receives(comm, buffer, peer: int, tag: int) -> bool:
    """Whether `comm` keeps a message to `buffer` from `peer` under `tag` until it is received (runtime/comm.py
    `buffers_receives`; a comm without it, such as a test's, does not)."""
    buffers = getattr(comm, "buffers_receives", None)
    return buffers is not None and buffers(buffer, peer, tag)


def _nothing() -> None:
    return None


def _refused(instruction: Instruction) -> Op:
    """What a transfer or collective of a kernels-only executor does when run: refuse."""

    def refuse() -> None:
        raise ExecutionError(f"{type(instruction).__name__} at node {instruction.node!r}: this executor only times "
                             "its kernels (kernels_only)")

    return refuse


def _host_or_device(value, memory):
    """An input as the memory's `write` takes it: a GPU tensor as it is for device memory, else a numpy array."""
    return value if not isinstance(memory, HostMemory) and on_gpu(value) else np.asarray(value)


def reduction_readers(instructions: Iterable[Instruction]) -> set[int]:
    """Indices of the instructions that first read the result of an all-reduce started before them."""
    started: set[str] = set()
    readers = set()
    for index, instruction in enumerate(instructions):
        read = reads_within(instruction) & started
        if read:
            readers.add(index)
            started -= read
        if isinstance(instruction, AllReduce):
            started.add(instruction.output or instruction.tensor)
    return readers


def reductions_read_next(instructions: Sequence[Instruction]) -> set[int]:
    """Indices of the all-reduces with nothing to overlap: the next instruction that does work (views skipped)
    reads the result, or is such an all-reduce itself (the loss's own, issued just before a last gradient bucket it
    does not ride in: passes/data_parallel.py).
    On another thread such a reduction would overlap nothing, and that thread would wait for a core the worker's
    own thread holds: a training step's last gradient bucket, whose update comes right after."""
    at_once: set[int] = set()
    for index in reversed(range(len(instructions))):
        instruction = instructions[index]
        if not isinstance(instruction, AllReduce) or instruction.compression != "none":
            continue  # a compressed all-reduce always runs in the background (runtime/comm.py)
        aliases = {instruction.output or instruction.tensor}
        for later, following in enumerate(instructions[index + 1:], index + 1):
            if not isinstance(following, View):
                if reads_within(following) & aliases or later in at_once:
                    at_once.add(index)
                break
            if following.input in aliases:
                aliases.add(following.output)
    return at_once
