"""RUN_DIR/log.jsonl: one JSON object per line, a "step" record per training step and an "epoch" record per
epoch; what the progress lines, the training-curves chart and a resumed run read back."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

from tessel.ir.errors import TesselError

LOG_FILE = "log.jsonl"
# The record kinds: one per step, one per finished epoch.
STEP, EPOCH = "step", "epoch"


class RunLogError(TesselError):
    """The run's log cannot be read back (a resumed run needs it)."""


class RunLog:
    """Appends records to RUN_DIR/log.jsonl, each written and flushed at once (a killed run keeps its lines)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOG_FILE
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record as a JSON line (NaN and infinity, e.g. a diverged loss, written as null)."""
        clean = {key: None if isinstance(value, float) and not math.isfinite(value) else value
                 for key, value in record.items()}
        self._file.write(json.dumps(clean, sort_keys=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_log(run_dir: Path) -> list[dict[str, Any]]:
    """The records of RUN_DIR/log.jsonl, in order; a last line cut short by a kill is left out."""
    path = Path(run_dir) / LOG_FILE
    if not path.is_file():
        return []
    records = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):  # the run was killed while writing it
                break
            raise RunLogError(f"{path}:{number}: not a JSON line; the log was edited or damaged") from None
    return records


def keep_until(run_dir: Path, steps_done: int) -> None:
    """Rewrite the log without the records past `steps_done` (a resumed run redoes those steps)."""
    kept = [r for r in read_log(run_dir) if r.get("step", 0) <= steps_done]
    (Path(run_dir) / LOG_FILE).write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")


def step_record(epoch: int, step: int, loss: float, **more: Any) -> dict[str, Any]:
    """A "step" record: one step's loss, with what else the caller measured."""
    return {"kind": STEP, "epoch": epoch, "step": step, "loss": loss, **more}


def epoch_record(epoch: int, step: int, **more: Any) -> dict[str, Any]:
    """An "epoch" record, written after the epoch's last step (the caller adds its loss, rates, validation)."""
    return {"kind": EPOCH, "epoch": epoch, "step": step, **more}


def epoch_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The "epoch" records."""
    return [r for r in records if r.get("kind") == EPOCH]


def step_records(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The "step" records."""
    return [r for r in records if r.get("kind") == STEP]
