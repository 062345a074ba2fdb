"""`tessel calibrate`: measure the link between two local workers and fit time = alpha + beta * bytes.

Rank 0 sends messages of growing size to rank 1, which sends each back; half
the median round trip is the one-way time. A least-squares line through
(bytes, seconds) gives alpha (latency) and beta (seconds per byte), stored
as link.json in the cache root; the placement cost model reads them back with
`load_link` (a default marked estimated until the first calibration).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from datetime import timedelta
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


def save_link(alpha: float, beta: float, samples: Sequence[tuple[int, float]]) -> Path:
    """Store a calibration; returns its path."""
    path = link_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"alpha_s": alpha, "beta_s_per_byte": beta,
                                "samples": [{"bytes": b, "seconds": s} for b, s in samples]}, indent=1))
    return path


def calibrate(repeat: int = 20) -> tuple[float, float, Path]:
    """Run the ping-pong on two local workers; store and return (alpha, beta, cache path)."""
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
    sizes = np.array([s[0] for s in samples], float)
    seconds = np.array([s[1] for s in samples], float)
    beta, alpha = np.polyfit(sizes, seconds, 1)
    alpha, beta = max(float(alpha), 1e-7), max(float(beta), 1e-13)
    return alpha, beta, save_link(alpha, beta, samples)


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
