"""A parameter server: one shard's parameters and optimizer slots, updated by its compiled update program.

The server answers messages in arrival order (runtime/ps_job.py), read from an inbox and answered through a
wire (runtime/ps_wire.py), in a process of its own or as a thread of a worker's (colocated). Consistency models:
- sync (BSP): the gradients of one clock from every worker are averaged, then applied as one update; a pull
  at clock c waits until c updates are applied, so every worker computes step c on the same weights (the
  result of data-parallel all-reduce training). The gradients are added in rank order whatever order they
  arrive in (`RankOrderSum`), so a sync run's result does not depend on which worker's push came first.
- async (Downpour): every push is applied as it arrives, every pull answered at once.
- ssp (stale synchronous parallel, staleness s): pushes applied as they arrive; a pull at clock c waits until
  the slowest worker has pushed c - s gradients, so no worker runs more than s steps ahead of the slowest.
The optimizer's step count (its learning-rate schedule, AdamW's bias corrections) is the server's update count.
At a checkpoint clock every mode waits for all workers' pulls, writes the shard, then answers (ps_checkpoint.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tessel.runtime.ps_compression import make_codec
from tessel.runtime.ps_job import DONE, PULL, PUSH, WEIGHTS, PSJob, flatten, unflatten
from tessel.runtime.ps_wire import Wire

from .ps_checkpoint import partial_dir, read_shard, write_shard
from .ps_momentum import server_optimizer


class RankOrderSum:
    """The mean of one clock's encoded gradients from `workers` workers, added in rank order (worker 0's first)
    whatever order they arrive in: float addition is not associative, so a sum in arrival order would make a
    synchronous run's weights depend on the processes' timing. A push is decoded as soon as every lower rank's
    is in; until then it is held."""

    def __init__(self, codec, size: int, workers: int):
        self.codec, self.workers = codec, workers
        self.total = np.zeros(size, np.float32)
        self.held: dict[int, np.ndarray] = {}  # pushes waiting for a lower rank's
        self.added = 0                          # workers 0 .. added-1 are in the sum

    def add(self, worker: int, message: np.ndarray) -> np.ndarray | None:
        """Take `worker`'s message; the mean of the clock's gradients once every worker's is in (valid until the
        next `add`), else None."""
        if not 0 <= worker < self.workers:
            raise ValueError(f"a push from worker {worker}: this job has workers 0 to {self.workers - 1}")
        if worker < self.added or worker in self.held:
            raise ValueError(f"worker {worker} pushed twice in one synchronous clock")
        self.held[worker] = message
        while self.added in self.held:
            self.codec.decode_add(self.held.pop(self.added), self.total)
            self.added += 1
        if self.added < self.workers:
            return None
        self.total /= np.float32(self.workers)
        self.added = 0
        return self.total

    def clear(self) -> None:
        """Start the next clock's sum (after the mean `add` returned has been used)."""
        self.total[:] = 0


class Server:
    """Shard `shard` of a job: its update program and the workers' clocks."""

    def __init__(self, job: PSJob, directory: Path, shard: int, wire: Wire):
        from .optim import optimizer_from_json

        from tessel.runtime.executor import Executor

        self.job, self.shard, self.wire = job, shard, wire
        self.names = job.shards[shard]
        self.grad_names = [name + "__grad" for name in self.names]
        self.update = Executor(directory / f"server{shard}", threads=1)
        self.optimizer = optimizer_from_json(job.optimizer)
        if job.momentum_correction:  # the workers apply the momentum (compiler/ps_momentum.py)
            self.optimizer = server_optimizer(self.optimizer)
        self.size = sum(job.sizes(shard))
        self.codec = make_codec(job.compression, job.segments(shard), job.topk_ratio)
        self.clocks = [job.start] * job.workers
        self.updates = 0
        self.waiting: list[tuple[int, int]] = []  # pulls not answered yet: (worker, clock)
        self.saved = job.start                     # the newest checkpoint clock written
        self.pending = RankOrderSum(self.codec, self.size, job.workers)  # sync: this clock's gradients so far
        self.weights = self._weights()
        # Compressed pulls send each worker the change since the weights it holds, which the server tracks.
        self.views = [self.weights.copy() for _ in range(job.workers)] if job.pull_codec != "none" else None
        self.pull_codec = make_codec(job.pull_codec, job.segments(shard), job.topk_ratio)
        # Views are known equal by their ids: views with one id got the same messages from equal views.
        self.view_ids, self.next_view_id = [0] * job.workers, 1
        self.change = np.empty(self.size, np.float32) if self.views is not None else None
        # The last compressed pull: (update count, id of the view it was encoded against, message, id after it).
        self.pull_cache: tuple[int, int, np.ndarray, int] | None = None
        if job.start:
            self._resume()

    def _resume(self) -> None:
        """The shard's state at the checkpoint the job starts from."""
        from .train_checkpoints import step_checkpoint_dir

        state, views, self.updates = read_shard(step_checkpoint_dir(Path(self.job.run_dir), self.job.start),
                                                self.shard, self.job.workers)
        self.update.set_state(state)
        self.weights = self._weights()
        if self.views is not None:
            self.views = views
            self.view_ids = [next(k for k in range(w + 1) if np.array_equal(views[k], views[w]))
                             for w in range(self.job.workers)]
            self.next_view_id = self.job.workers

    def serve(self, inbox) -> None:
        """Answer the messages of `inbox` (runtime/ps_wire.RemoteInbox or LocalInbox) until every worker is done."""
        done = 0
        while done < self.job.workers:
            worker, kind, clock, payload = inbox.get()
            if kind == PUSH:
                self._push(worker, clock, payload)
            elif kind == PULL:
                self.waiting.append((worker, clock))
            elif kind == DONE:
                done += 1
            self._answer_pulls()

    def state(self) -> dict[str, np.ndarray]:
        """The shard's parameters and optimizer slots."""
        return self.update.state()

    def _push(self, worker: int, clock: int, message: np.ndarray) -> None:
        """Take a worker's encoded gradient of clock `clock`: sync sums it until all workers pushed, else applies
        it."""
        self.clocks[worker] = clock + 1
        if self.job.mode != "sync":
            self._apply(self.codec.decode(message, self.size))
            return
        mean = self.pending.add(worker, message)
        if mean is not None:
            self._apply(mean)
            self.pending.clear()

    def _apply(self, gradient: np.ndarray) -> None:
        """One optimizer update of the shard."""
        shapes = self.job.shapes
        feeds = {name + "__grad": array for name, array in unflatten(gradient, self.names, shapes).items()}
        feeds.update(self.optimizer.step_scalars(self.updates))
        self.update.run(feeds)
        self.updates += 1
        self.weights = self._weights()

    def _ready(self, clock: int) -> bool:
        """Whether a pull at `clock` may see the current weights."""
        if self.job.checkpoints_at(clock):  # every worker has written its part of the checkpoint
            return sum(waiting == clock for _, waiting in self.waiting) == self.job.workers
        if self.job.mode == "sync":
            return self.updates >= clock
        if self.job.mode == "ssp":
            return min(self.clocks) >= clock - self.job.staleness
        return True

    def _answer_pulls(self) -> None:
        """Send the weights to every waiting worker whose pull is now allowed."""
        still = []
        for worker, clock in self.waiting:
            if not self._ready(clock):
                still.append((worker, clock))
                continue
            if self.job.checkpoints_at(clock) and self.saved < clock:
                write_shard(partial_dir(self.job.run_dir, clock), self.shard, self.state(), self.views, self.updates)
                self.saved = clock
            payload = self.weights.view(np.uint8) if self.views is None else self._pull_message(worker)
            self.wire.to_worker(self.shard, worker, WEIGHTS, self.updates, payload)
        self.waiting = still

    def _pull_message(self, worker: int) -> np.ndarray:
        """The compressed pull for `worker`: the change from the weights it holds to the current ones, encoded;
        its view then moves by what it will decode. Workers holding the same weights get the same message, so
        it is encoded once per update (in sync mode every worker's view is the same: one encode per step)."""
        view, cached, base = self.views[worker], self.pull_cache, self.view_ids[worker]
        if cached is not None and cached[:2] == (self.updates, base):
            payload, self.view_ids[worker] = cached[2], cached[3]
        else:
            np.subtract(self.weights, view, out=self.change)
            payload = self.pull_codec.compress(self.change)
            self.view_ids[worker] = self.next_view_id
            self.next_view_id += 1
            self.pull_cache = (self.updates, base, payload, self.view_ids[worker])
        self.pull_codec.decode_add(payload, view)
        return payload

    def _weights(self) -> np.ndarray:
        """The shard's current parameters as one float32 vector."""
        return flatten(self.update.state(self.names), self.names)
