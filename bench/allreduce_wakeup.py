"""How long an all-reduce takes right after the workers computed, against the same all-reduce back to back.

    flock /tmp/tessel_heavy.lock nice -n 5 python bench/allreduce_wakeup.py [--floats 8874] [--compute-ms 4] [--reps 100]
        [--via gloo|shm|both]

Two local ranks (one thread each, as bench/train_distributed.py's workers) all-reduce a float32 buffer (by default
the transformer block's gradient bucket) --reps times: first back to back, then each after --compute-ms of busy
computing (a data-parallel step's backward). Rank 0 prints the median and 90th percentile of the wait. On an idle
machine both are alike; when other processes want the cores, a rank that just computed has used its fair share,
so gloo's threads, woken by the peer's data, wait for a time slice behind them: the wait after computing grows to
milliseconds (what the workers' step profile shows as the all-reduce wait, runtime/step_profile.py). --via shm
times the local workers' shared-memory all-reduce instead (runtime/shared_reduce.py), done on the rank's own thread.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _busy(seconds: float) -> None:
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        pass


def _rank(floats: int, compute_s: float, reps: int, via: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    bucket = torch.zeros(floats)
    if via == "shm":
        from tessel.runtime.shared_reduce import REDUCE_ENV, SharedReduce

        shared = SharedReduce.attach(os.environ[REDUCE_ENV], rank, 120.0)
        array = bucket.numpy()
        reduce = lambda: shared.all_reduce(array, "sum", "bucket")  # noqa: E731
    else:
        reduce = lambda: dist.all_reduce(bucket, async_op=True).wait()  # noqa: E731
    for label, compute in (("back to back", 0.0), (f"after {1e3 * compute_s:g} ms computing", compute_s)):
        waits = []
        for _ in range(reps):
            _busy(compute)
            started = time.perf_counter()
            reduce()
            waits.append(time.perf_counter() - started)
        if rank == 0:
            print(f"{via}: {floats * 4} bytes, {label}: median {1e6 * np.median(waits):.0f} us, "
                  f"p90 {1e6 * np.percentile(waits, 90):.0f} us", flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    """Start the two ranks and print rank 0's lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floats", type=int, default=8874)
    parser.add_argument("--compute-ms", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--via", choices=("gloo", "shm", "both"), default="both")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        _rank(args.floats, args.compute_ms / 1e3, args.reps, args.via)
        return 0
    sys.path.insert(0, str(ROOT))
    status = 0
    for via in ("gloo", "shm") if args.via == "both" else (args.via,):
        status = max(status, _pair(args, via))
    return status


def _pair(args, via: str) -> int:
    """Run the two ranks all-reducing `via` gloo or shared memory; the worse exit status."""
    from tessel.runtime.launch import free_port
    from tessel.runtime.shared_reduce import REDUCE_ENV, close_layout, create_layout, descriptors

    port = str(free_port())
    command = [sys.executable, str(Path(__file__).resolve()), "--rank", "--floats", str(args.floats),
               "--compute-ms", str(args.compute_ms), "--reps", str(args.reps), "--via", via]
    layout = create_layout(2)
    try:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT), REDUCE_ENV: json.dumps(layout)}
        ranks = [subprocess.Popen(command, env={**env, "RANK": str(r)}, pass_fds=descriptors(layout))
                 for r in range(2)]
    finally:
        close_layout(layout)
    return max(p.wait() for p in ranks)


if __name__ == "__main__":
    sys.exit(main())
