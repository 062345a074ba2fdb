"""`tessel train --launcher torchrun` (compiler/train_launch.py, runtime/rank_group.py): torchrun's ranks on
127.0.0.1 train like local workers; under `torchrun --max-restarts 1` a killed rank makes torchrun restart the
group, which resumes from the newest checkpoint by itself and ends with the uninterrupted run's weights."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tessel.compiler.cli import main
from tessel.runtime.launch import free_port
from tests.compiler.train_fixtures import (ranked_children, trained_weights, wait_for_step_checkpoint,
                                          write_classifier, write_data)

ROOT = Path(__file__).resolve().parents[2]
SAMPLES, BATCH, EPOCHS, EVERY = 800, 4, 2, 20  # 200 steps per epoch; a checkpoint every 20 steps


def _train_argv(model: Path, data: Path, run: Path, *extra: str) -> list[str]:
    return ["train", str(model), "--data", str(data), "--loss", "cross_entropy", "--lr", "0.1", "--momentum", "0.9",
            "--batch", str(BATCH), "--epochs", str(EPOCHS), "--devices", "2", "-o", str(run), *extra]


def test_the_torchrun_launcher_outside_torchrun_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    model, data = write_classifier(tmp_path / "clf.onnx"), write_data(tmp_path / "train.npz")
    code = main(_train_argv(model, data, tmp_path / "run", "--launcher", "torchrun"))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--launcher torchrun runs under torchrun" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # two runs, one of them restarted by torchrun: 60-120 s on a loaded 2-core machine
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the ranks through /proc")
def test_torchrun_restarts_a_killed_group_which_resumes_and_ends_like_an_uninterrupted_run(tmp_path, tessel_cache):
    env = dict(os.environ, TESSEL_CACHE_DIR=str(tessel_cache), PYTHONPATH=str(ROOT))
    env.pop("TORCHELASTIC_RUN_ID", None)
    model, data = write_classifier(tmp_path / "clf.onnx"), write_data(tmp_path / "train.npz", samples=SAMPLES)
    whole = subprocess.run([sys.executable, "-m", "tessel", *_train_argv(model, data, tmp_path / "whole")],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert whole.returncode == 0, whole.stderr[-2000:]

    run = tmp_path / "torchrun"
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "tessel",
         *_train_argv(model, data, run, "--launcher", "torchrun", "--checkpoint-every", str(EVERY))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        wait_for_step_checkpoint(run, agent)
        ranks = ranked_children(agent.pid)
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[1], signal.SIGKILL)
        _, err = agent.communicate(timeout=600)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, err[-3000:]
    assert "tessel: error: rank 0: " in err, err[-3000:]  # the first attempt's rank 0: one line on the dead peer
    assert "torchrun restarted the group: resuming" in err and "from step_" in err, err[-3000:]
    expected, got = trained_weights(tmp_path / "whole"), trained_weights(run)
    for name, want in expected.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
