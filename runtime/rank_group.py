"""A data-parallel training step on ranks that torchrun started, rather than on local workers.

`torchrun --nproc-per-node N -m tessel train ... --devices N --launcher torchrun` runs the same command on every
rank. Each joins torch's process group first (`attach`); rank 0 then does what `tessel train` does alone (reads
the data, compiles or loads the step, writes the log and the checkpoints) and drives the others, which `follow`:

- rank 0 sends them the step artifact's files once (they may be on other machines), then one command per
  request: run a step (the command carries the whole batch, each rank takes its slice as local workers do,
  runtime/batch_io.py `worker_feeds`; gradients are all-reduced inside the programs), overwrite the state (a
  resumed checkpoint), or stop;
- commands travel as gloo broadcasts on a group of their own, whose timeout is long: a follower waits while
  rank 0 validates, writes a checkpoint or compiles; the step's own transfers keep `timeout`.

The same group serves an InferenceSession opened on rank 0 (runtime/rank_session.py): ranks above 0 call
`follow_sessions()` (or run `python -m tessel.runtime.rank_group`) and take, per session, the artifact's files,
then one request per run (each rank only its own inputs, runtime/batch_io.py `worker_feeds`; it runs the
artifact's micro-batches as a session's local workers do), then "close"; "stop" (rank 0 leaving) ends them.

Failures: any error ends the rank with one line ("tessel worker: rank R: ...") and exit status 1; a dead rank
breaks its peers' next transfer, so every rank exits, and torchrun (with --max-restarts) starts them again.
Messages are JSON and raw tensor bytes, never pickle. One group per process: torch's process group is one too.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Mapping

import numpy as np

from .batch_io import worker_feeds
from .errors import ExecutionError, PeerError
from .worker import EXIT_FAILED

# How long a follower waits for rank 0's next command (rank 0 may compile, validate or save meanwhile), and
# how long the rendezvous may take (rank 0 joins before it compiles).
COMMAND_TIMEOUT_S = 3600.0
# How long a follower of sessions waits for rank 0's next request: a served model may sit idle for long.
SESSION_IDLE_S = 7 * 24 * 3600.0
_RUN, _SET_STATE, _FILES, _STOP, _REQUEST, _CLOSE = range(6)
_group = None  # (rank, world, timeout_s, command group) once attached


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) that torchrun gave this process, or None when it was not started by torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def restarted() -> bool:
    """Whether torchrun restarted this group after a failure (--max-restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def attach(timeout_s: float, command_timeout_s: float = COMMAND_TIMEOUT_S) -> tuple[int, int]:
    """Join the process group of the torchrun ranks (every rank calls this first); (rank, world size).
    `timeout_s` bounds each transfer of a step, `command_timeout_s` a follower's wait for the next command."""
    global _group
    import torch.distributed as dist

    from .comm import join_group

    rank, world = torchrun_rank()
    join_group(rank, world, COMMAND_TIMEOUT_S, EXIT_FAILED)
    commands = dist.new_group(backend="gloo", timeout=timedelta(seconds=command_timeout_s))
    _group = (rank, world, timeout_s, commands)
    return rank, world


def attached() -> bool:
    """Whether this process joined a torchrun group (`attach`)."""
    return _group is not None


class RankStep:
    """Rank 0's side: a data-parallel step artifact run by the torchrun ranks, with the Executor's surface the
    Trainer uses (run, state, set_state, close, input_types, state_names, workers)."""

    def __init__(self, artifact):
        from .batch_io import batch_input_types
        from .comm import TorchComm
        from .executor import Executor

        rank, world, timeout_s, _ = _group
        if world != artifact.devices:
            raise ExecutionError(f"the step runs on {artifact.devices} workers but torchrun started {world} ranks "
                                 "(--nproc-per-node x --nnodes must equal --devices)")
        self.workers = world
        self.input_types = batch_input_types(artifact.plan)
        self.state_names = tuple(artifact.plan["state"]["names"])
        send_files(Path(artifact.directory))
        self._executor = Executor(artifact.directory, threads=_threads(), worker=0, comm=TorchComm(rank, timeout_s))

    def run(self, feeds: Mapping[str, np.ndarray], copy: bool = False) -> dict[str, np.ndarray]:
        """One step on every rank; rank 0's outputs. One-element scalars take the plan's scalar shape."""
        types = self.input_types
        feeds = {name: np.ascontiguousarray(a).reshape(types[name].shape)
                 if name in types and types[name].rank == 0 and np.size(a) == 1 else a for name, a in feeds.items()}
        _send(_RUN, feeds)
        return self._executor.run(worker_feeds(self._executor.artifact_plan, feeds)[0], copy=copy)

    def state(self) -> dict[str, np.ndarray]:
        """Rank 0's state (the replicas hold equal weights)."""
        return self._executor.state()

    def set_state(self, values: Mapping[str, np.ndarray]) -> None:
        """The same state on every rank."""
        send_state(values)
        self._executor.set_state(values)

    def close(self) -> None:
        """Tell the followers to stop."""
        send_stop()


def follow_sessions(timeout_s: float = 30.0) -> int:
    """A torchrun rank above 0 serving the InferenceSessions that rank 0 opens (`timeout_s`: what each transfer
    between the ranks may take, as the session's `timeout`), until rank 0 leaves; its exit status."""
    rank, _ = attach(timeout_s, SESSION_IDLE_S)
    if rank == 0:
        raise ExecutionError("rank 0 opens the InferenceSession; follow_sessions() is for the ranks above 0")
    return follow()


def follower() -> bool:
    """Whether this process is a torchrun rank above 0 (it should `follow_sessions()`)."""
    ranks = torchrun_rank()
    return ranks is not None and ranks[0] > 0


def follow() -> int:
    """A follower's whole life (ranks above 0): take rank 0's commands until it says stop; 0, or one line and
    exit status 1 on any failure."""
    rank, _, timeout_s, _ = _group
    try:
        _follow(rank, timeout_s)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and a non-zero exit
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"tessel worker: {message if message.startswith('rank ') else f'rank {rank}: {message}'}",
              file=sys.stderr, flush=True)
        os._exit(EXIT_FAILED)  # without tearing down the group: a dead peer would make that hang
    return 0


def _follow(rank: int, timeout_s: float) -> None:
    from .comm import TorchComm
    from .executor import Executor

    directory = Path(tempfile.mkdtemp(prefix=f"tessel-rank{rank}-"))
    executor = None
    try:
        while True:
            op, tensors = _receive()
            if op == _FILES:
                shutil.rmtree(directory)  # a new session's artifact replaces the last one's
                for relative, data in tensors.items():
                    (directory / relative).parent.mkdir(parents=True, exist_ok=True)
                    (directory / relative).write_bytes(data.tobytes())
                executor = Executor(directory, threads=_threads(), worker=rank, comm=TorchComm(rank, timeout_s))
            elif op == _RUN:
                executor.start(worker_feeds(executor.artifact_plan, tensors)[rank])()
            elif op == _REQUEST:
                prefix = f"{rank}:"
                run_microbatches(executor, {key[len(prefix):]: a for key, a in tensors.items() if key.startswith(prefix)})
            elif op == _SET_STATE:
                executor.set_state(tensors)
            elif op == _CLOSE:
                executor = None
            else:
                return
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run_microbatches(executor, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One request on this rank: its whole-batch `feeds` as the artifact's micro-batches, each started before
    any is waited for (a pipeline's stages overlap); the outputs this rank holds, joined along axis 0."""
    parts = int(executor.artifact_plan.get("microbatches", 1))
    if parts == 1:
        waits = [executor.start(feeds)]
    else:
        waits = [executor.start({name: np.ascontiguousarray(np.array_split(a, parts)[k]) for name, a in feeds.items()})
                 for k in range(parts)]
    outputs = [wait() for wait in waits]
    return {name: np.concatenate([o[name] for o in outputs]) if parts > 1 else outputs[0][name] for name in outputs[0]}


def send_files(directory: Path) -> None:
    """Rank 0: the artifact in `directory` to every follower (a session's start; it replaces the last one)."""
    _send(_FILES, _artifact_files(directory))


def send_request(tensors: Mapping[str, np.ndarray]) -> None:
    """Rank 0: run one session request; `tensors` keyed "RANK:NAME", each follower takes its own."""
    _send(_REQUEST, tensors)


def send_state(values: Mapping[str, np.ndarray]) -> None:
    """Rank 0: overwrite these state values on every follower."""
    _send(_SET_STATE, values)


def send_close() -> None:
    """Rank 0: the session ended; the followers wait for the next one."""
    _send(_CLOSE, {})


def send_stop() -> None:
    """Rank 0: the followers stop."""
    _send(_STOP, {})


def _threads() -> int:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return int(os.environ.get("TESSEL_THREADS", str(max(1, (os.cpu_count() or 1) // local))))


def _artifact_files(directory: Path) -> dict[str, np.ndarray]:
    """Every file of the artifact by its path inside it, as bytes."""
    return {str(path.relative_to(directory)): np.frombuffer(path.read_bytes(), np.uint8)
            for path in sorted(directory.rglob("*")) if path.is_file()}


def _send(op: int, tensors: Mapping[str, np.ndarray]) -> None:
    """Broadcast command `op` with `tensors` (names, dtypes and shapes in a JSON header, then the raw bytes)."""
    # tobytes() writes C order whatever the layout; np.ascontiguousarray would turn a 0-d scalar into shape (1,).
    arrays = {name: np.asarray(a) for name, a in tensors.items()}
    header = json.dumps([[name, a.dtype.str, list(a.shape)] for name, a in arrays.items()]).encode()
    payload = b"".join(a.tobytes() for a in arrays.values())
    _broadcast(np.array([op, len(header), len(payload)], np.int64))
    _broadcast(np.frombuffer(header, np.uint8).copy())
    _broadcast(np.frombuffer(payload, np.uint8).copy())


def _receive() -> tuple[int, dict[str, np.ndarray]]:
    """The next command from rank 0 and its tensors."""
    sizes = np.zeros(3, np.int64)
    _broadcast(sizes)
    op, header_bytes, payload_bytes = (int(v) for v in sizes)
    header, payload = np.zeros(header_bytes, np.uint8), np.zeros(payload_bytes, np.uint8)
    _broadcast(header)
    _broadcast(payload)
    tensors, offset = {}, 0
    for name, dtype, shape in json.loads(header.tobytes()):
        dtype = np.dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        tensors[name] = payload[offset:offset + size].view(dtype).reshape(shape).copy()
        offset += size
    return op, tensors


def _broadcast(array: np.ndarray) -> None:
    """Rank 0's `array` into every rank's (in place)."""
    import torch
    import torch.distributed as dist

    if not array.size:
        return
    try:
        dist.broadcast(torch.from_numpy(array), src=0, group=_group[3])
    except RuntimeError as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        what = "lost rank 0's commands" if _group[0] else "cannot reach the other ranks"
        raise PeerError(f"rank {_group[0]}: {what} ({lines[0][:160] if lines else 'gloo'})") from None


if __name__ == "__main__":
    # `torchrun ... -m tessel.runtime.rank_group` on the ranks above 0: serve rank 0's sessions.
    sys.exit(follow_sessions())
