"""Parameter-server checkpoints (compiler/ps_checkpoint.py), the slow checks: a 1-bit job resumed from its newest
checkpoint (error-feedback residuals, the workers' momentum buffers and views restored) ends as the uninterrupted
job does, an SSP job resumes, and a killed job, named in one line, resumes from its checkpoint in every mode."""
from __future__ import annotations

import multiprocessing
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import tessel
from bench.training_models import SPECS, export
from tessel.compiler.ps_checkpoint import read_shard
from tessel.compiler.ps_launch import PSFailure, run_job
from tessel.compiler.ps_training import prepare_job
from tessel.compiler.train_checkpoints import mid_epoch_steps, step_checkpoint_dir
from tessel.runtime.ps_compression import make_codec
from tessel.runtime.ps_job import flatten, unflatten
from tests.compiler.train_fixtures import assert_resume_refused

STEPS, BATCH = 8, 16


def _compile(root: Path, kernel_cache, compression: str) -> tuple[Path, object]:
    """The MLP job (2 workers, 1 server) compiled in `root`; with compression, momentum correction's servers."""
    spec = SPECS["mlp"]
    path = export(spec.model(0), spec.input_shape, root / "mlp.onnx")
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((48, 32)).astype(np.float32),
            "labels": rng.standard_normal((48, 4)).astype(np.float32)}
    job = prepare_job(str(path), "mse", tessel.optim.SGD(lr=0.05, momentum=0.9), data, root / "job", workers=2,
                      servers=1, batch=BATCH, steps=STEPS, compression=compression, cache_dir=kernel_cache)
    return root / "job", job


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, kernel_cache):
    return _compile(tmp_path_factory.mktemp("psckpt"), kernel_cache, "none")


@pytest.fixture(scope="module")
def corrected(tmp_path_factory, kernel_cache):
    """The 1-bit job: the workers keep the momentum (compiler/ps_momentum.py), the server applies plain SGD."""
    directory, job = _compile(tmp_path_factory.mktemp("psckpt_1bit"), kernel_cache, "1bit")
    assert job.momentum_correction
    return directory, job


def _job_for(request, settings: dict):
    """The compiled job a test's settings run on: the 1-bit one with momentum correction, else the plain one."""
    return request.getfixturevalue("corrected" if settings.get("compression") == "1bit" else "compiled")


@pytest.mark.slow  # two jobs each, plus a compile: over a minute on the shared 2-core machine (the fast check of
# resuming is in test_ps_training.py)
@pytest.mark.parametrize("settings", [{"mode": "sync", "compression": "1bit"},
                                      {"mode": "ssp", "staleness": 1, "compression": "none"}])
def test_a_compressed_or_ssp_job_resumes_from_its_newest_checkpoint(request, tmp_path, settings):
    directory, base = _job_for(request, settings)
    job = replace(base, run_dir=str(tmp_path / "whole"), checkpoint_every=3, **settings)
    job.write(directory)
    whole = run_job(directory)
    assert mid_epoch_steps(tmp_path / "whole") == [STEPS]  # only the newest is kept: the final one
    replace(job, run_dir=str(tmp_path), steps=6).write(directory)  # stopped after 6 steps
    stopped = run_job(directory)
    replace(job, run_dir=str(tmp_path), start=6).write(directory)
    resumed = run_job(directory)
    for before, after in zip(stopped.reports, resumed.reports):
        assert len(after["losses"]) == STEPS
        np.testing.assert_array_equal(after["losses"][:6], before["losses"])
    if job.momentum_correction:  # the momentum is the workers' (in their checkpoint parts), not the server's
        assert not whole.slots
    if job.mode == "sync":  # deterministic: the servers add pushes in rank order
        for name, value in whole.parameters.items():
            np.testing.assert_array_equal(resumed.parameters[name], value, err_msg=name)
        for name, value in whole.slots.items():
            np.testing.assert_array_equal(resumed.slots[name], value, err_msg=name)
        for name, value in whole.model.items():
            np.testing.assert_array_equal(resumed.model[name], value, err_msg=name)
    # The model: with compressed pulls the weights worker 0 holds, not the servers'. The final checkpoint has the
    # servers' weights and worker 0's view before the final pull, which moves the view by the decoded change.
    held = {}
    for shard, names in enumerate(job.shards):
        state, views, _ = read_shard(step_checkpoint_dir(tmp_path / "whole", STEPS), shard, job.workers)
        view = views[0] if views is not None else flatten(state, names)
        if views is not None:
            codec = make_codec(job.pull_codec, job.segments(shard), job.topk_ratio)
            codec.decode_add(codec.compress(flatten(state, names) - view), view)
        held.update(unflatten(view, names, job.shapes))
    expected = held if job.compression != "none" else whole.parameters
    for name in job.parameters:
        np.testing.assert_array_equal(whole.model[name], expected[name], err_msg=name)
    if job.compression != "none":
        assert any(not np.array_equal(whole.parameters[name], held[name]) for name in job.parameters)


@pytest.mark.slow
@pytest.mark.parametrize("settings, victim", [({"mode": "sync", "compression": "1bit"}, "worker 1"),
                                              ({"mode": "async"}, "server 0"),
                                              ({"mode": "ssp", "staleness": 2}, "worker 0")])
def test_a_killed_job_is_named_in_one_line_and_resumes_in_every_mode(request, tmp_path, settings, victim):
    directory, base = _job_for(request, settings)
    job = replace(base, run_dir=str(tmp_path), checkpoint_every=4, steps=10 ** 6, **settings)
    job.write(directory)
    failure: list[BaseException] = []
    runner = threading.Thread(target=lambda: _run_catching(directory, failure))
    runner.start()
    deadline = time.monotonic() + 300
    while not mid_epoch_steps(tmp_path):
        assert runner.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    next(p for p in multiprocessing.active_children() if p.name == f"tessel-ps {victim}").kill()
    runner.join(timeout=120)
    assert len(failure) == 1 and isinstance(failure[0], PSFailure)
    message = str(failure[0])
    assert "\n" not in message and f"{victim} (rank" in message and "killed by SIGKILL" in message, message
    done = mid_epoch_steps(tmp_path)[-1]
    replace(job, start=done, steps=done + 6).write(directory)
    resumed = run_job(directory)
    assert all(len(report["losses"]) == done + 6 for report in resumed.reports)


@pytest.mark.slow  # a job per mode (sync: tests/compiler/test_ps_training.py)
@pytest.mark.parametrize("settings", [{"mode": "async"}, {"mode": "ssp", "staleness": 1}])
def test_resuming_a_finished_async_or_ssp_job_is_refused_in_one_line(compiled, tmp_path, settings):
    directory, base = compiled
    replace(base, run_dir=str(tmp_path), checkpoint_every=100, steps=2, **settings).write(directory)
    try:
        run_job(directory)
        assert_resume_refused(directory, tmp_path, 2)
    finally:
        base.write(directory)


def _run_catching(directory: Path, failure: list) -> None:
    try:
        run_job(directory, timeout_s=600)
    except PSFailure as exc:
        failure.append(exc)
