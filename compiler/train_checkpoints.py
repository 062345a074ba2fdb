"""RUN_DIR/checkpoints/epoch_K/: one Trainer.save per epoch, written under a temporary name and renamed when
complete, so that a run killed while saving leaves its previous checkpoints intact and none half-written."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

CHECKPOINTS = "checkpoints"
_EPOCH_DIR = re.compile(r"epoch_(\d+)")
_PARTIAL = ".partial"


def checkpoint_dir(run_dir: Path, epoch: int) -> Path:
    """Where epoch `epoch`'s checkpoint lives."""
    return Path(run_dir) / CHECKPOINTS / f"epoch_{epoch}"


def completed_epochs(run_dir: Path) -> list[int]:
    """The epochs with a complete checkpoint, in order."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _EPOCH_DIR.fullmatch(p.name)))


def save_checkpoint(trainer, run_dir: Path, epoch: int, keep: int, loaded_from: int | None = None) -> Path:
    """Save the trainer as epoch `epoch`'s checkpoint, then remove all but the newest `keep` (0: keep all) and
    the one the trainer was loaded from (`loaded_from`): its artifacts are the files the next save copies."""
    final = checkpoint_dir(run_dir, epoch)
    partial = final.with_name(final.name + _PARTIAL)
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    trainer.save(partial)
    if final.exists():  # a resumed run redoing an epoch whose checkpoint it did not resume from
        shutil.rmtree(final)
    partial.rename(final)
    prune(run_dir, keep, loaded_from)
    return final


def prune(run_dir: Path, keep: int, spare: int | None = None) -> None:
    """Remove all checkpoints but the newest `keep` (0: keep all) and epoch `spare`'s."""
    if keep:
        for old in completed_epochs(run_dir)[:-keep]:
            if old != spare:
                shutil.rmtree(checkpoint_dir(run_dir, old))


def drop_after(run_dir: Path, epoch: int) -> None:
    """Remove half-written checkpoints and those after `epoch` (a resumed run writes them again)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return
    for path in root.iterdir():
        match = _EPOCH_DIR.fullmatch(path.name)
        if path.name.endswith(_PARTIAL) or (match and int(match.group(1)) > epoch):
            shutil.rmtree(path)
