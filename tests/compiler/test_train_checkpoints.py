"""compiler/train_checkpoints.py: which checkpoint a run resumes from, and which ones it keeps."""
from __future__ import annotations

from pathlib import Path

from tessel.compiler.train_checkpoints import (drop_after, drop_superseded, latest_checkpoint, save_checkpoint,
                                                save_step_checkpoint)

STEPS_PER_EPOCH = 10


class _Trainer:
    """What the checkpoint functions use of a Trainer: steps_done and save."""

    def __init__(self, steps_done: int):
        self.steps_done = steps_done

    def save(self, directory: Path) -> None:
        Path(directory).mkdir(parents=True)
        (Path(directory) / "steps").write_text(str(self.steps_done))


def _names(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def test_mid_epoch_checkpoints_are_resumed_from_and_superseded_by_the_epoch_checkpoint(tmp_path):
    save_checkpoint(_Trainer(10), tmp_path, 1, keep=2)
    save_step_checkpoint(_Trainer(13), tmp_path)
    save_step_checkpoint(_Trainer(16), tmp_path)
    assert _names(tmp_path) == ["epoch_1", "step_16"]  # only the newest mid-epoch checkpoint
    assert latest_checkpoint(tmp_path, STEPS_PER_EPOCH) == (tmp_path / "checkpoints" / "step_16", 16)
    save_checkpoint(_Trainer(20), tmp_path, 2, keep=2)
    assert _names(tmp_path) == ["epoch_1", "epoch_2"]
    assert latest_checkpoint(tmp_path, STEPS_PER_EPOCH) == (tmp_path / "checkpoints" / "epoch_2", 20)


def test_the_checkpoint_a_run_resumed_from_stays_until_the_run_is_past_it(tmp_path):
    spare = save_step_checkpoint(_Trainer(13), tmp_path)
    save_step_checkpoint(_Trainer(16), tmp_path, spare=spare)
    save_checkpoint(_Trainer(20), tmp_path, 2, keep=1, spare=spare)
    assert _names(tmp_path) == ["epoch_2", "step_13"]
    drop_superseded(tmp_path, STEPS_PER_EPOCH)
    assert _names(tmp_path) == ["epoch_2"]


def test_resuming_drops_later_and_half_written_checkpoints(tmp_path):
    save_checkpoint(_Trainer(10), tmp_path, 1, keep=0)
    save_step_checkpoint(_Trainer(14), tmp_path)
    save_checkpoint(_Trainer(20), tmp_path, 2, keep=0)
    save_step_checkpoint(_Trainer(25), tmp_path)
    (tmp_path / "checkpoints" / "step_27.partial").mkdir()
    drop_after(tmp_path, 14, STEPS_PER_EPOCH)
    assert _names(tmp_path) == ["epoch_1"]
    assert latest_checkpoint(tmp_path, STEPS_PER_EPOCH) == (tmp_path / "checkpoints" / "epoch_1", 10)
    assert latest_checkpoint(tmp_path / "none", STEPS_PER_EPOCH) is None
