"""Compiling the distinct kernels of a model, in parallel across cores, through the cache."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ir.errors import TesselError

from .cache import KernelCache
from .kernel import KernelSpec, build
from .target import TargetSpec, parse_target

# Below this many kernels to compile, starting worker processes (each imports TVM) costs more than it saves.
MIN_PARALLEL_KERNELS = 4


class KernelBuildError(TesselError):
    """One or more kernels failed to lower or compile; lists them all."""


@dataclass(frozen=True)
class BuildStats:
    """What a build did: kernels wanted, found in the cache, and compiled."""

    kernels: int
    cached: int
    compiled: int


def _build_one(spec_doc: dict, target_text: str, cache_root: str, key: str) -> str | None:
    """Build and cache one kernel; the error text when it fails (runs in a worker process)."""
    target = parse_target(target_text)
    spec = KernelSpec.from_json(spec_doc)
    try:
        executable = build(spec, target)
        extra = _cuda_files(executable, target) if target.is_gpu else None
        KernelCache(cache_root).store(key, spec, executable, extra)
    except Exception as exc:  # noqa: BLE001 - reported per kernel, all at once
        return f"{spec.op_type}: {(str(exc).strip().splitlines() or [type(exc).__name__])[-1]}"
    return None


def _cuda_files(executable, target: TargetSpec) -> dict[str, bytes]:
    """The CUDA source, kept beside the kernel for reading (the library itself carries the nvcc fatbin)."""
    from .schedules.gpu import cuda_source

    return {".cu": cuda_source(executable).encode()}


def build_kernels(
    specs: dict[str, KernelSpec],
    target: TargetSpec,
    cache: KernelCache,
    jobs: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> BuildStats:
    """Make sure every kernel in `specs` (by key) is in the cache; compile the missing ones.

    Several kernels compile at once in worker processes (`python -m backends.build_worker`),
    one per core by default.
    """
    missing = [key for key in specs if not cache.has(key)]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(missing)))
    errors: list[str] = []
    counter = _Counter(len(missing), progress)
    if len(missing) < MIN_PARALLEL_KERNELS or jobs == 1:
        for key in missing:
            error = _build_one(specs[key].to_json(), str(target), str(cache.root), key)
            if error:
                errors.append(error)
            counter.step()
    else:
        work: queue.Queue = queue.Queue()
        for key in missing:
            work.put(key)
        lock = threading.Lock()

        def drive() -> None:
            with _Worker(target, cache) as worker:
                while True:
                    try:
                        key = work.get_nowait()
                    except queue.Empty:
                        return
                    error = worker.build(key, specs[key])
                    with lock:
                        if error:
                            errors.append(error)
                        counter.step()

        threads = [threading.Thread(target=drive, daemon=True) for _ in range(jobs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        unique = sorted(set(errors))
        raise KernelBuildError(f"{len(errors)} kernel(s) failed to build: " + "; ".join(unique[:8])
                               + (f"; and {len(unique) - 8} more" if len(unique) > 8 else ""))
    return BuildStats(len(specs), len(specs) - len(missing), len(missing))


class _Counter:
    def __init__(self, total: int, progress: Callable[[int, int], None] | None):
        self.total, self.done, self.progress = total, 0, progress
        if progress:
            progress(0, total)

    def step(self) -> None:
        self.done += 1
        if self.progress:
            self.progress(self.done, self.total)


class _Worker:
    """A `python -m backends.build_worker` process: one JSON request line in, one reply line out."""

    def __init__(self, target: TargetSpec, cache: KernelCache):
        env = dict(os.environ, TVM_NUM_THREADS="1")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "backends.build_worker", str(target), str(cache.root)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            cwd=str(Path(__file__).resolve().parent.parent),
        )

    def build(self, key: str, spec: KernelSpec) -> str | None:
        """Compile one kernel in the worker; the error text, or None."""
        try:
            self.process.stdin.write(json.dumps({"key": key, "spec": spec.to_json()}) + "\n")
            self.process.stdin.flush()
            reply = self.process.stdout.readline()
        except OSError as exc:
            return f"{spec.op_type}: build worker failed ({exc})"
        if not reply:
            return f"{spec.op_type}: build worker exited (code {self.process.poll()})"
        return json.loads(reply).get("error")

    def __enter__(self) -> "_Worker":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.process.stdin.close()
        except OSError:
            pass
        self.process.wait()


class ProgressBar:
    """A one-line progress bar on stderr (when it is a terminal), called as (done, total)."""

    def __init__(self, label: str):
        self.label = label

    def __call__(self, done: int, total: int) -> None:
        if not total or not sys.stderr.isatty():
            return
        width = 30
        filled = width * done // total
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


stderr_progress = ProgressBar("compiling kernels")
