"""Kernel times for predicting a step (compiler/step_kernels.py): every kernel a data-parallel step's programs call,
timed inside them (transfers and collectives left out, the values they would bring filled in), kept in the profile
database apart from the kernels' times on their own, and preferred to those."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tessel
from bench.training_models import SPECS, export
from tessel.compiler import step_kernels
from tessel.compiler.step_kernels import _always_called, kernel_times, time_step, worker_kernel_sites
from tessel.runtime.errors import ArtifactError, ExecutionError
from tessel.runtime.executor import Executor
from tessel.runtime.instructions import AllReduce, KernelCall, program_from_json
from tessel.runtime.profile_db import ProfileDB


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, kernel_cache):
    """The MLP's data-parallel step on 2 workers: (artifact directory, plan)."""
    spec = SPECS["mlp"]
    path = export(spec.model(0), spec.input_shape, tmp_path_factory.mktemp("step_kernels") / "mlp.onnx")
    trainer = tessel.compile_training(str(path), loss=spec.loss, optimizer=tessel.optim.SGD(lr=0.05, momentum=0.9),
                                      input_shapes={"x": spec.input_shape}, devices=2, placement="data",
                                      cache_dir=kernel_cache)
    try:
        yield Path(trainer.step_artifact.directory), trainer.step_artifact.plan
    finally:
        trainer.close()


def _calls(plan) -> list[tuple[str, str]]:
    return [(key, i.node) for w in plan["workers"] for i in program_from_json(w["instructions"])
            if isinstance(i, KernelCall) for key in i.kernel_keys()]


def test_every_kernel_the_step_calls_is_timed_inside_it(replicas):
    directory, plan = replicas
    sites = worker_kernel_sites(directory, 0, runs=2)
    program = program_from_json(plan["workers"][0]["instructions"])
    assert [kernel for kernel, _ in sites] == [i.kernel for i in program if isinstance(i, KernelCall)]
    assert all(ms > 0 for _, ms in sites)


def test_a_kernels_only_executor_fills_what_other_workers_send_and_never_transfers(replicas):
    directory, plan = replicas
    with pytest.raises(ArtifactError, match="exchanges tensors with other workers"):
        Executor(directory, worker=1)
    executor = Executor(directory, worker=1, kernels_only=True)
    program = program_from_json(plan["workers"][1]["instructions"])
    reduced = {name for i in program if isinstance(i, AllReduce) for name in i.writes()}
    assert executor.received_values() and set(executor.received_values()) <= reduced
    feeds = {name: np.zeros(t.shape, np.float32) if t.dtype == "float32" else np.zeros(t.shape, np.int64)
             for name, t in executor.input_types.items()}
    with pytest.raises(ExecutionError, match="only times its kernels"):
        executor.run(feeds)


def _in_this_process(directory, plan, threads, runs=2):
    """time_step's times, each worker timed here in turn (no fresh processes: a default test stays fast)."""
    sites = [site for worker in range(len(plan["workers"])) for site in worker_kernel_sites(directory, worker, runs)]
    return {kernel: float(np.mean([ms for k, ms in sites if k == kernel])) for kernel, _ in sites}


def test_prediction_times_come_from_inside_the_step_and_are_kept(replicas, tmp_path, monkeypatch):
    directory, plan = replicas
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(step_kernels, "time_step", _in_this_process)
    first = kernel_times(directory, plan, _calls(plan), threads=1)
    db = ProfileDB()
    assert all(db.get(k, 1, len(plan["workers"])) > 0 for k in _always_called(plan))
    assert all(t.measured for t in first.values())
    # A kernel's time on its own does not replace its time inside the step; nothing is timed again.
    some = next(iter(_always_called(plan)))
    db.put({ProfileDB.key(some, 1): 1e3})
    monkeypatch.setattr(step_kernels, "time_step", lambda *args: pytest.fail("timed again"))
    monkeypatch.setattr(step_kernels, "_time_in_fresh_process", lambda *args: pytest.fail("timed again"))
    again = kernel_times(directory, plan, _calls(plan), threads=1)
    assert again == first and again[some].seconds == pytest.approx(db.get(some, 1, len(plan["workers"])) / 1e3)


def test_remeasure_times_the_step_again_over_kept_times(replicas, tmp_path, monkeypatch):
    directory, plan = replicas
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path))
    kept = {k: 1e3 for k in _always_called(plan)}
    ProfileDB().put({ProfileDB.key(k, 1, len(plan["workers"])): ms for k, ms in kept.items()})
    monkeypatch.setattr(step_kernels, "time_step", _in_this_process)
    monkeypatch.setattr(step_kernels, "_time_in_fresh_process", lambda *args: pytest.fail("every kernel is in-step"))
    assert all(t.seconds == 1.0 for t in kernel_times(directory, plan, _calls(plan), threads=1).values())
    fresh = kernel_times(directory, plan, _calls(plan), threads=1, remeasure=True)
    assert all(t.measured and t.seconds < 1.0 for t in fresh.values())
    assert all(ProfileDB().get(k, 1, len(plan["workers"])) < 1e3 for k in kept)


@pytest.mark.slow
def test_the_workers_programs_are_timed_at_once_each_in_a_fresh_process(replicas):
    directory, plan = replicas
    times = time_step(directory, plan, threads=1, runs=2)
    assert set(times) == _always_called(plan) and all(ms > 0 for ms in times.values())


def test_every_timed_run_starts_when_every_worker_is_about_to_start_it(tmp_path):
    import threading
    import time

    assert step_kernels._run_barrier(None, 0, 2) is None
    started: list[tuple[int, int, float]] = []

    def worker(rank: int, delay_s: float) -> None:
        before_run = step_kernels._run_barrier((tmp_path, 2), rank, 2)
        for run in range(3):
            time.sleep(delay_s)
            before_run()
            started.append((run, rank, time.monotonic()))

    threads = [threading.Thread(target=worker, args=(rank, 0.1 * rank)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # The slower worker sets the pace: the other's run r starts only after the slower one reached it (without the
    # barrier, 0.1, 0.2 and 0.3 s before it).
    for run in range(3):
        fast, slow = (t for r, rank, t in sorted(started, key=lambda s: s[1]) if r == run)
        assert abs(fast - slow) < 0.05


def test_a_worker_that_fails_stops_the_others_at_once(tmp_path, monkeypatch):
    import subprocess
    import sys
    import time

    started = []

    def start(request, out, threads):
        # Worker 0 would wait at the barrier for minutes; worker 1 fails at once.
        code = "import time; time.sleep(120)" if "request0" in str(request) else "import sys; sys.exit('no luck')"
        with open(step_kernels._stderr_of(out), "w") as errors:
            started.append(subprocess.Popen([sys.executable, "-c", code], stderr=errors))
        return started[-1]

    monkeypatch.setattr(step_kernels, "_start_main", start)
    begin = time.monotonic()
    assert time_step(tmp_path, {"workers": [{}, {}]}, threads=1) == {}
    assert time.monotonic() - begin < 30
    assert all(p.poll() is not None for p in started)  # the waiting one was stopped, nothing left behind
