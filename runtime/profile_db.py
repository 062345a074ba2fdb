"""The profile database: measured kernel times per machine, kept in the cache root as profiles.json.

A placement or algorithm choice reads a node's time from here; a node never
measured gets a FLOP/byte roofline estimate (ESTIMATE_FLOPS_PER_S,
ESTIMATE_BYTES_PER_S) and is marked estimated.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Mapping

from tessel.backends.cache import cache_root

# Roofline of one CPU core for nodes never measured: rough, and marked as estimated.
ESTIMATE_FLOPS_PER_S = 50e9  # ResNet-18's convs reach 50-120 GFLOP/s per core here (AVX-512)
ESTIMATE_BYTES_PER_S = 5e9

# A measured time is trusted this long; then the kernel is timed again (the machine, its load or its
# firmware may have changed since).
PROFILE_MAX_AGE_S = 30 * 24 * 3600
# The suffix of a time measured inside a step's programs (compiler/step_kernels.py), followed by how many workers ran
# theirs at once: a kernel there runs after other kernels evicted its data, not right after itself, and shares the
# caches and memory with the other workers, so it takes longer than timed on its own, and longer beside more workers.
IN_STEP = "#in-step"


def profiles_path() -> Path:
    """Where the profile database lives: profiles.json in the cache root."""
    return cache_root() / "profiles.json"


def machine_fingerprint() -> str:
    """What a measured time depends on besides the kernel: the CPU model and core count."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} x{os.cpu_count()}"


class ProfileDB:
    """Measured kernel times, (kernel key, threads) → median milliseconds, and kernel workspace bytes, in one JSON file.

    Staleness: a time counts only on the machine that measured it (CPU model and
    core count) and for PROFILE_MAX_AGE_S; the kernel key already changes with
    the TVM version and the backend's sources. Older or foreign times read as
    missing, so they are measured again; `--reprofile` measures everything again.
    """

    def __init__(self, path: Path | None = None, now: float | None = None):
        self.path = path or profiles_path()
        self.now = time.time() if now is None else now
        self.machine = machine_fingerprint()
        try:
            self.entries: dict[str, dict] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}

    @staticmethod
    def key(kernel: str, threads: int, step_workers: int = 0) -> str:
        """The entry name of a kernel run with `threads` threads: timed on its own, call after call (the
        default), or where a training step of `step_workers` workers calls it, in program order on the step's
        buffers, every worker running its program at once."""
        return f"{kernel}@{threads}{f'{IN_STEP}{step_workers}' if step_workers else ''}"

    def get(self, kernel: str, threads: int, step_workers: int = 0) -> float | None:
        """Median milliseconds, or None when never measured here or measured too long ago."""
        entry = self.entries.get(self.key(kernel, threads, step_workers))
        if not isinstance(entry, dict) or entry.get("machine") != self.machine:
            return None
        if self.now - float(entry.get("at", 0)) > PROFILE_MAX_AGE_S:
            return None
        return float(entry["ms"])

    def workspace(self, kernel: str) -> int | None:
        """Workspace bytes recorded for a kernel, or None (a property of the code: it never goes stale)."""
        entry = self.entries.get(f"{kernel}#workspace")
        return int(entry["bytes"]) if isinstance(entry, dict) else None

    def put_workspace(self, kernel: str, nbytes: int) -> None:
        """Record a kernel's workspace bytes (written with the next `put`)."""
        self.entries[f"{kernel}#workspace"] = {"bytes": int(nbytes)}

    def put(self, times: Mapping[str, float]) -> None:
        """Record measurements (entry name → milliseconds) and write the file (atomically)."""
        self.entries.update({name: {"ms": ms, "at": self.now, "machine": self.machine} for name, ms in times.items()})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(f".tmp{os.getpid()}")
        temporary.write_text(json.dumps(self.entries, indent=0, sort_keys=True))
        temporary.replace(self.path)
