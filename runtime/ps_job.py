"""A parameter-server job as its processes see it: the settings (`PSJob`, job.json in the job directory), the
ranks' roles and the messages they exchange over torch.distributed point-to-point.

Ranks 0 .. W-1 are the workers, W .. W+S-1 the servers; in the colocated layout (MXNet's dist_sync local) there
are only the W ranks and server s runs in worker s's process (S <= W). A message is a header, four int64
(kind, clock, payload bytes, 0), then its payload (uint8); runtime/ps_wire.py carries them:
- PULL (worker -> server, clock c: the worker has pushed c gradients): the server answers with WEIGHTS
  once the consistency model lets the worker see its weights (compiler/ps_server.py);
- PUSH (worker -> server): the gradient of the server's shard, encoded by the job's codec;
- WEIGHTS (server -> worker): the shard's weights, as float32 or, compressed, the change since the weights that
  worker holds;
- DONE (worker -> server): the worker has finished its steps.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

PULL, PUSH, WEIGHTS, DONE = 1, 2, 3, 4
HEADER_BYTES = 32
MODES = ("sync", "async", "ssp")
LAYOUTS = ("standalone", "colocated")
JOB_FILE = "job.json"
DATA_FILE = "data.npz"


@dataclass
class PSJob:
    """Everything a rank needs: the compiled programs' names (compiler/ps_training.compile_ps), the
    consistency model, the data and the optimizer."""

    workers: int
    servers: int
    mode: str                      # "sync" (BSP), "async" (Downpour) or "ssp" (bounded staleness)
    staleness: int                 # ssp: a worker may run at most this many steps ahead of the slowest
    steps: int                     # steps each worker runs
    batch: int                     # the global batch: each worker takes its 1/W of every batch
    seed: int
    compression: str               # runtime/ps_compression.CODECS
    topk_ratio: float
    optimizer: dict                # compiler/optim.optimizer_to_json form
    data_inputs: list[str]
    label_input: str | None
    loss_output: str
    model_outputs: list[str]
    parameters: list[str]
    gradients: dict[str, str]
    shards: list[list[str]]
    scalars: list[str]
    eval_inputs: list[str]
    shapes: dict[str, list[int]] = field(default_factory=dict)  # parameter -> shape
    compress_pulls: bool = True    # with compression: the weights' changes go through the codec too
    link_gbit_s: float = 0.0       # emulated link bandwidth (0: none); see `throttle`
    link_latency_s: float = 0.0    # emulated link latency per message
    run_dir: str = ""              # where checkpoints go (RUN_DIR/checkpoints/step_S); "" for none
    checkpoint_every: int = 0      # a checkpoint after every this many steps (0: none)
    start: int = 0                 # the steps done before: the job resumes from checkpoint step_<start>
    layout: str = "standalone"     # LAYOUTS: servers in processes of their own, or in the workers' processes
    # SGD's momentum kept by the workers, the servers applying plain SGD (compiler/ps_momentum.py); fixed when
    # the job is compiled, since the servers' update programs depend on it.
    momentum_correction: bool = False

    @property
    def pull_codec(self) -> str:
        """The codec of the weights servers send: the job's, or float32 when pulls are not compressed."""
        return self.compression if self.compress_pulls else "none"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"parameter-server mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.mode == "ssp" and self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        self.check_layout(self.layout, self.workers, self.servers)

    @staticmethod
    def check_layout(layout: str, workers: int, servers: int) -> None:
        """ValueError unless `layout` is one of LAYOUTS and, colocated, each server has a worker to run in."""
        if layout not in LAYOUTS:
            raise ValueError(f"parameter-server layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
        if layout == "colocated" and servers > workers:
            raise ValueError(f"colocated servers run in the workers' processes: {servers} servers need as many "
                             f"workers, not {workers}")

    def write(self, directory: Path) -> None:
        """job.json in `directory`."""
        (directory / JOB_FILE).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def read(cls, directory: Path) -> "PSJob":
        """The job job.json in `directory` describes."""
        return cls(**json.loads((directory / JOB_FILE).read_text()))

    @property
    def world(self) -> int:
        """The ranks: workers and standalone servers."""
        return self.workers + (self.servers if self.layout == "standalone" else 0)

    def checkpoints_at(self, clock: int) -> bool:
        """Whether the ranks write a checkpoint when every worker has done `clock` steps (compiler/ps_checkpoint.py):
        every `checkpoint_every` steps and after the last one, so that a finished run's newest checkpoint is at
        its final step (a resume then knows there is nothing left to do)."""
        return bool(self.run_dir and self.checkpoint_every) and self.start < clock <= self.steps \
            and (clock % self.checkpoint_every == 0 or clock == self.steps)

    def server_rank(self, shard: int) -> int:
        """The rank of the server holding shard `shard`."""
        return shard if self.layout == "colocated" else self.workers + shard

    def hosts_server(self, rank: int) -> bool:
        """Whether rank `rank` runs a server: a standalone server's rank, or a worker's hosting one colocated."""
        return rank >= self.workers or (self.layout == "colocated" and rank < self.servers)

    def role(self, rank: int) -> str:
        """'worker K', 'server K' or 'worker K with server K' for a rank, as failures name it."""
        if rank >= self.workers:
            return f"server {rank - self.workers}"
        return f"worker {rank} with server {rank}" if self.hosts_server(rank) else f"worker {rank}"

    def segments(self, shard: int) -> list[int]:
        """A shard's 1-bit segments: one per output channel of each of its parameters (column_segments)."""
        from .ps_compression import column_segments

        return column_segments([self.shapes[name] for name in self.shards[shard]])

    def sizes(self, shard: int) -> list[int]:
        """The element count of each parameter of a shard, in shard order."""
        return [int(np.prod(self.shapes[name], dtype=np.int64)) for name in self.shards[shard]]


def flatten(values: dict[str, np.ndarray], names: list[str]) -> np.ndarray:
    """The named arrays as one float32 vector, in `names` order."""
    return np.concatenate([np.asarray(values[name], np.float32).reshape(-1) for name in names])


def unflatten(vector: np.ndarray, names: list[str], shapes: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """The named arrays a vector `flatten` made holds."""
    arrays, start = {}, 0
    for name in names:
        size = int(np.prod(shapes[name], dtype=np.int64))
        arrays[name] = vector[start:start + size].reshape(shapes[name])
        start += size
    return arrays


def throttle(job: PSJob, nbytes: int) -> None:
    """Emulate a slow link (documented, reported as emulated): before a message of `nbytes` leaves, its sender
    waits the link's latency plus the bytes' time at the link's bandwidth, as a sender's network interface
    would; loopback between local processes is faster than any network."""
    import time

    if job.link_gbit_s or job.link_latency_s:
        time.sleep(job.link_latency_s + (8 * nbytes / (job.link_gbit_s * 1e9) if job.link_gbit_s else 0.0))


def header(kind: int, clock: int = 0, nbytes: int = 0):
    """A message header tensor."""
    import torch

    return torch.tensor([kind, clock, nbytes, 0], dtype=torch.int64)
