"""One worker of a multi-device artifact: `python -m tessel.runtime.worker DIR` (what torchrun runs, too).

Rank and world size come from RANK and WORLD_SIZE, the rendezvous from
MASTER_ADDR and MASTER_PORT (torchrun sets all four; `tessel run` sets them for
local workers on 127.0.0.1). Rank r runs worker r's program (transfers, scatters
and gathers between workers are instructions of the programs); rank 0 reads the
inputs (an .npz, or random ones), splits them into micro-batches, and writes
the outputs. Any failure — a kernel error, a peer that died, a rendezvous or
a tensor not done within --timeout, the launcher gone — prints one line naming this rank and exits 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

from tessel.runtime.errors import PEER_PREFIX, WORKER_PREFIX, PeerError
from tessel.runtime.gpu_workers import EXIT_NOT_ENOUGH_GPUS, NotEnoughGpus

EXIT_FAILED = 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tessel.runtime.worker", description="Run one worker of a Tessel artifact.")
    parser.add_argument("artifacts", nargs="+", metavar="artifact", help="artifact directory compiled with --devices N "
                        "(several: run each in turn on the same workers)")
    parser.add_argument("--inputs", metavar="IN.npz", help="model inputs (rank 0; default: random)")
    parser.add_argument("--outputs", metavar="OUT.npz", help="where rank 0 writes the outputs")
    parser.add_argument("--io-dir", metavar="DIR", help="with several artifacts: inputs in DIR/in<k>.npz (if there), "
                        "outputs to DIR/out<k>.npz, times to DIR/times<k>.json")
    parser.add_argument("--repeat", type=int, default=0, metavar="N",
                        help="after the first run, stream N more back to back and time them")
    parser.add_argument("--timeout", type=float, default=30.0, metavar="S",
                        help="seconds to wait for the rendezvous and for each transfer from a peer")
    parser.add_argument("--report", metavar="TIMES.json", help="where rank 0 writes the measured times")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    # torch's C++ log would add a screen of retry warnings and backtraces to the one line a failure prints
    # (read when torch loads, hence before any import of it; set it yourself to see them).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    threads = int(os.environ.get("TESSEL_THREADS", str(max(1, (os.cpu_count() or 1) // local_world))))
    if LAUNCHER_ENV in os.environ:
        leave_with_the_launcher(int(os.environ[LAUNCHER_ENV]), rank)
    try:
        return _run(args, rank, world, threads)
    except KeyboardInterrupt:
        os._exit(EXIT_FAILED)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and a non-zero exit
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if not message.startswith("rank "):
            message = f"rank {rank}: {message}"
        # A transfer that failed because of another worker is marked: the launcher prefers that worker's own line.
        print(f"{PEER_PREFIX if isinstance(exc, PeerError) else WORKER_PREFIX}{message}", file=sys.stderr, flush=True)
        # Leave without tearing down the process group: a dead peer would make that hang.
        os._exit(EXIT_NOT_ENOUGH_GPUS if isinstance(exc, NotEnoughGpus) else EXIT_FAILED)


# Set by runtime.launch: the pid of the launching process, which this worker must not outlive.
LAUNCHER_ENV = "TESSEL_LAUNCHER_PID"
LAUNCHER_POLL_S = 1.0


def leave_with_the_launcher(launcher: int, rank: int) -> None:
    """Exit as soon as the launcher is gone (killed with SIGKILL, it can stop nobody): the worker runs in
    its own session, so nothing else would end it before its peers' receives time out, if ever."""
    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(LAUNCHER_POLL_S)
        print(f"tessel worker: rank {rank}: the launcher (pid {launcher}) is gone; stopping", file=sys.stderr, flush=True)
        os._exit(EXIT_FAILED)

    threading.Thread(target=watch, name="tessel-launcher-watch", daemon=True).start()


def _run(args, rank: int, world: int, threads: int) -> int:
    import torch.distributed as dist

    from tessel.runtime.artifact_files import read_plan, worker_count
    from tessel.runtime.comm import TorchComm, join_group
    from tessel.runtime.errors import ArtifactError
    from tessel.runtime.executor import Executor
    from tessel.runtime.gpu_workers import prepare_worker

    plans = [read_plan(Path(a)) for a in args.artifacts]
    for artifact, plan in zip(args.artifacts, plans):
        workers = worker_count(plan)
        if world != workers:
            raise ArtifactError(f"{artifact}: the artifact runs on {workers} worker(s) but {world} were started")
    backend, device = prepare_worker(plans, rank, world)
    join_group(rank, world, args.timeout, EXIT_FAILED, backend)
    comm = TorchComm(rank, args.timeout)
    for k, (artifact, plan) in enumerate(zip(args.artifacts, plans)):
        io = Path(args.io_dir) if args.io_dir else None
        inputs = str(io / f"in{k}.npz") if io and (io / f"in{k}.npz").is_file() else args.inputs
        outputs = str(io / f"out{k}.npz") if io else args.outputs
        report = str(io / f"times{k}.json") if io else args.report
        executor = Executor(artifact, threads=threads, worker=rank, comm=comm, device=device)
        microbatches = int(plan.get("microbatches", 1))
        slices = _input_slices(inputs, plan, rank, microbatches)
        run_batch = _pipelined_run(executor, slices)
        # The first run gives the outputs (and warms up); with --repeat, one more run alone gives the
        # latency, then the runs stream back to back: each device starts the next batch as soon as
        # it is free (the pipeline's steady-state throughput).
        parts = run_batch()()
        latency = None
        if args.repeat:
            dist.barrier()
            started = time.perf_counter()
            run_batch()()
            latency = time.perf_counter() - started
        dist.barrier()
        started = time.perf_counter()
        _stream(run_batch, args.repeat, STREAM_WINDOW_PER_WORKER * world)
        executor.finish_sends()
        streamed = (time.perf_counter() - started) / args.repeat if args.repeat else None
        dist.barrier()
        if rank == 0:
            if outputs:
                results = {name: np.concatenate([p[name] for p in parts]) if len(parts) > 1 else parts[0][name]
                           for name in parts[0]}
                np.savez(outputs, **results)
            if report:
                Path(report).write_text(json.dumps({"latency_s": latency, "seconds_per_batch": streamed,
                                                    "runs": args.repeat, "workers": world, "threads": threads}))
    dist.destroy_process_group()
    return 0


# Batches in flight while streaming: enough to fill every stage of the pipeline, few enough that a
# rank whose outputs arrive from a peer does not pile up a receive buffer per run (--repeat 100000).
STREAM_WINDOW_PER_WORKER = 2


def _stream(run_batch, runs: int, window: int) -> None:
    """Start `runs` batches back to back, waiting for the oldest whenever `window` are in flight."""
    in_flight = deque()
    for _ in range(runs):
        in_flight.append(run_batch())
        if len(in_flight) > window:
            in_flight.popleft()()
    while in_flight:
        in_flight.popleft()()


def _pipelined_run(executor, slices):
    """One batch as micro-batches through the workers: start each, then return the wait for all outputs."""
    def run_batch():
        waits = [executor.start(feeds) for feeds in slices]
        return lambda: [wait() for wait in waits]

    return run_batch


def _input_slices(path, plan, rank: int, microbatches: int) -> list[dict[str, np.ndarray]]:
    """This rank's inputs (runtime/batch_io.py `worker_feeds` of the whole batch: rank 0's all, a data-parallel
    worker's its slice, a later pipeline stage's none) split into micro-batches along axis 0."""
    from tessel.runtime.batch_io import batch_input_types, worker_feeds
    from tessel.runtime.inputs import random_input

    if path:
        with np.load(path, allow_pickle=False) as data:
            full = {name: data[name] for name in data.files}
    else:
        rng = np.random.default_rng(0)  # every rank draws the same whole batch
        full = {name: random_input(t, rng) for name, t in batch_input_types(plan).items()}
    mine = worker_feeds(plan, full)[rank]
    if microbatches == 1:
        return [mine]
    return [{name: np.ascontiguousarray(np.array_split(a, microbatches)[k]) for name, a in mine.items()}
            for k in range(microbatches)]


if __name__ == "__main__":
    sys.exit(main())
