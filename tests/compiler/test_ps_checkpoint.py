"""Parameter-server checkpoints (compiler/ps_checkpoint.py): a job resumed from its newest checkpoint ends as the
uninterrupted job does, and `tessel train --parallel ps --resume` continues a killed run in every mode."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import tessel
from bench.training_models import SPECS, export
from tessel.compiler.ps_launch import run_job
from tessel.compiler.ps_training import prepare_job
from tessel.compiler.train_checkpoints import mid_epoch_steps
from tests.compiler.train_fixtures import trained_weights, write_classifier, write_data

STEPS, BATCH = 8, 16


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, kernel_cache):
    spec = SPECS["mlp"]
    root = tmp_path_factory.mktemp("psckpt")
    path = export(spec.model(0), spec.input_shape, root / "mlp.onnx")
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((48, 32)).astype(np.float32),
            "labels": rng.standard_normal((48, 4)).astype(np.float32)}
    job = prepare_job(str(path), "mse", tessel.optim.SGD(lr=0.05, momentum=0.9), data, root / "job", workers=2,
                      servers=1, batch=BATCH, steps=STEPS, cache_dir=kernel_cache)
    return root / "job", job


@pytest.mark.parametrize("settings", [{"mode": "sync", "compression": "1bit"},
                                      pytest.param({"mode": "ssp", "staleness": 1, "compression": "none"},
                                                   marks=pytest.mark.slow)])
def test_a_job_resumed_from_its_newest_checkpoint_ends_as_the_uninterrupted_job(compiled, tmp_path, settings):
    directory, base = compiled
    job = replace(base, run_dir=str(tmp_path), checkpoint_every=3, **settings)
    job.write(directory)
    whole = run_job(directory)
    assert mid_epoch_steps(tmp_path) == [6]  # only the newest is kept
    replace(job, start=6).write(directory)
    resumed = run_job(directory)
    for before, after in zip(whole.reports, resumed.reports):
        assert len(after["losses"]) == STEPS
        np.testing.assert_array_equal(after["losses"][:6], before["losses"][:6])
    if job.mode == "sync":  # two workers: the averaged gradients do not depend on the order pushes arrive in
        for name, value in whole.parameters.items():
            np.testing.assert_array_equal(resumed.parameters[name], value, err_msg=name)
        for name, value in whole.slots.items():
            np.testing.assert_array_equal(resumed.slots[name], value, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("mode, victim", [(["--ps-mode", "sync", "--compression", "1bit"], "worker 1"),
                                          (["--ps-mode", "async"], "server 0"), (["--staleness", "2"], "worker 0")])
def test_a_killed_run_is_named_in_one_line_and_resumes_in_every_mode(tmp_path, mode, victim):
    model, data = write_classifier(tmp_path / "m.onnx"), write_data(tmp_path / "d.npz", samples=64)
    run = tmp_path / "run"
    command = [sys.executable, "-m", "tessel.compiler.cli", "train", str(model), "--data", str(data), "--loss",
               "cross_entropy", "--lr", "0.1", "--batch", "8", "--epochs", "400", "--devices", "2", "--parallel",
               "ps", "--servers", "1", "--checkpoint-every", "4", *mode, "-o", str(run)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not mid_epoch_steps(run):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    _kill(process.pid, victim)
    _, err = process.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith((" ", "Traceback"))]
    assert process.returncode != 0 and f"{victim} (rank" in lines[-1], err
    resumed = subprocess.run([sys.executable, "-m", "tessel.compiler.cli", "train", "--resume", str(run), "--epochs",
                              "401"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "3208 steps" in resumed.stdout and trained_weights(run)["W"].shape == (3, 4)


def _kill(pid: int, victim: str) -> None:
    """SIGKILL the rank process called `tessel-ps <victim>` among `pid`'s descendants."""
    import psutil

    for child in psutil.Process(pid).children(recursive=True):
        if child.name() == f"tessel-ps {victim}"[:15] or f"tessel-ps {victim}" in " ".join(child.cmdline()):
            child.kill()
            return
    raise AssertionError(f"no rank called {victim}")
