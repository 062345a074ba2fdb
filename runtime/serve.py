"""One long-lived worker of an InferenceSession: `python -m tessel.runtime.serve DIR` (started by runtime/session.py).

It joins the gloo group like a one-shot worker (runtime/worker.py), loads its
program once, says it is ready, then serves requests until told to stop or
until its control pipe closes (the session, or the process that held it, is
gone). Each request runs the whole batch: each rank receives with the request
the inputs its program takes (rank 0 all of them; in a data-parallel step every
rank its slice of the batch; a later pipeline stage none, only the header),
splits them into the artifact's micro-batches and runs its program once per
micro-batch, exchanging activations with its peers (through shared memory,
runtime/shared_p2p.py, where the session made the rings; else over gloo); rank
0 answers with the outputs.

Requests are pipelined: while the outputs of a request are still on their
way from the last stage, the next request already enters the first stage
(up to `--window` requests in flight); a first stage waiting for its oldest
request's outputs through shared memory starts a request that arrives
meanwhile (`_outputs_or_request`). A training artifact's state is read
through rank 0 ("state": pipeline stages send it the values they hold) and
written into every worker ("set_state") once the requests before have finished. A failure of any kind is answered with
one line, and the worker exits: a gloo group that failed cannot be reused.

The control pipes are the file descriptors in TESSEL_CONTROL_FDS ("IN,OUT");
messages are runtime/wire.py's (JSON and raw tensor bytes, never pickle). A run
request naming a "slot" has its inputs in that shared-memory slot (TESSEL_SLOTS,
runtime/shared_slots.py), and rank 0 answers it with its outputs in the
same-numbered output slot.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

from tessel.runtime.errors import PeerError
from tessel.runtime.worker import EXIT_FAILED, LAUNCHER_ENV, leave_with_the_launcher

CONTROL_ENV = "TESSEL_CONTROL_FDS"
# Requests about a training artifact's persistent state (runtime/worker_group.py `state`, `set_state`) and its
# workers' error-feedback residuals (`residuals`, `set_residuals`).
STATE_OPS = ("state", "set_state")
RESIDUAL_OPS = ("residuals", "set_residuals")
# Tag of state value k sent to rank 0 for a "state" request (beside the programs' own tags).
STATE_TAG = 1 << 24
# Tag of residual k sent to rank 0 for a "residuals" request.
RESIDUAL_TAG = (1 << 24) + (1 << 22)
# How long an idle worker polls its control pipe before it sleeps on it (`_spin_for`): longer than a client's turn
# between two calls (reading the answer, then checking and copying the next request: 0.4-0.8 ms measured here).
DOORBELL_SPIN_S = 0.003


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tessel.runtime.serve",
                                     description="Serve one worker of a Tessel artifact to an InferenceSession.")
    parser.add_argument("artifact", help="artifact directory compiled with --devices N")
    parser.add_argument("--timeout", type=float, default=30.0, metavar="S",
                        help="seconds to wait for the rendezvous and for each transfer from a peer")
    parser.add_argument("--window", type=int, default=2, metavar="N", help="requests in flight at most")
    return parser


def main(argv=None) -> int:
    """Serve requests until the session says stop or goes away; exit 1 with one line after any failure."""
    args = _parser().parse_args(argv)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # one line per failure, not torch's backtraces
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    threads = int(os.environ.get("TESSEL_THREADS", "1"))
    control, reply = (int(fd) for fd in os.environ[CONTROL_ENV].split(","))
    if LAUNCHER_ENV in os.environ:
        leave_with_the_launcher(int(os.environ[LAUNCHER_ENV]), rank)
    from tessel.runtime.wire import write_message

    try:
        _serve(args, rank, world, threads, control, reply)
    except KeyboardInterrupt:
        os._exit(EXIT_FAILED)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line for the session
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if not message.startswith("rank "):
            message = f"rank {rank}: {message}"
        try:
            write_message(reply, {"error": message, "peer": isinstance(exc, PeerError)})
        except Exception:  # noqa: BLE001 - the session may be gone already; the exit status still tells
            pass
        print(f"tessel worker: {message}", file=sys.stderr, flush=True)
        # Leave without tearing down the process group: a dead peer would make that hang.
        os._exit(EXIT_FAILED)
    os._exit(0)


def _serve(args, rank: int, world: int, threads: int, control: int, reply: int) -> None:
    from tessel.runtime.artifact_files import read_plan, worker_count
    from tessel.runtime.comm import TorchComm, join_group
    from tessel.runtime.errors import ArtifactError
    from tessel.runtime.executor import Executor
    from tessel.runtime.gpu_workers import prepare_worker
    from tessel.runtime.step_profile import collect, profiled
    from tessel.runtime.wire import read_message, write_message

    plan = read_plan(Path(args.artifact))
    if worker_count(plan) != world:
        raise ArtifactError(f"{args.artifact}: the artifact runs on {worker_count(plan)} worker(s) but {world} were started")
    backend, device = prepare_worker([plan], rank, world)
    join_group(rank, world, args.timeout, EXIT_FAILED, backend)
    # The host's shared-memory all-reduce does not reach GPU memory: NCCL does every all-reduce there.
    shared = _attach_reduce(rank, args.timeout) if backend == "gloo" else None
    channels = _attach_channels(rank, args.timeout) if backend == "gloo" else None
    comm = TorchComm(rank, args.timeout, shared=shared, channels=channels)
    executor, recorder = profiled(comm, lambda c: Executor(args.artifact, threads=threads, worker=rank, comm=c,
                                                            device=device))
    microbatches = int(plan.get("microbatches", 1))
    if not plan.get("state"):  # an inference program runs the same transfers every run, until this process ends
        executor.receive_early()
    slots = _attach_slots()
    write_message(reply, {"ready": True, "rank": rank, "pid": os.getpid()})
    in_flight: deque = deque()
    doorbell = comm.doorbell()

    def finish_oldest() -> None:
        waits, started, slot = in_flight.popleft()
        parts = [wait() for wait in waits]
        profile = collect(comm, recorder, world) if recorder else None
        if rank == 0:
            _answer(reply, parts, slot, slots.get("outputs"), started, profile)

    while True:
        # A new request is taken whenever one waits and the window has room; otherwise the oldest is finished.
        if not in_flight or (len(in_flight) < args.window and select.select([control], [], [], 0)[0]):
            if not in_flight:
                comm.flush_sends()
                _spin_for(control, DOORBELL_SPIN_S)
            message = read_message(control)
            if message is None:  # the session is gone: so are the peers, whatever was in flight
                return
            if message[0].get("op") == "stop":
                executor.finish_sends()
                return
            header, inputs = message
            if header.get("op") in STATE_OPS + RESIDUAL_OPS:
                while in_flight:
                    finish_oldest()
                executor.finish_sends()
                if header["op"] in RESIDUAL_OPS:
                    _residual_request(comm, world, header["op"], inputs, reply)
                else:
                    _state_request(executor, comm, plan, header["op"], inputs, reply)
                continue
            started = time.perf_counter()
            slot = header.get("slot")
            if slot is not None:
                inputs = slots["inputs"].views(slot) if "inputs" in slots else {}
            slices = _split(inputs, microbatches)
            in_flight.append(([executor.start(feeds) for feeds in slices], started, slot))
            continue
        if (doorbell is not None and len(in_flight) < args.window and all(w.observable for w in in_flight[0][0])
                and not _outputs_or_request(in_flight[0][0], control, doorbell, comm.exit_fds(), args.timeout)):
            continue  # a request came first: it starts now, the oldest is finished after
        finish_oldest()


def _outputs_or_request(outputs: list, control: int, doorbell: int, exits: list[int], timeout_s: float) -> bool:
    """Sleep until every one of `outputs` (runs' PendingOutputs, `observable`) has arrived, True, or a request is
    on the `control` pipe, False; True too once a peer exited (one of the `exits` descriptors is readable: the wait
    for the outputs then fails at once) or after `timeout_s` (the wait then fails after its own timeout).

    The first stage of a pipeline is faster than the last and waits for its oldest request's outputs with the next
    request already in flight; a request arriving meanwhile starts at once, so the stages behind find its
    micro-batches ready when they come to them (blocked on the oldest request instead, this stage started the
    next one only once the last stage had finished the oldest, and the last stage then waited for it)."""
    deadline = time.monotonic() + timeout_s
    while not all(pending.arrived() for pending in outputs):
        left = deadline - time.monotonic()
        if left <= 0:
            return True
        readable = select.select([control, doorbell, *exits], [], [], left)[0]
        if control in readable:
            return False
        if any(fd in readable for fd in exits):
            return True
        if doorbell in readable:
            try:
                os.eventfd_read(doorbell)
            except BlockingIOError:
                pass
    return True


def _spin_for(fd: int, seconds: float) -> None:
    """Poll `fd` for up to `seconds` until it has something to read: a client that calls again as soon as it has
    its answer rings within this time, and a sleeping worker would pay a wake-up (a tenth of a millisecond or more
    on a virtual machine) on the critical path of every call. Each poll yields the core: with every core taken by
    polling workers, the client that must read the answer and ring again would wait for one (resnet18 on 2
    workers, 2 cores: overhead p90 1.44 / 1.32 ms polling 0.5 ms without yielding, 2.60 / 3.01 ms polling 3 ms
    without, 1.18 / 1.17 ms polling 3 ms with)."""
    until = time.perf_counter() + seconds
    while not select.select([fd], [], [], 0)[0] and time.perf_counter() < until:
        os.sched_yield()


def _attach_reduce(rank: int, timeout_s: float):
    """The local group's shared-memory all-reduce, when the session made one (runtime/shared_reduce.py)."""
    from tessel.runtime.shared_reduce import REDUCE_ENV, SharedReduce

    text = os.environ.get(REDUCE_ENV)
    return SharedReduce.attach(text, rank, timeout_s) if text else None


def _attach_channels(rank: int, timeout_s: float):
    """The local group's shared-memory Send/Recv rings, when the session made them (runtime/shared_p2p.py)."""
    from tessel.runtime.shared_p2p import P2P_ENV, SharedChannels

    text = os.environ.get(P2P_ENV)
    return SharedChannels.attach(text, rank, timeout_s) if text else None


def _attach_slots() -> dict:
    """This worker's shared-memory slots ("inputs", and on rank 0 "outputs"), as the session described them."""
    from tessel.runtime.shared_slots import SLOTS_ENV, SharedSlots

    described = json.loads(os.environ.get(SLOTS_ENV, "{}"))
    return {key: SharedSlots.attach(json.dumps(layout)) for key, layout in described.items()}


def _answer(reply: int, parts: list[dict[str, np.ndarray]], slot: int | None, output_slots, started: float,
            profile: dict | None) -> None:
    """Rank 0's answer to a run: the micro-batches' outputs joined, into output slot `slot` when the request came
    through the slots and the outputs fit them (the header then names the slot), else on the pipe; the step
    profile, when recorded, rides in the header."""
    from tessel.runtime.wire import write_message

    answered = time.perf_counter()
    # The span on CLOCK_MONOTONIC (one clock for every process of the machine): the client tells the time its
    # request took to reach rank 0 from the time the answer took to come back.
    header = {"worker_s": answered - started, "span": [started, answered], **({"profile": profile} if profile else {})}
    views = output_slots.views(slot) if slot is not None and output_slots is not None else None
    if views is not None and views.keys() == parts[0].keys() and all(
            view.dtype == parts[0][name].dtype and view.shape == _joined_shape([p[name] for p in parts])
            for name, view in views.items()):
        for name, view in views.items():
            if len(parts) > 1:
                np.concatenate([p[name] for p in parts], out=view)
            else:
                view[...] = parts[0][name]
        write_message(reply, {**header, "slot": slot})
        return
    outputs = {name: np.concatenate([p[name] for p in parts]) if len(parts) > 1 else parts[0][name]
               for name in parts[0]}
    write_message(reply, header, outputs)


def _joined_shape(parts: list[np.ndarray]) -> tuple[int, ...]:
    """The shape of `parts` joined along axis 0 (one part: its own shape)."""
    if len(parts) == 1:
        return parts[0].shape
    return (sum(p.shape[0] for p in parts),) + parts[0].shape[1:]


def _state_request(executor, comm, plan: dict, op: str, tensors: dict[str, np.ndarray], reply: int) -> None:
    """A training artifact's state, after every earlier request. "state": rank 0 answers every state value, each
    from the lowest rank holding it (data-parallel replicas hold equal values, so all come from rank 0; pipeline
    stages send theirs to rank 0). "set_state": each worker overwrites the values of `tensors` it holds (a name no
    worker holds is refused); rank 0 answers when done."""
    from tessel.ir.types import TensorType, numpy_dtype
    from tessel.runtime.artifact_files import state_types
    from tessel.runtime.wire import write_message

    rank, names = comm.rank, plan["state"]["names"]
    if op == "set_state":
        held = set(executor.state_names)
        executor.set_state({name: a for name, a in tensors.items() if name in held or name not in names})
        if rank == 0:
            write_message(reply, {"worker_s": 0.0}, {})
        return
    owners = _state_owners(plan)
    if rank != 0:
        for k, name in enumerate(names):
            if owners[name] == rank:
                comm.send(executor.state([name])[name], 0, STATE_TAG + k, name)
        comm.wait_sends()
        return
    types, own = state_types(plan), executor.state()
    state = {}
    for k, name in enumerate(names):
        if owners[name] == 0:
            state[name] = own[name]
            continue
        t = TensorType.parse(types[name])
        state[name] = np.empty(t.shape, numpy_dtype(t.dtype))
        comm.recv(state[name], owners[name], STATE_TAG + k, name)
    write_message(reply, {"worker_s": 0.0}, state)


def _residual_request(comm, world: int, op: str, tensors: dict[str, np.ndarray], reply: int) -> None:
    """The workers' error-feedback residuals (runtime/comm.py), after every earlier request. "residuals": rank 0
    answers every worker's, named "RANK/TENSOR" (the others send theirs to rank 0, in rank 0's order: every
    worker runs the same all-reduces). "set_residuals": each worker takes the residuals of its own request
    (by tensor name); rank 0 answers when done."""
    from tessel.runtime.wire import write_message

    if op == "set_residuals":
        comm.set_residuals(tensors or {})
        if comm.rank == 0:
            write_message(reply, {"worker_s": 0.0}, {})
        return
    own = comm.residuals()
    names = sorted(own)
    if comm.rank != 0:
        for k, name in enumerate(names):
            comm.send(own[name], 0, RESIDUAL_TAG + k, name)
        comm.wait_sends()
        return
    gathered = {f"0/{name}": own[name] for name in names}
    for rank in range(1, world):
        for k, name in enumerate(names):
            gathered[f"{rank}/{name}"] = np.empty_like(own[name])
            comm.recv(gathered[f"{rank}/{name}"], rank, RESIDUAL_TAG + k, name)
    write_message(reply, {"worker_s": 0.0}, gathered)


def _state_owners(plan: dict) -> dict[str, int]:
    """Each state value's lowest rank holding it."""
    from tessel.runtime.artifact_files import worker_state_names

    owners: dict[str, int] = {}
    for rank in reversed(range(len(plan["workers"]))):
        owners.update(dict.fromkeys(worker_state_names(plan, rank), rank))
    return owners


def _split(inputs: dict[str, np.ndarray], parts: int) -> list[dict[str, np.ndarray]]:
    """The whole-batch inputs as `parts` micro-batches along axis 0."""
    if parts == 1:
        return [inputs]
    return [{name: np.ascontiguousarray(np.array_split(a, parts)[k]) for name, a in inputs.items()} for k in range(parts)]


if __name__ == "__main__":
    sys.exit(main())
