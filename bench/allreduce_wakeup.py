"""How long an all-reduce takes right after the workers computed, against the same all-reduce back to back.

    flock /tmp/tessel_heavy.lock nice -n 5 python bench/allreduce_wakeup.py [--floats 8874] [--compute-ms 4] [--reps 100]
        [--via gloo|shm|both] [--skew-ms S]

Two local ranks (one thread each, as bench/train_distributed.py's workers) all-reduce a float32 buffer (by default
the transformer block's gradient bucket) --reps times: first back to back, then each after --compute-ms of busy
computing (a data-parallel step's backward). Rank 0 prints the median and 90th percentile of the wait. On an idle
machine both are alike; when other processes want the cores, a rank that just computed has used its fair share,
so gloo's threads, woken by the peer's data, wait for a time slice behind them: the wait after computing grows to
milliseconds (what the workers' step profile shows as the all-reduce wait, runtime/step_profile.py). --via shm
times the local workers' shared-memory all-reduce instead (runtime/shared_reduce.py), done on the rank's own thread.

With --skew-ms S the shared-memory all-reduce is timed as a step uses it instead: each rank issues the reduction,
then computes --compute-ms (the rest of backward), rank 1 issuing S ms after rank 0 (the peers' skew). Rank 0 prints
its median iteration time twice: the reduction done where it is issued (it waits out the skew before computing)
and started on the reducer thread (it computes while the reduction waits for the peer), as the workers do.
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


def _native_busy(seconds: float) -> None:
    """Compute for `seconds` in native code that lets go of the GIL (as the workers' kernels do), not in Python."""
    matrix = np.ones((96, 96), np.float32)
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        np.dot(matrix, matrix)


def _overlap(shared, array: np.ndarray, rank: int, compute_s: float, skew_s: float, reps: int) -> None:
    """Rank 0's median iteration (issue, compute) with the reduction done at issue, then started on the reducer
    thread; rank 1 issues `skew_s` later."""
    for label, started_reduce in (("done where issued", False), ("on the reducer thread", True)):
        times = []
        for _ in range(reps):
            shared.all_reduce(np.zeros(1, np.float32), "sum", "barrier")
            started = time.perf_counter()
            if rank == 1:
                _native_busy(skew_s)
            if started_reduce:
                wait = shared.start_all_reduce(array, "sum", "bucket")
                _native_busy(compute_s)
                wait()
            else:
                shared.all_reduce(array, "sum", "bucket")
                _native_busy(compute_s)
            times.append(time.perf_counter() - started)
        if rank == 0:
            print(f"shm, peer {1e3 * skew_s:g} ms late, then {1e3 * compute_s:g} ms computing, reduction {label}: "
                  f"median {1e3 * np.median(times):.2f} ms, p90 {1e3 * np.percentile(times, 90):.2f} ms", flush=True)


def _rank(floats: int, compute_s: float, reps: int, via: str, skew_s: float = 0.0) -> None:
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
    if skew_s:
        _overlap(shared, bucket.numpy(), rank, compute_s, skew_s, reps)
        dist.destroy_process_group()
        return
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
    parser.add_argument("--skew-ms", type=float, default=0.0,
                        help="time the shared-memory all-reduce issued before computing, rank 1 this late")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.skew_ms:
        args.via = "shm"
    if args.rank:
        _rank(args.floats, args.compute_ms / 1e3, args.reps, args.via, args.skew_ms / 1e3)
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
               "--compute-ms", str(args.compute_ms), "--reps", str(args.reps), "--via", via,
               "--skew-ms", str(args.skew_ms)]
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
