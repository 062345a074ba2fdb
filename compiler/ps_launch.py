"""Run a parameter-server job: one local process per worker and per server, joined in one gloo process group.

`run_job` starts the ranks (multiprocessing, spawn), watches them and collects what they wrote into the job
directory: each worker's losses, seconds and bytes on the wire, worker 0's BatchNormalization statistics (and,
with compressed pulls, its weights) and every server's shard. When a rank dies (killed, or an error of its own), the others are stopped and
`PSFailure` names it in one line; a rank that fails only because its peer vanished exits quietly with
PEER_LOST, so that the line names the rank that failed first.
"""
from __future__ import annotations

import json
import multiprocessing
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np

from tessel.ir.errors import TesselError

from tessel.runtime.launch import free_port
from tessel.runtime.ps_job import PSJob
from tessel.runtime.ps_wire import LocalInbox, RemoteInbox, Wire

PEER_LOST = 3
# Seconds a rank waits for a peer (gloo's timeout); the launcher stops everything as soon as one rank dies.
PEER_TIMEOUT_S = 300.0
POLL_S = 0.05


class PSFailure(TesselError):
    """A rank of a parameter-server job died; the others were stopped."""


@dataclass
class PSResult:
    """What a finished job left: the workers' reports (losses, seconds, bytes) and the final state."""

    reports: list[dict]
    parameters: dict[str, np.ndarray]   # the servers' weights
    slots: dict[str, np.ndarray]        # the servers' optimizer slots
    statistics: dict[str, np.ndarray]   # worker 0's BatchNormalization running statistics
    # The trained model, parameters and statistics (`model_parameters`): what evaluation and export use.
    model: dict[str, np.ndarray]


def run_job(directory: str | Path, timeout_s: float = 600.0) -> PSResult:
    """Run the job described in `directory` (runtime/ps_job.py) to its end; PSFailure when a rank dies or the
    whole job takes longer than `timeout_s`."""
    directory = Path(directory)
    job = PSJob.read(directory)
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [context.Process(target=rank_main, args=(str(directory), rank, job.world, port), daemon=True,
                             name=f"tessel-ps {job.role(rank)}") for rank in range(job.world)]
    for process in ranks:
        process.start()
    try:
        _watch(job, ranks, time.monotonic() + timeout_s)
    finally:
        for process in ranks:
            if process.is_alive():
                process.terminate()
        for process in ranks:
            process.join()
    return _collect(job, directory)


def _watch(job: PSJob, ranks: list, deadline: float) -> None:
    """Wait for every rank to end; PSFailure naming the first rank that died for a reason of its own."""
    while any(process.is_alive() for process in ranks):
        failed = [(rank, p.exitcode) for rank, p in enumerate(ranks) if p.exitcode not in (None, 0)]
        if failed:
            time.sleep(POLL_S)  # let the other ranks' exit codes settle: one died, peers may follow
            failed = [(rank, p.exitcode) for rank, p in enumerate(ranks) if p.exitcode not in (None, 0)]
            rank, code = next(((r, c) for r, c in failed if c != PEER_LOST), failed[0])
            raise PSFailure(f"parameter server job: {job.role(rank)} (rank {rank}, pid {ranks[rank].pid}) "
                            f"{_how(code)}; stopped the other {job.world - 1} rank(s)")
        if time.monotonic() > deadline:
            raise PSFailure(f"parameter server job: not finished within the time limit; stopped its "
                            f"{job.world} ranks")
        time.sleep(POLL_S)
    failed = [(rank, p.exitcode) for rank, p in enumerate(ranks) if p.exitcode != 0]
    if failed:
        rank, code = next(((r, c) for r, c in failed if c != PEER_LOST), failed[0])
        raise PSFailure(f"parameter server job: {job.role(rank)} (rank {rank}) {_how(code)}")


def _how(code: int) -> str:
    """How a process ended, from its exit code."""
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    if code == PEER_LOST:
        return "lost a peer"
    return f"failed (exit status {code})"


def rank_main(directory: str, rank: int, world: int, port: int) -> None:
    """A rank's process: join the group, serve or train (or both, colocated), write the results; a peer's loss
    exits with PEER_LOST, any other error prints its traceback and exits with 1."""
    import os

    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    path = Path(directory)
    job = PSJob.read(path)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=PEER_TIMEOUT_S))
        if rank < job.workers:
            _work(job, path, rank)
        else:
            _serve(job, path, rank)
    except Exception as exc:  # noqa: BLE001 - the launcher names this rank; its traceback says why
        _exit(exc)


def _work(job: PSJob, path: Path, rank: int) -> None:
    """Worker `rank`'s steps (and, colocated, its server's shard in threads of the same process)."""
    from .ps_server import Server
    from .ps_worker import Worker

    inbox = LocalInbox() if job.hosts_server(rank) else None
    wire = Wire(job, rank, {rank: inbox} if inbox else None)
    worker = Worker(job, path, rank, wire)
    if inbox:
        server = Server(job, path, rank, wire)
        inbox.start_receiving(job.workers - 1)
        serving = threading.Thread(target=_guarded, args=(server.serve, inbox), name="tessel-ps server", daemon=True)
        serving.start()
    report = worker.train()
    (path / f"worker{rank}.json").write_text(json.dumps(report))
    if rank == 0:
        np.savez(path / "statistics.npz", **worker.statistics())
        if job.pull_codec != "none":  # the trained model's weights (model_parameters)
            np.savez(path / "weights.npz", **worker.parameters())
    if inbox:
        serving.join()
        np.savez(path / f"shard{rank}.npz", **server.state())


def _serve(job: PSJob, path: Path, rank: int) -> None:
    """A standalone server's shard."""
    import torch.distributed as dist

    from .ps_server import Server

    shard = rank - job.workers
    server = Server(job, path, shard, Wire(job, rank))
    dist.barrier()
    server.serve(RemoteInbox())
    np.savez(path / f"shard{shard}.npz", **server.state())


def _guarded(function, *args) -> None:
    """Run `function` in a thread; an error ends the whole process as `_exit` says (the launcher then stops the
    others), since a server thread that died would leave its workers waiting."""
    try:
        function(*args)
    except Exception as exc:  # noqa: BLE001 - see _exit
        _exit(exc)


def _exit(exc: Exception) -> None:
    """End the process: PEER_LOST when gloo lost a peer (closed connection, timeout), else the traceback and 1."""
    import os

    text = str(exc)
    if isinstance(exc, RuntimeError) and ("Connection closed" in text or "Timed out" in text
                                          or "connection" in text.lower()):
        os._exit(PEER_LOST)
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)


def _collect(job: PSJob, directory: Path) -> PSResult:
    """The workers' reports and the final state the ranks wrote."""
    reports = [json.loads((directory / f"worker{rank}.json").read_text()) for rank in range(job.workers)]
    parameters, slots = {}, {}
    for shard in range(job.servers):
        with np.load(directory / f"shard{shard}.npz", allow_pickle=False) as data:
            for name in data.files:
                (parameters if name in job.parameters else slots)[name] = data[name]
    with np.load(directory / "statistics.npz", allow_pickle=False) as data:
        statistics = {name: data[name] for name in data.files}
    return PSResult(reports, parameters, slots, statistics, {**model_parameters(job, directory, parameters),
                                                             **statistics})


def model_parameters(job: PSJob, directory: Path, servers: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The trained model's parameters, given the servers' weights `servers`.

    With exact pulls, the servers' weights: the weights the workers last pulled plus the final update. With
    compressed pulls, the weights worker 0 holds (weights.npz), as in CNTK's 1-bit SGD and 1-bit Adam, where the
    model is the workers' copy: every gradient, loss and BatchNormalization statistic was computed at those
    weights. The servers' are ahead of them by the changes error feedback has not sent yet, a point nothing
    was computed at (error feedback's virtual sequence). On the digits CNN (bench/ps_digits.py, 4 workers, sync,
    1-bit, seeds 0-21, paired by seed with uncompressed training), with momentum correction
    (compiler/ps_momentum.py) the workers' weights were 0.23 points of test accuracy ahead of uncompressed on
    average (median 0.28, standard error 0.35), the servers' 0.27 behind (median 0.00; 7.5 behind on one seed);
    before it, with the momentum on the servers, 1.37 and 2.39 behind."""
    if job.pull_codec == "none":
        return servers
    with np.load(directory / "weights.npz", allow_pickle=False) as data:
        return {name: data[name] for name in data.files}
