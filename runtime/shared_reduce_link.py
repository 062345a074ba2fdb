"""The α-β cost of the shared-memory all-reduce (runtime/shared_reduce.py) that a local worker group runs.

`tessel calibrate` measures loopback gloo (runtime/calibrate.py); a local group's all-reduces do not go through
gloo but through one shared segment, at a different cost (a copy in, a sum, a copy out, and two waits on the
peers). Its cost model is measured here the same way: `workers` local processes all-reduce tensors of growing
size, each after a one-float all-reduce that lines them up (a barrier), and rank 0's median time per size is
fitted to time = α + β·bytes (runtime/calibrate.py `fit_link`). The fit is stored per worker count in
shared_reduce_link.json in the cache root, beside link.json; `load_shared_reduce_link` reads it back.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from tessel import IMPORT_ROOT
from tessel.backends.cache import cache_root
from tessel.passes.machine import Link

from .calibrate import LinkFit, fit_link
from .errors import ExecutionError
from .shared_reduce import REDUCE_ENV, SharedReduce, close_layout, create_layout, descriptors

SIZES = (4, 16 << 10, 128 << 10, 1 << 20, 4 << 20)
_RANK_ENV = "TESSEL_CALIBRATE_RANK"
_TIMEOUT_S = 300.0


def shared_reduce_link_path() -> Path:
    """Where the shared-memory all-reduce's calibration lives: shared_reduce_link.json in the cache root."""
    return cache_root() / "shared_reduce_link.json"


def load_shared_reduce_link(workers: int) -> Link | None:
    """The shared-memory all-reduce's measured cost among `workers` local workers, None before it was measured."""
    try:
        doc = json.loads(shared_reduce_link_path().read_text())[str(workers)]
        return Link(float(doc["alpha_s"]), float(doc["beta_s_per_byte"]), measured=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def allreduce_link(link: Link, workers: int) -> Link:
    """The α-β cost of an all-reduce among `workers` local workers: the shared-memory all-reduce's measured one
    where the group runs it (runtime/shared_reduce.py `available`) and `tessel calibrate` measured it, else `link`
    (gloo's)."""
    from .shared_reduce import available

    measured = load_shared_reduce_link(workers) if available() else None
    return measured or link


def describe(fit: LinkFit) -> str:
    """One line for people: α against the smallest all-reduce, β, the fit's residual."""
    return (f"alpha {1e6 * fit.alpha:.1f} us (a {fit.smallest_bytes}-byte all-reduce took "
            f"{1e6 * fit.smallest_seconds:.1f} us), beta {1e9 * fit.beta:.3f} ns/byte, "
            f"fit residual {100 * fit.relative_residual:.1f}% rms")


def calibrate_shared_reduce(workers: int = 2, repeat: int = 20) -> tuple[LinkFit, Path]:
    """Measure the shared-memory all-reduce among `workers` local processes; store and return the fit and its path."""
    fit, samples = measure_shared_reduce(workers, repeat)
    path = shared_reduce_link_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = {}
    doc[str(workers)] = {"alpha_s": fit.alpha, "beta_s_per_byte": fit.beta,
                         "relative_residual": fit.relative_residual,
                         "samples": [{"bytes": b, "seconds": s} for b, s in samples]}
    path.write_text(json.dumps(doc, indent=1))
    return fit, path


def measure_shared_reduce(workers: int = 2, repeat: int = 20,
                          sizes: Sequence[int] = SIZES) -> tuple[LinkFit, list[tuple[int, float]]]:
    """All-reduce tensors of `sizes` bytes `repeat` times among `workers` fresh local processes through a shared
    segment; the fit and its samples (bytes, rank 0's median seconds), not stored."""
    layout = create_layout(workers)
    with tempfile.TemporaryDirectory(prefix="tessel-calibrate-shm-") as scratch:
        result = Path(scratch) / "samples.json"
        command = [sys.executable, "-m", "tessel.runtime.shared_reduce_link", str(result), str(repeat),
                   ",".join(map(str, sizes))]
        try:
            processes = [subprocess.Popen(command, env={**os.environ, REDUCE_ENV: json.dumps(layout),
                                                        _RANK_ENV: str(rank)},
                                          pass_fds=descriptors(layout), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, cwd=IMPORT_ROOT)
                         for rank in range(workers)]
        finally:
            close_layout(layout)
        for process in processes:
            try:
                _, err = process.communicate(timeout=_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                for p in processes:
                    p.kill()
                raise ExecutionError("shared-memory calibration workers did not finish within "
                                     f"{_TIMEOUT_S:g} s") from None
            if process.returncode != 0:
                raise ExecutionError("shared-memory calibration worker failed: "
                                     f"{(err.strip().splitlines() or ['no message'])[-1]}")
        samples = [tuple(s) for s in json.loads(result.read_text())]
    return fit_link(samples), samples


def _rank_main(result: str, repeat: int, sizes: Sequence[int]) -> None:
    """One calibration rank: time each size's all-reduce after a barrier; rank 0 writes the medians."""
    rank = int(os.environ[_RANK_ENV])
    shared = SharedReduce.attach(os.environ[REDUCE_ENV], rank, _TIMEOUT_S)
    barrier = np.zeros(1, np.float32)
    samples = []
    for size in sizes:
        tensor = np.ones(max(size // 4, 1), np.float32)
        times = []
        for _ in range(repeat + 2):
            shared.all_reduce(barrier, "sum", "barrier")
            started = time.perf_counter()
            shared.all_reduce(tensor, "mean", "calibration")
            times.append(time.perf_counter() - started)
        samples.append((tensor.nbytes, float(np.median(times[2:]))))
    if rank == 0:
        Path(result).write_text(json.dumps(samples))
    shared.close()


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3].split(",")])
