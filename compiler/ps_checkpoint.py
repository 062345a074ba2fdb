"""Checkpoints of a parameter-server job: RUN_DIR/checkpoints/step_S (S: the steps every worker has done), a
consistent cut of every rank's state, which a job with `start = S` resumes from.

At a checkpoint clock S (PSJob.checkpoints_at) every worker writes its part (worker<r>.npz: the weights it holds,
its error-feedback residuals and, with momentum correction, its momentum buffers; worker<r>_statistics.npz: its
BatchNormalization statistics; worker<r>.json: its losses and bytes so far), then pulls. A server answers the pulls of clock S only once all workers have sent
theirs (so in every mode all workers have pushed exactly S gradients and written their part), and before it
answers it writes its shard (shard<s>.npz: parameters and optimizer slots; shard<s>_views.npz: with compressed
pulls, the weights each worker holds; shard<s>.json: its update count). Once every server has answered worker 0,
every part is written: worker 0 renames step_S.partial to step_S and removes the older step checkpoints. Async
and SSP jobs thus meet at each checkpoint, as BSP does every step. The last checkpoint is at the job's final
step (its pull only meets the others'), so that a finished run's newest checkpoint says it is finished.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from .train_checkpoints import mid_epoch_steps, step_checkpoint_dir

PARTIAL = ".partial"


def partial_dir(run_dir: str | Path, steps: int) -> Path:
    """Where the checkpoint after `steps` steps is written until it is complete (made if absent)."""
    final = step_checkpoint_dir(Path(run_dir), steps)
    partial = final.with_name(final.name + PARTIAL)
    partial.mkdir(parents=True, exist_ok=True)
    return partial


def finish(run_dir: str | Path, steps: int) -> None:
    """Make the checkpoint after `steps` steps the newest complete one and remove the older ones."""
    final = step_checkpoint_dir(Path(run_dir), steps)
    if final.exists():  # a resumed run redoing a checkpoint
        shutil.rmtree(final)
    partial_dir(run_dir, steps).rename(final)
    for older in mid_epoch_steps(Path(run_dir)):
        if older < steps:
            shutil.rmtree(step_checkpoint_dir(Path(run_dir), older))


def write_worker(directory: Path, rank: int, weights: list[np.ndarray], residuals: list[np.ndarray],
                 momenta: list[np.ndarray], statistics: dict[str, np.ndarray], report: dict) -> None:
    """A worker's part: the weights it holds, its residuals and momentum buffers (one each per shard; no
    momenta without momentum correction), statistics and report."""
    np.savez(directory / f"worker{rank}.npz", **{f"weights{s}": w for s, w in enumerate(weights)},
             **{f"residual{s}": r for s, r in enumerate(residuals)},
             **{f"momentum{s}": m for s, m in enumerate(momenta)})
    np.savez(directory / f"worker{rank}_statistics.npz", **statistics)
    (directory / f"worker{rank}.json").write_text(json.dumps(report))


def read_worker(directory: Path, rank: int, shards: int) -> tuple[list[np.ndarray], list[np.ndarray],
                                                                  list[np.ndarray], dict[str, np.ndarray], dict]:
    """(weights, residuals, momenta, statistics, report) `write_worker` wrote."""
    with np.load(directory / f"worker{rank}.npz", allow_pickle=False) as data:
        weights = [data[f"weights{s}"] for s in range(shards)]
        residuals = [data[f"residual{s}"] for s in range(shards)]
        momenta = [data[f"momentum{s}"] for s in range(shards) if f"momentum{s}" in data.files]
    with np.load(directory / f"worker{rank}_statistics.npz", allow_pickle=False) as data:
        statistics = {name: data[name] for name in data.files}
    return weights, residuals, momenta, statistics, json.loads((directory / f"worker{rank}.json").read_text())


def write_shard(directory: Path, shard: int, state: dict[str, np.ndarray], views: list[np.ndarray] | None,
                updates: int) -> None:
    """A server's part: its parameters and slots, the weights each worker holds (compressed pulls) and its
    update count."""
    np.savez(directory / f"shard{shard}.npz", **state)
    if views is not None:
        np.savez(directory / f"shard{shard}_views.npz", **{f"worker{w}": view for w, view in enumerate(views)})
    (directory / f"shard{shard}.json").write_text(json.dumps({"updates": updates}))


def read_shard(directory: Path, shard: int, workers: int) -> tuple[dict[str, np.ndarray], list[np.ndarray] | None,
                                                                   int]:
    """(state, views or None, updates) `write_shard` wrote."""
    with np.load(directory / f"shard{shard}.npz", allow_pickle=False) as data:
        state = {name: data[name] for name in data.files}
    views = None
    if (directory / f"shard{shard}_views.npz").exists():
        with np.load(directory / f"shard{shard}_views.npz", allow_pickle=False) as data:
            views = [data[f"worker{w}"] for w in range(workers)]
    return state, views, json.loads((directory / f"shard{shard}.json").read_text())["updates"]
