"""Killing a data-parallel worker mid-epoch (compiler/train_command.py, compiler/train_checkpoints.py): the run stops
with one line naming the dead worker and leaves no process behind; `tessel train --resume` continues from the
newest mid-epoch checkpoint and ends with the weights of an uninterrupted run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tessel.compiler.train_log import epoch_records, read_log
from tests.compiler.train_fixtures import (ranked_children, trained_weights, wait_for_step_checkpoint,
                                          write_classifier, write_data)

ROOT = Path(__file__).resolve().parents[2]
SAMPLES, BATCH, EPOCHS, EVERY = 800, 4, 3, 20  # 200 steps per epoch; a checkpoint every 20 steps
WORKER_MODULE = b"tessel.runtime.serve"


@pytest.fixture(scope="module")
def files(tmp_path_factory, tessel_cache):
    root = tmp_path_factory.mktemp("resume")
    env = dict(os.environ, TESSEL_CACHE_DIR=str(tessel_cache), PYTHONPATH=str(ROOT))
    return write_classifier(root / "clf.onnx"), write_data(root / "train.npz", samples=SAMPLES), root, env


def _argv(files, run: Path, *extra: str) -> list[str]:
    model, data, _, _ = files
    return [sys.executable, "-m", "tessel", "train", str(model), "--data", str(data), "--loss", "cross_entropy",
            "--lr", "0.1", "--momentum", "0.9", "--batch", str(BATCH), "--epochs", str(EPOCHS), "--devices", "2",
            "-o", str(run), *extra]


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z":
                return True  # exited; its parent has not reaped it yet
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow  # three runs, each starting two workers: 60-150 s on a loaded 2-core machine
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the workers through /proc")
def test_a_killed_worker_stops_the_run_and_resuming_ends_with_the_uninterrupted_weights(files, tmp_path):
    _, _, root, env = files
    whole = subprocess.run(_argv(files, tmp_path / "whole"), capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=600)
    assert whole.returncode == 0, whole.stderr[-2000:]

    run = tmp_path / "killed"
    process = subprocess.Popen(_argv(files, run, "--checkpoint-every", str(EVERY)), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        wait_for_step_checkpoint(run, process)
        workers = ranked_children(process.pid, WORKER_MODULE)
        assert sorted(workers) == [0, 1]
        os.kill(workers[1], signal.SIGKILL)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0
    lines = err.strip().splitlines()
    assert f"rank 1: worker (pid {workers[1]}) killed by SIGKILL" in lines[-1], err
    assert sum("rank 1" in line for line in lines) == 1 and "Traceback" not in err, err
    assert _gone(workers[0]), "rank 0's worker outlived the run"
    stopped = max(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
    assert 0 < stopped < EPOCHS * SAMPLES // BATCH

    resumed = subprocess.run([sys.executable, "-m", "tessel", "train", "--resume", str(run)], capture_output=True,
                             text=True, env=env, cwd=ROOT, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"step_{stopped}" in resumed.stderr
    expected, got = trained_weights(tmp_path / "whole"), trained_weights(run)
    for name, want in expected.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    assert not list((run / "checkpoints").glob("step_*"))
    assert [r["loss"] for r in epoch_records(read_log(run))] == \
        [r["loss"] for r in epoch_records(read_log(tmp_path / "whole"))]
