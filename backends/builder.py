"""Compiling the distinct kernels of a model in build-worker processes, through the cache.

Every kernel compiles in a child process (`python -m tessel.backends.build_worker`),
never in the compiling one: a crash inside TVM ends a worker and becomes one
error line naming the kernel, and the compile goes on to report it. Workers
stay up between builds (each imports TVM, about a second) and stop after
IDLE_SECONDS without work, or when this process exits.
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Callable

from tessel import IMPORT_ROOT
from tessel.ir.errors import TesselError

from .cache import KernelCache
from .kernel import KernelSpec
from .target import TargetSpec

# Idle workers are stopped after this long; the builds of one compile come well within it.
IDLE_SECONDS = 10.0
# How long a worker told to stop may take to exit before it is killed.
STOP_SECONDS = 5.0
# Op names shown for a fused kernel in an error line.
MAX_OPS_NAMED = 6
# The module a worker process runs (`python -m`); tests substitute one that crashes on purpose.
WORKER_MODULE = "tessel.backends.build_worker"


class KernelBuildError(TesselError):
    """One or more kernels failed to lower or compile; lists them all."""


@dataclass(frozen=True)
class BuildStats:
    """What a build did: kernels wanted, found intact in the cache, compiled, and damaged entries rebuilt."""

    kernels: int
    cached: int
    compiled: int
    rebuilt: int = 0


def warn_on_stderr(message: str) -> None:
    """Print a warning line for the user."""
    print(f"tessel: warning: {message}", file=sys.stderr, flush=True)


def build_kernels(
    specs: dict[str, KernelSpec],
    target: TargetSpec,
    cache: KernelCache,
    jobs: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    warn: Callable[[str], None] = warn_on_stderr,
) -> BuildStats:
    """Make sure every kernel in `specs` (by key) is intact in the cache; compile the missing ones.

    Each cache entry used is checked against the hashes stored with it; a damaged
    one is rebuilt and reported once through `warn`. Kernels compile in worker
    processes, one per core by default.
    """
    missing, damaged = [], {}
    for key in specs:
        if not cache.has(key):
            missing.append(key)
        elif (problem := cache.damage(key)) is not None:
            damaged[key] = problem
            cache.discard(key)
            missing.append(key)
    if damaged:
        warn(_damage_line(damaged, specs, cache))
    errors = sorted(_compile_in_workers({key: specs[key] for key in missing}, target, cache, jobs, progress))
    if errors:
        raise KernelBuildError(f"{len(errors)} kernel(s) failed to build: " + "; ".join(errors[:8])
                               + (f"; and {len(errors) - 8} more" if len(errors) > 8 else ""))
    return BuildStats(len(specs), len(specs) - len(missing), len(missing), len(damaged))


def describe_kernel(key: str, spec: KernelSpec) -> str:
    """`kernel <key> (<ops>, <n> inputs)`: which kernel, and the ops it runs."""
    ops: list[str] = []
    for member in spec.members():
        if member.spec.op_type not in ops:
            ops.append(member.spec.op_type)
    named = "+".join(ops[:MAX_OPS_NAMED]) + ("+..." if len(ops) > MAX_OPS_NAMED else "")
    count = sum(1 for i in spec.inputs if i is not None)
    return f"kernel {key} ({named}, {count} input{'s' if count != 1 else ''})"


def _damage_line(damaged: dict[str, str], specs: dict[str, KernelSpec], cache: KernelCache) -> str:
    listed = "; ".join(f"{describe_kernel(key, specs[key])}: {why}" for key, why in list(damaged.items())[:4])
    more = f"; and {len(damaged) - 4} more" if len(damaged) > 4 else ""
    return (f"{len(damaged)} damaged kernel cache entr{'y' if len(damaged) == 1 else 'ies'} in {cache.root} "
            f"rebuilt ({listed}{more})")


def _compile_in_workers(specs: dict[str, KernelSpec], target: TargetSpec, cache: KernelCache,
                        jobs: int | None, progress: Callable[[int, int], None] | None) -> list[str]:
    """Compile `specs` on up to `jobs` workers at once; one error line per kernel that failed."""
    counter = _Counter(len(specs), progress)
    if not specs:
        return []
    work: queue.Queue = queue.Queue()
    for key in specs:
        work.put(key)
    errors: list[str] = []
    lock = threading.Lock()
    pool = _pool()

    def drive() -> None:
        worker = None
        try:
            while True:
                try:
                    key = work.get_nowait()
                except queue.Empty:
                    return
                try:
                    worker = worker or pool.acquire()
                except OSError as exc:
                    error = f"cannot start a build worker ({exc.strerror or exc})"
                else:
                    error = worker.build(key, specs[key], target, cache)
                if worker is not None and not worker.alive:
                    cache.discard_staging(worker.pid)
                    pool.release(worker)
                    worker = None
                with lock:
                    if error:
                        errors.append(f"{describe_kernel(key, specs[key])}: {error}")
                    counter.step()
        finally:
            if worker is not None:
                pool.release(worker)

    count = max(1, min(jobs or os.cpu_count() or 1, len(specs)))
    threads = [threading.Thread(target=drive, daemon=True) for _ in range(count)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    except BaseException:
        pool.kill_busy()  # interrupted: no worker goes on compiling for nobody
        raise
    return errors


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
    """A `python -m tessel.backends.build_worker` process: one JSON request line in, one reply line out."""

    def __init__(self):
        env = dict(os.environ, TVM_NUM_THREADS="1")
        # Its stderr (TVM's messages before a crash) goes to an unlinked file: read on death, never left behind.
        self.stderr = tempfile.TemporaryFile()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env,
                cwd=str(IMPORT_ROOT),
            )
        except OSError:
            self.stderr.close()
            raise
        self.pid = self.process.pid

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self.process.poll() is None

    def build(self, key: str, spec: KernelSpec, target: TargetSpec, cache: KernelCache) -> str | None:
        """Compile one kernel in the worker; the error text, or None."""
        request = {"key": key, "spec": spec.to_json(), "target": str(target), "cache": os.path.abspath(cache.root)}
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            reply = self.process.stdout.readline()
        except (OSError, ValueError):
            reply = ""
        if reply:
            return json.loads(reply).get("error")
        return self._death()

    def _death(self) -> str:
        """Why the worker ended without replying (it is reaped here)."""
        code = self.process.wait()
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"TVM crashed while compiling it ({name}: {signal.strsignal(-code) or 'killed'})"
        last = self._last_error_line()
        return f"the build worker exited with code {code} while compiling it" + (f": {last}" if last else "")

    def _last_error_line(self) -> str:
        self.stderr.seek(0)
        lines = [line.strip() for line in self.stderr.read().decode(errors="replace").splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def close_input(self) -> None:
        """Close its input: an idle worker then exits."""
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def reap(self) -> None:
        """Wait for the process to end (killing it after STOP_SECONDS) and release its files."""
        try:
            self.process.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.stderr.close()

    def stop(self) -> None:
        """End the process and reap it."""
        self.close_input()
        self.reap()


class _Pool:
    """The build workers of this process: idle ones wait for the next build, busy ones compile."""

    def __init__(self):
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.idle: list[_Worker] = []
        self.busy: set[_Worker] = set()
        self.timer: threading.Timer | None = None

    def acquire(self) -> _Worker:
        """An idle live worker, else a new one."""
        with self.lock:
            while self.idle:
                worker = self.idle.pop()
                if worker.alive:
                    self.busy.add(worker)
                    return worker
                worker.stop()
            worker = _Worker()
            self.busy.add(worker)
            return worker

    def release(self, worker: _Worker) -> None:
        """Back to the idle workers when it is alive (stopped after IDLE_SECONDS unused), else reaped."""
        with self.lock:
            self.busy.discard(worker)
            if not worker.alive:
                worker.stop()
                return
            self.idle.append(worker)
            if self.timer is not None:
                self.timer.cancel()
            # The timer restarts at every release, so when it fires every idle worker has been idle that long.
            self.timer = threading.Timer(IDLE_SECONDS, self.stop_idle)
            self.timer.daemon = True
            self.timer.start()

    def stop_idle(self) -> None:
        """Stop every idle worker."""
        with self.lock:
            idle, self.idle = self.idle, []
        for worker in idle:
            worker.close_input()  # all at once: they shut down in parallel
        for worker in idle:
            worker.reap()

    def kill_busy(self) -> None:
        """Kill the workers compiling now (their drivers see them die and hand them back)."""
        with self.lock:
            busy = list(self.busy)
        for worker in busy:
            if worker.alive:
                worker.process.kill()

    def close(self) -> None:
        """Stop every worker (at exit)."""
        if self.timer is not None:
            self.timer.cancel()
        self.kill_busy()
        self.stop_idle()


_POOL: _Pool | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> _Pool:
    """This process's pool (a forked child starts its own: the parent's workers are not its to use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid():
            _POOL = _Pool()
        return _POOL


def stop_build_workers() -> None:
    """Stop this process's build workers now (they also stop when idle, and at exit)."""
    with _POOL_LOCK:
        pool = _POOL
    if pool is not None and pool.pid == os.getpid():
        pool.close()


atexit.register(stop_build_workers)


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
