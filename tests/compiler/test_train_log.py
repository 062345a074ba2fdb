"""compiler/train_log.py: JSON lines written at once, read back, cut back for a resumed run."""
from __future__ import annotations

import math

from tessel.compiler.train_log import LOG_FILE, RunLog, epoch_records, keep_until, read_log, step_records


def test_records_round_trip_and_a_diverged_loss_is_null(tmp_path):
    with RunLog(tmp_path) as log:
        log.write({"kind": "step", "epoch": 1, "step": 1, "loss": 2.5, "lr": 0.1})
        log.write({"kind": "step", "epoch": 1, "step": 2, "loss": math.nan, "lr": 0.1})
        assert len(read_log(tmp_path)) == 2  # flushed at once: a killed run keeps its lines
        log.write({"kind": "epoch", "epoch": 1, "step": 2, "loss": 1.0})
    records = read_log(tmp_path)
    assert [r["step"] for r in step_records(records)] == [1, 2] and records[1]["loss"] is None
    assert epoch_records(records) == [{"kind": "epoch", "epoch": 1, "step": 2, "loss": 1.0}]


def test_a_line_cut_short_by_a_kill_is_left_out(tmp_path):
    (tmp_path / LOG_FILE).write_text('{"kind": "step", "step": 1}\n{"kind": "st')
    assert read_log(tmp_path) == [{"kind": "step", "step": 1}]


def test_keep_until_drops_the_steps_a_resumed_run_redoes(tmp_path):
    with RunLog(tmp_path) as log:
        for step in range(1, 7):
            log.write({"kind": "step", "step": step})
            if step % 3 == 0:
                log.write({"kind": "epoch", "step": step})
    keep_until(tmp_path, 3)
    assert [(r["kind"], r["step"]) for r in read_log(tmp_path)] == [("step", 1), ("step", 2), ("step", 3),
                                                                    ("epoch", 3)]
