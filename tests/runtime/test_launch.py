"""The local launcher: every worker watched, stop signals stop the group, no process or scratch file left behind."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tessel.compiler.api import compile
from tessel.runtime import launch
from tessel.runtime.errors import ExecutionError
from tessel.runtime.launch import GRACE_S, LaunchInterrupted, run_local
from tessel.runtime.worker import LAUNCHER_POLL_S

ROOT = Path(__file__).resolve().parents[2]
# Worker startup (import torch) on a busy machine, before a test may act on the workers.
STARTUP_S = 300
# Slack for polling, killing and reaping on busy cores.
SLACK_S = 4


@pytest.fixture(autouse=True)
def _isolated(tessel_cache, tmp_path, monkeypatch):
    # Profiles go into the session's cache root; scratch directories into tmp_path, where the tests look.
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tessel_cache))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _mlp_weights() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal((256, 256)).astype(np.float32) * 0.1 for _ in range(4)]


@pytest.fixture(scope="module")
def pipeline_artifact(kernel_cache):
    """Four MatMul+Relu layers split into a two-stage pipeline (each stage sends to the other)."""
    nodes, weights, x = [], [], "x"
    for k, w in enumerate(_mlp_weights()):
        weights.append(numpy_helper.from_array(w, f"w{k}"))
        nodes += [helper.make_node("MatMul", [x, f"w{k}"], [f"m{k}"]), helper.make_node("Relu", [f"m{k}"], [f"r{k}"])]
        x = f"r{k}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 256])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [16, 256])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    artifact = compile(model, devices=2, placement="pipeline", profile=False, cache_dir=kernel_cache)
    assert artifact.devices == 2 and artifact.report()["placement"]["transfer_bytes"] > 0
    return artifact


def _workers_of(parent: int) -> list[int]:
    """Pids of the worker processes (one-shot runtime.worker, or a session's runtime.serve) whose parent is `parent`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:  # the process ended meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and (b"tessel.runtime.worker" in command or b"tessel.runtime.serve" in command):
            found.append(int(entry.name))
    return found


def _running(pid: int, artifact: Path) -> bool:
    """The worker has joined the group and built its executor: the artifact's kernels are mapped."""
    try:
        return str(artifact / "kernels") in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _wait_for_workers(parent: int, artifact: Path, count: int = 2) -> list[int]:
    """The launcher's workers, once all of them run the artifact."""
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        workers = _workers_of(parent)
        if len(workers) == count and all(_running(pid, artifact) for pid in workers):
            return workers
        time.sleep(0.1)
    raise AssertionError(f"the launcher did not start {count} running workers within {STARTUP_S} s")


def _rank(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).removeprefix(b"RANK="))


def _gone(pid: int) -> bool:
    """The process no longer exists, not even as a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _ended(pid: int) -> bool:
    """The process has exited (gone, or a zombie its new parent has yet to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _kill_if_alive(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _meanwhile(artifact: Path, action, give_up_s: float) -> dict:
    """In a thread: once this process's two workers run, `action(workers, seen)`; `give_up_s` later, kill
    whatever of them still runs, so that a launcher that hangs fails the test instead of hanging it."""
    seen: dict = {"workers": []}

    def body() -> None:
        try:
            seen["workers"] = _wait_for_workers(os.getpid(), artifact)
            action(seen["workers"], seen)
        finally:
            time.sleep(give_up_s)
            _kill_if_alive(seen["workers"] or _workers_of(os.getpid()))

    threading.Thread(target=body, daemon=True).start()
    return seen


def _scratch_dirs(tmp_path: Path) -> list[Path]:
    return list(tmp_path.glob("tessel-run-*"))


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"], start_new_session=True)


def test_wait_watches_every_worker_not_only_the_first_live_one(monkeypatch):
    monkeypatch.setattr(launch, "GRACE_S", 0.5)
    stuck, failing = _sleeper(), subprocess.Popen(["sh", "-c", "exit 3"], start_new_session=True)
    started = time.monotonic()
    try:
        failed, overdue = launch._wait([stuck, failing], 30.0, launch._StopSignals())
    finally:
        launch._kill([stuck, failing])
    assert time.monotonic() - started < 0.5 + SLACK_S
    assert (failed, overdue) == ([1], [0])
    assert stuck.returncode == -signal.SIGKILL and _gone(stuck.pid) and _gone(failing.pid)


def test_a_worker_still_running_long_after_the_others_finished_is_stopped(monkeypatch):
    monkeypatch.setattr(launch, "GRACE_S", 0.5)
    done, stuck = subprocess.Popen(["true"], start_new_session=True), _sleeper()
    try:
        failed, overdue = launch._wait([done, stuck], 1.0, launch._StopSignals())
    finally:
        launch._kill([done, stuck])
    assert (failed, overdue) == ([], [1]) and _gone(stuck.pid)
    line = launch._failure_line(Path("."), [done, stuck], failed, overdue, 1.5)
    assert line.startswith("rank 1: still running 2 s after another worker finished")


def test_a_stopped_worker_fails_the_launch_within_timeout_and_grace(pipeline_artifact, tmp_path):
    timeout = 5.0

    def stop_rank0(workers, seen) -> None:
        time.sleep(1)  # into the runs
        os.kill(next(pid for pid in workers if _rank(pid) == 0), signal.SIGSTOP)
        seen["stopped_at"] = time.monotonic()

    seen = _meanwhile(pipeline_artifact.directory, stop_rank0, give_up_s=timeout + GRACE_S + 60)
    with pytest.raises(ExecutionError) as failure:
        run_local(pipeline_artifact.directory, 2, None, repeat=20000, timeout=timeout)
    waited = time.monotonic() - seen["stopped_at"]
    assert waited <= timeout + GRACE_S + SLACK_S, waited
    message = str(failure.value)
    assert "\n" not in message and message.startswith("rank 1: ") and "rank 0" in message, message
    assert all(_gone(pid) for pid in seen["workers"])
    assert _scratch_dirs(tmp_path) == []


def test_sigterm_to_tessel_run_stops_the_workers_and_leaves_no_file(pipeline_artifact, tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    run = subprocess.Popen([sys.executable, "-m", "tessel.compiler.cli", "run", str(pipeline_artifact.directory),
                            "--repeat", "100000"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    workers = []
    try:
        workers = _wait_for_workers(run.pid, pipeline_artifact.directory)
        time.sleep(1)
        run.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        _, err = run.communicate(timeout=60)
        waited = time.monotonic() - signalled
    finally:
        _kill_if_alive([run.pid, *workers])
    ours = [line for line in err.splitlines() if line.startswith("tessel:")]
    assert run.returncode != 0 and len(ours) == 1 and "Traceback" not in err, err
    assert waited < SLACK_S + 5, waited
    assert all(_gone(pid) for pid in workers)
    assert list(tmp_path.iterdir()) == []  # a session's workers write their stderr to unlinked files



def test_workers_leave_when_the_launcher_is_killed_outright(pipeline_artifact, tmp_path):
    run = subprocess.Popen([sys.executable, "-m", "tessel.compiler.cli", "run", str(pipeline_artifact.directory),
                            "--repeat", "100000"], cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path)},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = []
    try:
        workers = _wait_for_workers(run.pid, pipeline_artifact.directory)
        run.kill()
        run.wait()
        deadline = time.monotonic() + LAUNCHER_POLL_S + 2 * SLACK_S
        while time.monotonic() < deadline and not all(_ended(pid) for pid in workers):
            time.sleep(0.1)
        assert all(_ended(pid) for pid in workers)
    finally:
        _kill_if_alive(workers)

@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_a_stop_signal_during_run_local_raises_and_restores_the_callers_handler(signum, pipeline_artifact, tmp_path):
    def callers_handler(*_):
        raise AssertionError("the launcher's handler should be active during the launch")

    def interrupt(workers, seen) -> None:
        time.sleep(1)
        os.kill(os.getpid(), signum)

    previous = signal.signal(signum, callers_handler)
    try:
        seen = _meanwhile(pipeline_artifact.directory, interrupt, give_up_s=60)
        with pytest.raises(LaunchInterrupted) as interrupted:
            run_local(pipeline_artifact.directory, 2, None, repeat=20000, timeout=30)
        assert signal.getsignal(signum) is callers_handler
    finally:
        signal.signal(signum, previous)
    assert interrupted.value.signum == signum and signal.Signals(signum).name in str(interrupted.value)
    assert all(_gone(pid) for pid in seen["workers"])
    assert _scratch_dirs(tmp_path) == []


@pytest.mark.parametrize("listening", [True, False], ids=["silent-listener", "nobody-listening"])
def test_a_rank_started_directly_honours_the_timeout_in_rendezvous(listening, pipeline_artifact):
    # A silent listener never accepts: the kernel completes the client's connect, and nobody ever answers.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        if listening:
            holder.listen(8)
        env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        started = time.monotonic()
        worker = subprocess.Popen([sys.executable, "-m", "tessel.runtime.worker", str(pipeline_artifact.directory),
                                   "--timeout", "3"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
        try:
            _, err = worker.communicate(timeout=90)
        finally:
            _kill_if_alive([worker.pid])
        took = time.monotonic() - started
    lines = [line for line in err.splitlines() if line.strip()]
    assert worker.returncode == 1 and len(lines) == 1, err
    assert lines[0].startswith("tessel worker: rank 1: no rendezvous") and "within 3 s" in lines[0]
    # Python and torch start in a few seconds; without the bound the worker waited forever.
    assert took < 3 + 25, took


def test_a_streamed_run_returns_rank_0s_outputs_and_leaves_nothing_behind(pipeline_artifact, tmp_path):
    x = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32)
    outputs, times = run_local(pipeline_artifact.directory, 2, {"x": x}, repeat=50, timeout=30)
    expected = x
    for w in _mlp_weights():
        expected = np.maximum(expected @ w, 0)
    np.testing.assert_allclose(outputs["r3"], expected, rtol=1e-4, atol=1e-4)
    assert times["runs"] == 50 and times["seconds_per_batch"] > 0
    assert _scratch_dirs(tmp_path) == [] and _workers_of(os.getpid()) == []
