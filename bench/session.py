"""InferenceSession measurements (issue 16's "done when"), all in one run.

1. A 2-worker session (`--two DIR`, e.g. resnet18 compiled with --devices 2): the first call (start-up included),
   then later calls: the round trip, the time rank 0 spends on the request (compute and transfers between the
   workers), and the session's overhead (the difference); beside it the same model on one worker in this process
   (`--one DIR`, compiled with --devices 1), when given.
2. `--loop N` calls in a loop: open files (/proc/PID/fd) and resident memory (VmRSS) of this process and of every
   worker, before and after (after a warm-up), and the workers' pids (the same ones, and no other process).
3. kill -9 of a worker: how long the next call takes to fail, its one line, how long close() takes, and whether
   any worker is left.
4. Streaming (`--pipeline DIR`, e.g. resnet18 --batch 8 --devices 2 --placement pipeline --microbatches 4): `--stream`
   requests through the 2-worker pipeline session (one thread per worker) against the same batch on one worker
   in this process (`--pipeline-one DIR ...`: resnet18 --batch 8, and --batch 8 --microbatches 4, the
   pipeline's own kernels; one thread), timed before and after the pipeline, in the same run.

    python bench/session.py --two r18_d2 --one r18_d1 --pipeline r18_b8_pipe \
        --pipeline-one r18_b8_d1 r18_b8_mb4_d1 [--loop 1000]
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from tessel.compiler.artifact import load  # noqa: E402
from tessel.runtime.errors import ExecutionError  # noqa: E402
from tessel.runtime.inputs import random_input  # noqa: E402
from tessel.runtime.session import InferenceSession  # noqa: E402


def _feeds(artifact, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: random_input(t, rng) for name, t in artifact.batch_input_types().items()}


def _usage(pid: int) -> tuple[int, int]:
    """(open files, resident KiB) of process `pid`."""
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return len(os.listdir(f"/proc/{pid}/fd")), rss


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except OSError:
                pass
    return sorted(found)


def _ms(seconds) -> str:
    return f"{1e3 * float(seconds):.3f} ms"


def two_workers(directory: str, one: str | None, calls: int, loop: int) -> None:
    started = time.perf_counter()
    session = InferenceSession(directory, threads=1)
    feeds = _feeds(load(directory))
    session.run(feeds)
    print(f"2-worker session of {directory}: first call (start-up included) {_ms(time.perf_counter() - started)}")
    rounds, inside = [], []
    for _ in range(calls + 5):
        t0 = time.perf_counter()
        request = session.run_async(feeds)
        request.result()
        rounds.append(time.perf_counter() - t0)
        inside.append(request.worker_seconds)
    rounds, inside = np.array(rounds[5:]), np.array(inside[5:])
    print(f"  later calls ({calls}): round trip p50 {_ms(np.median(rounds))}, rank 0 on the request "
          f"(compute + transfers) p50 {_ms(np.median(inside))}, overhead p50 {_ms(np.median(rounds - inside))} "
          f"(p10 {_ms(np.percentile(rounds - inside, 10))}, p90 {_ms(np.percentile(rounds - inside, 90))})")
    if one:
        with InferenceSession(one, threads=1) as alone:
            single = _feeds(load(one))
            alone.run(single)
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                alone.run(single)
                times.append(time.perf_counter() - t0)
        print(f"  the same model on one worker in this process (1 thread): p50 {_ms(np.median(times))}")
    if loop:
        pids = session.worker_pids
        for _ in range(20):
            session.run(feeds)
        before = {pid: _usage(pid) for pid in [os.getpid(), *pids]}
        t0 = time.perf_counter()
        for _ in range(loop):
            session.run(feeds)
        spent = time.perf_counter() - t0
        after = {pid: _usage(pid) for pid in [os.getpid(), *pids]}
        print(f"  {loop} calls in a loop ({_ms(spent / loop)} each): workers {pids} -> {session.worker_pids}, "
              f"children of this process {_children(os.getpid())}")
        for pid, label in zip(before, ["client", *(f"rank {r}" for r in range(len(pids)))]):
            print(f"    {label}: open files {before[pid][0]} -> {after[pid][0]}, RSS {before[pid][1]} -> {after[pid][1]} KiB")
    pids = session.worker_pids
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.perf_counter()
    try:
        session.run(feeds)
        print("  kill -9 of rank 1: the next call did NOT fail")
    except ExecutionError as exc:
        print(f"  kill -9 of rank 1: the next call failed after {_ms(time.perf_counter() - t0)} "
              f"(timeout {session.timeout:g} s): {type(exc).__name__}: {exc}")
    t0 = time.perf_counter()
    session.close()
    print(f"  close() returned after {_ms(time.perf_counter() - t0)}; children left: {_children(os.getpid())}")


def _stream(directory: str, feeds: list[dict[str, np.ndarray]], requests: int) -> float:
    """Requests per second streaming `requests` runs through a session of `directory` (one thread per worker)."""
    with InferenceSession(directory, threads=1) as session:
        session.run(feeds[0])
        t0 = time.perf_counter()
        for _ in session.run_many(feeds[k % len(feeds)] for k in range(requests)):
            pass
        return requests / (time.perf_counter() - t0)


def pipeline(directory: str, ones: list[str], requests: int) -> None:
    artifact = load(directory)
    feeds = [_feeds(artifact, seed) for seed in range(4)]
    # One worker, the pipeline, one worker again: the load of the machine shows as a difference between the two.
    singles = [[_stream(one, feeds, requests)] for one in ones]
    streamed = _stream(directory, feeds, requests)
    for one, single in zip(ones, singles):
        single.append(_stream(one, feeds, requests))
    print(f"streaming {requests} requests of {directory}: 2-stage pipeline session {streamed:.3f} requests/s")
    for one, single in zip(ones, singles):
        print(f"  one worker ({one}): {single[0]:.3f} and {single[1]:.3f} requests/s: pipeline / one worker "
              f"{streamed / max(single):.2f}x to {streamed / min(single):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--two", metavar="DIR", help="an artifact compiled with --devices 2")
    parser.add_argument("--one", metavar="DIR", help="the same model compiled for one device")
    parser.add_argument("--calls", type=int, default=50, help="later calls timed")
    parser.add_argument("--loop", type=int, default=0, metavar="N", help="calls in the leak check")
    parser.add_argument("--pipeline", metavar="DIR", help="a pipeline artifact (--devices 2 --microbatches K)")
    parser.add_argument("--pipeline-one", nargs="+", default=[], metavar="DIR",
                        help="the same batch compiled for one device (several: each is compared)")
    parser.add_argument("--stream", type=int, default=64, metavar="N", help="requests streamed")
    args = parser.parse_args()
    if args.two:
        two_workers(args.two, args.one, args.calls, args.loop)
    if args.pipeline and args.pipeline_one:
        pipeline(args.pipeline, args.pipeline_one, args.stream)


if __name__ == "__main__":
    main()
