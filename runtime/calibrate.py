"""`tessel calibrate`: measure the link between two local workers and fit time = alpha + beta * bytes.

Rank 0 sends messages of growing size to rank 1, which sends each back; half
the median round trip is the one-way time. `fit_link` fits alpha (latency) and
beta (seconds per byte) to (bytes, seconds) by least squares, never with alpha
below what the smallest message took, and reports the fit's residual; they are
stored as link.json in the cache root, and the placement cost model reads them
back with `load_link` (a default marked estimated until the first calibration).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from tessel import IMPORT_ROOT
from tessel.backends.cache import cache_root
from tessel.passes.machine import Link

SIZES = (4, 1 << 10, 16 << 10, 128 << 10, 1 << 20, 4 << 20, 16 << 20)
# Loopback gloo on this class of machine until `tessel calibrate` measures it.
DEFAULT_LINK = Link(alpha=60e-6, beta=1 / 1.5e9, measured=False)


def link_path() -> Path:
    """Where the link calibration lives: link.json in the cache root."""
    return cache_root() / "link.json"


def load_link() -> Link:
    """The calibrated link (α, β) if `tessel calibrate` ran on this machine, else the default."""
    try:
        doc = json.loads(link_path().read_text())
        return Link(float(doc["alpha_s"]), float(doc["beta_s_per_byte"]), measured=True)
    except (OSError, ValueError, KeyError):
        return DEFAULT_LINK


@dataclass(frozen=True)
class LinkFit:
    """alpha and beta fitted to one-way times, the fit's residual and the smallest message's own time."""

    alpha: float
    beta: float
    # Root mean square of (predicted - measured) / measured over the message sizes.
    relative_residual: float
    smallest_bytes: int
    smallest_seconds: float

    def describe(self) -> str:
        """One line for people: alpha against the smallest message, beta, the residual."""
        return (f"alpha {1e6 * self.alpha:.1f} us (the {self.smallest_bytes}-byte message took "
                f"{1e6 * self.smallest_seconds:.1f} us one way), beta {1e9 * self.beta:.3f} ns/byte "
                f"({1 / self.beta / 1e9:.2f} GB/s), fit residual {100 * self.relative_residual:.1f}% rms")


def fit_link(samples: Sequence[tuple[int, float]]) -> LinkFit:
    """Fit one-way time = alpha + beta * bytes to (bytes, seconds) samples of several sizes.

    The times span orders of magnitude (tens of µs for 4 bytes, milliseconds for MiBs): an unweighted fit lets the
    largest messages decide alpha, which then comes out near zero or negative. Each sample is weighted by
    1 / its time, so the fit minimizes the relative errors and every size counts alike. The line is also kept from
    passing below the smallest message (alpha + beta * its bytes >= its time): a link model must not promise small
    transfers faster than one was measured. When the unconstrained fit breaks that, the constrained least-squares
    line goes through the smallest sample, and only its slope is fitted. beta stays positive.
    """
    if len(samples) < 2:
        raise ValueError("fitting a link needs samples of at least two message sizes")
    sizes = np.array([s[0] for s in samples], float)
    seconds = np.array([s[1] for s in samples], float)
    weights = 1.0 / seconds
    small = int(np.argmin(sizes))
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weights[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, seconds * weights, rcond=None)
    beta = max(float(beta), 1e-15)
    if alpha + beta * sizes[small] < seconds[small]:
        dx, dy = (sizes - sizes[small]) * weights, (seconds - seconds[small]) * weights
        beta = max(float(dx @ dy / (dx @ dx)), 1e-15)
        alpha = seconds[small] - beta * sizes[small]
    predicted = alpha + beta * sizes
    residual = float(np.sqrt(np.mean(((predicted - seconds) / seconds) ** 2)))
    return LinkFit(float(alpha), beta, residual, int(sizes[small]), float(seconds[small]))


def save_link(fit: LinkFit, samples: Sequence[tuple[int, float]]) -> Path:
    """Store a calibration; returns its path."""
    path = link_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"alpha_s": fit.alpha, "beta_s_per_byte": fit.beta,
                                "relative_residual": fit.relative_residual,
                                "samples": [{"bytes": b, "seconds": s} for b, s in samples]}, indent=1))
    return path


def calibrate(repeat: int = 20) -> tuple[LinkFit, Path]:
    """Run the ping-pong on two local workers; store and return the fit and its cache path."""
    fit, samples = measure_link(repeat)
    return fit, save_link(fit, samples)


def measure_link(repeat: int = 20) -> tuple[LinkFit, list[tuple[int, float]]]:
    """Run the ping-pong on two local workers; the fit and its samples (bytes, seconds one way), not stored."""
    import subprocess

    from tessel.runtime.errors import ExecutionError
    from tessel.runtime.launch import free_port

    with tempfile.TemporaryDirectory(prefix="tessel-calibrate-") as scratch:
        result = Path(scratch) / "samples.json"
        port = free_port()
        processes = []
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            processes.append(subprocess.Popen([sys.executable, "-m", "tessel.runtime.calibrate", str(result), str(repeat)], env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              cwd=IMPORT_ROOT))
        for p in processes:
            try:
                _, err = p.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                p.kill()
                raise ExecutionError("calibration workers did not finish within 300 s") from None
            if p.returncode != 0:
                raise ExecutionError(f"calibration worker failed: {(err.strip().splitlines() or ['no message'])[-1]}")
        samples = [tuple(s) for s in json.loads(result.read_text())]
    return fit_link(samples), samples


def _ping_pong(result: str, repeat: int) -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    samples = []
    for size in SIZES:
        buffer = torch.zeros(max(size // 4, 1), dtype=torch.float32)
        times = []
        for _ in range(repeat + 2):
            dist.barrier()
            started = time.perf_counter()
            if rank == 0:
                dist.send(buffer, dst=1)
                dist.recv(buffer, src=1)
            else:
                dist.recv(buffer, src=0)
                dist.send(buffer, dst=0)
            times.append((time.perf_counter() - started) / 2)
        samples.append((size, float(np.median(times[2:]))))
    if rank == 0:
        Path(result).write_text(json.dumps(samples))
    dist.destroy_process_group()


if __name__ == "__main__":
    _ping_pong(sys.argv[1], int(sys.argv[2]))
