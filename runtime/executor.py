"""The single-device executor: runs a compiled program step by step.

Every buffer is allocated once, 64-byte aligned, when the executor is made;
weights are loaded once; each run copies the inputs in, calls the kernels in
order on pre-bound arguments, and copies the outputs out.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from tessel.ir.types import TensorType, numpy_dtype

from .artifact_files import PLAN_FILE, read_plan, verify_files
from .errors import ArtifactError, ExecutionError, InputError
from .graph_names import member_name
from .memory import HostMemory

Op = Callable[[], None]


class Executor:
    """Runs the program of one artifact directory: llvm kernels on host memory, cuda kernels on GPU memory."""

    def __init__(self, directory: str | Path, threads: int | None = None, device: int = 0, comm=None,
                 memory_device: str | None = None):
        """`memory_device` ("cpu", "cuda") puts the buffers in TVM memory on that device; by default
        host numpy memory for llvm artifacts and the GPU for cuda ones."""
        from tessel.backends.tvm_env import set_threads, tvm

        if threads is not None:
            set_threads(threads)
        self._tvm = tvm()
        self.directory = Path(directory)
        self.artifact_plan = read_plan(self.directory)
        verify_files(self.directory, self.artifact_plan)
        # A multi-device artifact holds one program per device; this executor runs one of them.
        devices = self.artifact_plan.get("devices")
        if devices is not None and not 0 <= device < len(devices):
            raise ArtifactError(f"{self.directory}: the artifact has {len(devices)} devices, not device {device}")
        self.plan = {**self.artifact_plan, **devices[device]} if devices is not None else self.artifact_plan
        self.device = device
        self._comm = comm
        self._arriving: dict[str, tuple[np.ndarray, Callable[[], None]]] = {}
        memory = self.plan.get("memory", {"arena_bytes": 0, "offsets": {}})
        # One arena holds every activation at its planned offset: no allocation per run.
        self._memory = self._make_memory(int(memory["arena_bytes"]), memory_device)
        self._kernels = self._load_kernels()
        self._buffers: dict[str, Any] = {}
        self._tensors: dict[str, Any] = {}
        self._types = {name: TensorType.parse(spec) for name, spec in self.plan["values"].items()}
        self._offsets: dict[str, int] = memory["offsets"]
        self._load_weights()
        # Steps that read only weights run once, now; the others run on every run.
        for op in self._bind([step for step in self.plan["steps"] if step.get("init")]):
            op()
        self._run_steps = [step for step in self.plan["steps"] if not step.get("init")]
        self._ops = self._bind(self._run_steps)

    def _make_memory(self, arena_bytes: int, memory_device: str | None):
        if memory_device is None and not str(self.plan["target"]).startswith("cuda"):
            return HostMemory(arena_bytes)
        from .device_memory import DeviceMemory

        if self._comm is not None:
            raise ArtifactError(f"{self.directory}: device {self.device} exchanges tensors with other devices; "
                                "that runs on host memory only (compile multi-device artifacts for llvm)")
        return DeviceMemory(self._tvm.device(memory_device or "cuda", 0), arena_bytes)

    # ---- loading ------------------------------------------------------------
    def _load_kernels(self) -> dict[str, Any]:
        if str(self.plan["target"]).startswith("cuda"):
            from tessel.backends.tvm_env import enable_cuda

            enable_cuda()  # a runtime-only TVM registers no CUDA module loader by itself
        kernels = {}
        used = set(_kernel_keys(self.plan["steps"]))
        for key, entry in self.plan["kernels"].items():
            if key not in used:
                continue
            path = self.directory / entry["file"]
            try:
                kernels[key] = self._tvm.runtime.load_module(str(path))["main"]
            except Exception as exc:  # noqa: BLE001 - a broken library must not crash the caller
                raise ArtifactError(f"{path}: cannot load kernel library ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from exc
        return kernels

    def _load_weights(self) -> None:
        path = self.directory / self.plan["weights"]["file"]
        try:
            with np.load(path, allow_pickle=False) as weights:
                for name in self.plan["weights"]["names"]:
                    self._buffers[name] = self._memory.weight(weights[name])
        except (OSError, ValueError, KeyError) as exc:
            raise ArtifactError(f"{path}: cannot read weights ({exc})") from exc

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
        self._memory.fill(0xFF)

    def _tensor(self, name: str):
        if name not in self._tensors:
            self._tensors[name] = self._memory.tensor(self._buffer(name))
        return self._tensors[name]

    # ---- binding ------------------------------------------------------------
    def _bind(self, steps: list[dict[str, Any]]) -> list[Op]:
        return [self._bind_step(step) for step in steps]

    def _bind_step(self, step: dict[str, Any]) -> Op:
        kind = step["kind"]
        if kind == "view":
            t = self._types[step["output"]]
            self._buffers[step["output"]] = self._memory.reshape(self._buffer(step["input"]), t.shape)
            return _nothing
        if kind == "kernel" and "pieces" in step:
            return self._bind_pieces(step)
        if kind == "kernel":
            fn = self._kernels[step["kernel"]]
            args = [self._tensor(n) for n in step["inputs"] + step["outputs"]]

            def run_kernel() -> None:
                try:
                    fn(*args)
                except IndexError as exc:
                    raise self._index_error(step, step["inputs"], exc) from None

            return run_kernel
        if kind == "if":
            return self._bind_if(step)
        if kind in ("send", "recv"):
            return self._bind_transfer(step)
        if kind == "fail":
            message = step["message"]

            def fail() -> None:
                raise ExecutionError(message)

            return fail
        raise ArtifactError(f"{PLAN_FILE}: unknown step kind {kind!r} at node {step.get('node')!r}")

    def _bind_pieces(self, step: dict[str, Any]) -> Op:
        """A micro-batched layer: each piece's kernel on its slice of axis 0 (views of the same buffers)."""
        calls = []
        for piece in step["pieces"]:
            sliced, start, stop = set(piece["sliced"]), piece["start"], piece["start"] + piece["size"]
            args = [self._memory.tensor(self._memory.rows(self._buffer(n), start, stop)) if n in sliced else self._tensor(n)
                    for n in piece["inputs"] + step["outputs"]]
            calls.append((self._kernels[piece["kernel"]], args))

        def run_pieces() -> None:
            for (fn, args), piece in zip(calls, step["pieces"]):
                try:
                    fn(*args)
                except IndexError as exc:
                    raise self._index_error(step, piece["inputs"], exc) from None

        return run_pieces

    def _index_error(self, step: dict[str, Any], arg_names: list[str], exc: IndexError) -> Exception:
        """The one-line error for a kernel whose index check failed (other IndexErrors pass unchanged)."""
        from tessel.backends.lowering.index_checks import parse_check

        check = parse_check(str(exc))
        if check is None:
            return exc
        # Constants a fused group holds are named '<group>/<name>' in the plan.
        group = f"{step['node']}/"
        data = "its data" if check.data is None else f"'{arg_names[check.data].removeprefix(group)}'"
        if check.arg < 0:  # computed inside the kernel: the values are gone, the range is known
            bounds = check.bounds
            where = (f"[{-bounds[0]}, {bounds[0] - 1}] on axis {check.axis}" if len(bounds) == 1 else
                     f"of axes {check.axis}..{check.axis + len(bounds) - 1} (sizes {', '.join(map(str, bounds))})")
            node = member_name(self.directory, step["node"], check.op, "")
            return ExecutionError(
                f"node '{node}': an index computed in kernel '{step['node']}' is out of range {where} of {data}; "
                f"{check.op} indices must lie in that range")
        indices = arg_names[check.arg]
        bad = check.first_violation(self._memory.read(self._buffer(indices)))
        index, bound, axis = bad if bad is not None else ("?", check.bounds[0], check.axis)
        node = member_name(self.directory, step["node"], check.op, indices)
        return ExecutionError(
            f"node '{node}': index {index} out of range [{-bound}, {bound - 1}] on axis {axis} of {data}; "
            f"{check.op} indices (from '{indices.removeprefix(group)}') must lie in that range")

    def _bind_if(self, step: dict[str, Any]) -> Op:
        condition = self._buffer(step["condition"])
        outputs = [self._buffer(n) for n in step["outputs"]]
        branches = {}
        for key in ("then", "else"):
            ops = self._bind(step[key]["steps"])
            results = [self._buffer(n) for n in step[key]["results"]]
            branches[key] = (ops, results)

        memory = self._memory

        def run_if() -> None:
            ops, results = branches["then" if bool(memory.read(condition).reshape(-1)[0]) else "else"]
            for op in ops:
                op()
            for out, result in zip(outputs, results):
                memory.copy(out, result)

        return run_if

    def _bind_transfer(self, step: dict[str, Any]) -> Op:
        if self._comm is None:
            raise ArtifactError(f"{self.directory}: device {self.device} exchanges tensors with other devices; "
                                "run it with its workers (tessel run DIR, or Artifact.run)")
        comm = self._comm
        if step["kind"] == "send":
            buffer, peer, tag, name = self._buffer(step["tensor"]), step["to"], step["tag"], step["tensor"]
            return lambda: comm.send(buffer, peer, tag, name)
        peer, tag, name = step["from"], step["tag"], step["output"]
        if name in self.plan["outputs"]:
            # A model output coming from another device is received into a fresh array, without
            # waiting: the next micro-batch starts while the last stages finish this one.
            t = self._types[name]

            def receive_output() -> None:
                array = np.empty(t.shape, numpy_dtype(t.dtype))
                self._arriving[name] = (array, comm.start_recv(array, peer, tag, name))

            return receive_output
        buffer = self._buffer(name)
        return lambda: comm.recv(buffer, peer, tag, name)

    # ---- running ------------------------------------------------------------
    @property
    def input_types(self) -> dict[str, TensorType]:
        """Name → type of each model input."""
        return {name: self._types[name] for name in self.plan["inputs"]}

    @property
    def output_types(self) -> dict[str, TensorType]:
        """Name → type of each model output."""
        return {name: self._types[name] for name in self.plan["outputs"]}

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the model once; returns fresh output arrays by name."""
        return self.start(inputs)()

    def start(self, inputs: Mapping[str, np.ndarray]) -> Callable[[], dict[str, np.ndarray]]:
        """Run the model once, except for waiting on outputs other devices send; returns the wait.

        Micro-batches call `start` for each and then wait on all of them, so a device
        holding model outputs never idles while later pipeline stages work.
        """
        self._check_inputs(inputs)
        for name in self.plan["inputs"]:
            self._memory.write(self._buffer(name), np.asarray(inputs[name]))
        self._arriving = {}
        for op in self._ops:
            op()
        if self._comm is not None:
            self._comm.wait_sends()
        local = {name: self._memory.read(self._buffer(name)) for name in self.plan["outputs"] if name not in self._arriving}
        arriving, self._arriving = self._arriving, {}

        def outputs() -> dict[str, np.ndarray]:
            for array, pending in arriving.values():
                pending()
            return {name: local[name] if name in local else arriving[name][0] for name in self.plan["outputs"]}

        return outputs

    def profile(self, inputs: Mapping[str, np.ndarray], runs: int = 5) -> list[tuple[str, str, float]]:
        """(node, op, median milliseconds) per top-level step, slowest first."""
        self.run(inputs)
        samples: list[list[float]] = [[] for _ in self._ops]
        for _ in range(runs):
            # The arena reuses an input's bytes once its last reader ran: every pass starts from the inputs.
            for name in self.plan["inputs"]:
                self._memory.write(self._buffer(name), np.asarray(inputs[name]))
            for index, op in enumerate(self._ops):
                started = time.perf_counter()
                op()
                self._memory.sync()
                samples[index].append(1e3 * (time.perf_counter() - started))
        rows = [(step["node"], step["op"], float(np.median(times))) for step, times in zip(self._run_steps, samples)]
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
            array = np.asarray(inputs[name])
            if array.shape != want.shape or array.dtype != numpy_dtype(want.dtype):
                have = f"{array.dtype}[{','.join(map(str, array.shape))}]"
                raise InputError(f"input '{name}' is {have}, the model takes {want.spec()}")


def _nothing() -> None:
    return None


def _kernel_keys(steps: list[dict[str, Any]]):
    for step in steps:
        if step["kind"] == "kernel":
            yield step["kernel"]
            for piece in step.get("pieces", ()):
                yield piece["kernel"]
        elif step["kind"] == "if":
            yield from _kernel_keys(step["then"]["steps"])
            yield from _kernel_keys(step["else"]["steps"])
