"""RUN_DIR/checkpoints/: one Trainer.save per epoch (epoch_K) and, with --checkpoint-every N, one every N steps
inside an epoch (step_S, S the steps done). Each is written under a temporary name and renamed when complete,
so that a run killed while saving leaves its previous checkpoints intact and none half-written.

A run resumes from the checkpoint with the most steps done, of either kind. Only the newest mid-epoch checkpoint
is kept, and none at or before the newest epoch checkpoint: they exist to lose at most N steps to a crash.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

CHECKPOINTS = "checkpoints"
_EPOCH_DIR = re.compile(r"epoch_(\d+)")
_STEP_DIR = re.compile(r"step_(\d+)")
_PARTIAL = ".partial"


def checkpoint_dir(run_dir: Path, epoch: int) -> Path:
    """Where epoch `epoch`'s checkpoint lives."""
    return Path(run_dir) / CHECKPOINTS / f"epoch_{epoch}"


def step_checkpoint_dir(run_dir: Path, steps: int) -> Path:
    """Where the mid-epoch checkpoint after `steps` steps lives."""
    return Path(run_dir) / CHECKPOINTS / f"step_{steps}"


def completed_epochs(run_dir: Path) -> list[int]:
    """The epochs with a complete checkpoint, in order."""
    return _numbered(run_dir, _EPOCH_DIR)


def mid_epoch_steps(run_dir: Path) -> list[int]:
    """The step counts of the complete mid-epoch checkpoints, in order."""
    return _numbered(run_dir, _STEP_DIR)


def latest_checkpoint(run_dir: Path, steps_per_epoch: int) -> tuple[Path, int] | None:
    """The checkpoint with the most steps done (an epoch's `steps_per_epoch` each) and that count; None if none."""
    found = [(epoch * steps_per_epoch, checkpoint_dir(run_dir, epoch)) for epoch in completed_epochs(run_dir)]
    found += [(steps, step_checkpoint_dir(run_dir, steps)) for steps in mid_epoch_steps(run_dir)]
    if not found:
        return None
    steps, path = max(found)
    return path, steps


def _numbered(run_dir: Path, pattern: re.Pattern) -> list[int]:
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := pattern.fullmatch(p.name)))


def save_checkpoint(trainer, run_dir: Path, epoch: int, keep: int, spare: Path | None = None) -> Path:
    """Save the trainer as epoch `epoch`'s checkpoint, then remove all but the newest `keep` (0: keep all), every
    mid-epoch one it supersedes, but not `spare`, the one the trainer was loaded from: its artifacts are the
    files the next save copies."""
    final = _write(trainer, checkpoint_dir(run_dir, epoch))
    _remove_steps(run_dir, lambda steps: steps <= trainer.steps_done, spare)
    prune(run_dir, keep, spare)
    return final


def save_step_checkpoint(trainer, run_dir: Path, spare: Path | None = None) -> Path:
    """Save the trainer mid-epoch as step_S (S: its steps done), then remove the older mid-epoch ones but `spare`."""
    final = _write(trainer, step_checkpoint_dir(run_dir, trainer.steps_done))
    _remove_steps(run_dir, lambda steps: steps < trainer.steps_done, spare)
    return final


def _write(trainer, final: Path) -> Path:
    partial = final.with_name(final.name + _PARTIAL)
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    trainer.save(partial)
    if final.exists():  # a resumed run redoing a checkpoint it did not resume from
        shutil.rmtree(final)
    partial.rename(final)
    return final


def _remove_steps(run_dir: Path, remove, spare: Path | None) -> None:
    for steps in mid_epoch_steps(run_dir):
        path = step_checkpoint_dir(run_dir, steps)
        if remove(steps) and path != spare:
            shutil.rmtree(path)


def prune(run_dir: Path, keep: int, spare: Path | None = None) -> None:
    """Remove all epoch checkpoints but the newest `keep` (0: keep all) and `spare`."""
    if keep:
        for old in completed_epochs(run_dir)[:-keep]:
            if checkpoint_dir(run_dir, old) != spare:
                shutil.rmtree(checkpoint_dir(run_dir, old))


def drop_superseded(run_dir: Path, steps_per_epoch: int) -> None:
    """Remove the mid-epoch checkpoints at or before the newest epoch checkpoint (kept while a trainer loaded
    from one of them still ran)."""
    epochs = completed_epochs(run_dir)
    if epochs:
        _remove_steps(run_dir, lambda steps: steps <= epochs[-1] * steps_per_epoch, None)


def drop_after(run_dir: Path, steps: int, steps_per_epoch: int) -> None:
    """Remove half-written checkpoints and those with more than `steps` steps done (a resumed run writes them
    again)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return
    for path in root.iterdir():
        epoch, step = _EPOCH_DIR.fullmatch(path.name), _STEP_DIR.fullmatch(path.name)
        if path.name.endswith(_PARTIAL) or (epoch and int(epoch.group(1)) * steps_per_epoch > steps) \
                or (step and int(step.group(1)) > steps):
            shutil.rmtree(path)
