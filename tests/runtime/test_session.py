"""InferenceSession: workers started once and reused, onnxruntime's surface, pipelined requests, failures, shutdown."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tessel.compiler.api import compile
from tessel.compiler.cli import main as cli_main
from tessel.runtime.errors import ExecutionError, InputError
from tessel.runtime.session import InferenceSession
from tessel.runtime.shared_slots import SLOT_LIMIT_ENV

from .test_shared_slots import _memfds

ROOT = Path(__file__).resolve().parents[2]
# Worker start-up (importing torch) on a busy machine.
STARTUP_S = 300
TIMEOUT_S = 20.0


def _mlp(batch: int = 16, width: int = 256):
    """Four MatMul+Relu layers (big enough that a two-stage pipeline splits them) and their weights."""
    rng = np.random.default_rng(0)
    nodes, weights, x = [], [], "x"
    for k in range(4):
        w = (rng.standard_normal((width, width)) * 0.1).astype(np.float32)
        weights.append(w)
        nodes += [helper.make_node("MatMul", [x, f"w{k}"], [f"m{k}"]), helper.make_node("Relu", [f"m{k}"], [f"r{k}"])]
        x = f"r{k}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [batch, width])],
                              [numpy_helper.from_array(w, f"w{k}") for k, w in enumerate(weights)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), weights


def _expected(x: np.ndarray, weights) -> np.ndarray:
    for w in weights:
        x = np.maximum(x @ w, 0)
    return x


@pytest.fixture(scope="module")
def mlp(kernel_cache, tmp_path_factory):
    """A two-stage pipeline of 2 micro-batches on 2 workers, saved; and its weights."""
    model, weights = _mlp()
    artifact = compile(model, devices=2, placement="pipeline", microbatches=2, profile=False, cache_dir=kernel_cache)
    assert artifact.devices == 2 and artifact.report()["placement"]["transfer_bytes"] > 0
    return artifact.save(tmp_path_factory.mktemp("session") / "mlp"), weights


@pytest.fixture(scope="module")
def session(mlp):
    with InferenceSession(mlp[0], timeout=TIMEOUT_S) as opened:
        yield opened


def _feeds(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((16, 256)).astype(np.float32)}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def _wait_gone(pids, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(_gone(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def test_the_workers_start_once_and_serve_every_run(session, mlp):
    pids = session.worker_pids
    assert len(pids) == 2
    for seed in range(3):
        feeds = _feeds(seed)
        np.testing.assert_allclose(session.run(feeds)["r3"], _expected(feeds["x"], mlp[1]), rtol=1e-4, atol=1e-4)
        assert session.worker_pids == pids and not any(_gone(pid) for pid in pids)


def test_runs_go_through_shared_memory_slots_that_are_named_nowhere(session, mlp):
    rank0, rank1 = session.worker_pids
    # The client and rank 0 map the input and output slots; the second stage takes no input and answers nothing.
    assert len(_memfds()) >= 2 and len(_memfds(str(rank0))) >= 2 and _memfds(str(rank1)) == []
    assert not [name for name in os.listdir("/dev/shm") if "tessel" in name]
    # More requests than slots: each slot is reused only after its request was answered.
    feeds = [_feeds(seed) for seed in range(3 * session._group.window)]
    for f, outputs in zip(feeds, session.run_many(iter(feeds))):
        np.testing.assert_allclose(outputs["r3"], _expected(f["x"], mlp[1]), rtol=1e-4, atol=1e-4)


def _usage(pid) -> tuple[int, int]:
    """(open files, resident KiB) of process `pid`."""
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return len(os.listdir(f"/proc/{pid}/fd")), rss


def test_a_thousand_runs_leave_no_file_process_or_memory_behind(session):
    pids = session.worker_pids
    feeds = _feeds(0)
    for _ in range(50):
        session.run(feeds)
    before = {pid: _usage(pid) for pid in ["self", *pids]}
    for _ in range(1000):
        session.run(feeds)
    after = {pid: _usage(pid) for pid in ["self", *pids]}
    assert session.worker_pids == pids
    for pid in before:
        # "self" is the test process: files an earlier test left for the garbage collector may close meanwhile.
        assert after[pid][0] <= before[pid][0], f"open files of {pid}: {before[pid][0]} -> {after[pid][0]}"
        assert after[pid][1] - before[pid][1] < 4096, f"resident KiB of {pid}: {before[pid][1]} -> {after[pid][1]}"


def test_onnxruntime_surface(session, mlp):
    (x,), (y,) = session.get_inputs(), session.get_outputs()
    assert (x.name, x.shape, x.type) == ("x", [16, 256], "tensor(float)")
    assert (y.name, y.shape, y.type) == ("r3", [16, 256], "tensor(float)")
    feeds = _feeds(7)
    everything = session.run(None, feeds)
    named = session.run(["r3"], feeds)
    assert isinstance(everything, list) and len(everything) == 1
    np.testing.assert_array_equal(everything[0], named[0])
    with pytest.raises(InputError, match="unknown output"):
        session.run(["nope"], feeds)
    with pytest.raises(InputError):
        session.run({"x": np.zeros((3, 256), np.float32)})


def test_pipelined_requests_come_back_in_order(session, mlp):
    feeds = [_feeds(seed) for seed in range(6)]
    requests = [session.run_async(f) for f in feeds]
    for f, request in zip(feeds, requests):
        np.testing.assert_allclose(request.result(timeout=TIMEOUT_S)["r3"], _expected(f["x"], mlp[1]), rtol=1e-4, atol=1e-4)
        assert request.worker_seconds > 0
    streamed = list(session.run_many(iter(feeds)))
    for f, outputs in zip(feeds, streamed):
        np.testing.assert_allclose(outputs["r3"], _expected(f["x"], mlp[1]), rtol=1e-4, atol=1e-4)


def test_requests_over_the_slot_limit_go_over_the_pipes(mlp, monkeypatch):
    monkeypatch.setenv(SLOT_LIMIT_ENV, "0")  # no slot fits: every tensor goes over the pipes, both ways
    with InferenceSession(mlp[0], timeout=TIMEOUT_S) as piped:
        assert _memfds(str(piped.worker_pids[0])) == []
        feeds = [_feeds(seed) for seed in range(3 * piped._group.window)]
        for f, outputs in zip(feeds, piped.run_many(iter(feeds))):
            np.testing.assert_allclose(outputs["r3"], _expected(f["x"], mlp[1]), rtol=1e-4, atol=1e-4)
        (y,) = piped.run(None, feeds[0])
        np.testing.assert_allclose(y, _expected(feeds[0]["x"], mlp[1]), rtol=1e-4, atol=1e-4)


def test_pipeline_stages_send_through_shared_memory_with_the_bytes_gloo_gives(session, mlp, monkeypatch):
    from tessel.runtime.shared_p2p import SENDRECV_ENV

    from .test_shared_p2p import _memfds as p2p_memfds

    # Both stages map the transfers' segment; the client closed its descriptors once they started.
    assert all(p2p_memfds(str(pid)) for pid in session.worker_pids)
    assert not [fd for fd in p2p_memfds() if fd.startswith("/memfd:")]
    # Each ring holds every micro-batch of the requests in flight: a stage never waits for a free slot (two stages
    # waiting for each other's slots would deadlock, runtime/shared_p2p.py).
    environ = Path(f"/proc/{session.worker_pids[1]}/environ").read_bytes().split(b"\0")
    layout = json.loads(next(v for v in environ if v.startswith(b"TESSEL_SHARED_P2P=")).split(b"=", 1)[1])
    assert layout["count"] == session._group.window * 2 and len(layout["rings"]) == 2
    feeds = [_feeds(seed) for seed in range(4 * session._group.window)]
    through_shm = [outputs["r3"] for outputs in session.run_many(iter(feeds))]
    monkeypatch.setenv(SENDRECV_ENV, "gloo")
    with InferenceSession(mlp[0], timeout=TIMEOUT_S) as over_gloo:
        assert not any(p2p_memfds(str(pid)) for pid in over_gloo.worker_pids)
        for shm, outputs in zip(through_shm, over_gloo.run_many(iter(feeds))):
            assert shm.tobytes() == outputs["r3"].tobytes()


def test_a_killed_worker_fails_the_next_run_with_one_line_and_close_returns(mlp):
    mapped = len(_memfds())
    with InferenceSession(mlp[0], timeout=TIMEOUT_S) as opened:
        opened.run(_feeds(0))
        pids = opened.worker_pids
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(ExecutionError) as failed:
            opened.run(_feeds(1))
        assert time.monotonic() - started < TIMEOUT_S
        assert str(failed.value) == "rank 1: worker (pid %d) killed by SIGKILL" % pids[1]
        with pytest.raises(ExecutionError, match="killed by SIGKILL"):  # and every later run
            opened.run(_feeds(2))
        started = time.monotonic()
    assert time.monotonic() - started < 5  # leaving the with-block closed the session
    assert all(_gone(pid) for pid in pids)
    assert len(_memfds()) == mapped  # its shared-memory slots are released


EXIT_WITHOUT_CLOSE = """
import sys, time
import numpy as np
from tessel.runtime.session import InferenceSession
from tessel.runtime.shared_slots import SLOT_LIMIT_ENV
session = InferenceSession(sys.argv[1])
session.run({"x": np.zeros((16, 256), np.float32)})
print(" ".join(map(str, session.worker_pids)), flush=True)
if sys.argv[2] == "wait":
    time.sleep(600)
"""


def test_no_worker_outlives_its_client(mlp):
    endings = ("exit", "sigterm", "sigkill")
    # The three clients start together: their start-ups overlap.
    clients = {ending: subprocess.Popen([sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(mlp[0]),
                                         "exit" if ending == "exit" else "wait"],
                                        cwd=ROOT, stdout=subprocess.PIPE, text=True) for ending in endings}
    try:
        workers = {ending: [int(p) for p in client.stdout.readline().split()] for ending, client in clients.items()}
        assert all(len(pids) == 2 for pids in workers.values()), workers
        clients["sigterm"].send_signal(signal.SIGTERM)
        clients["sigkill"].send_signal(signal.SIGKILL)
        for client in clients.values():
            client.wait(timeout=STARTUP_S)
        # Closed by atexit, or killed by the SIGTERM handler at once; after SIGKILL the workers see their pipes
        # close.
        for ending, pids in workers.items():
            assert _wait_gone(pids), f"workers {pids} still run after the client's {ending}"
        assert not [name for name in os.listdir("/dev/shm") if "tessel" in name]  # the slots have no name
    finally:
        for client in clients.values():
            client.kill()
            client.wait()


SIGTERM_WHILE_POLLING = """
import os, signal, sys, time
import numpy as np
from tessel.runtime.errors import ExecutionError
from tessel.runtime.session import InferenceSession, SessionInterrupted
session = InferenceSession(sys.argv[1])
feeds = {"x": np.zeros((16, 256), np.float32)}
session.run(feeds)
print(" ".join(map(str, session.worker_pids)), flush=True)
# The lock CPython's Popen holds inside poll(), which every request calls: the signal comes in there.
with session._group.processes[0]._waitpid_lock:
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()
    except SessionInterrupted as interrupted:
        print(interrupted, flush=True)

def state(pid):
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]

deadline = time.monotonic() + 10  # killed at once, reaped only by close(): zombies meanwhile
while time.monotonic() < deadline and any(state(pid) != "Z" for pid in session.worker_pids):
    time.sleep(0.05)
print(" ".join(state(pid) for pid in session.worker_pids), flush=True)
try:
    session.run(feeds)
except ExecutionError as failed:
    print(failed, flush=True)
# The killed session counts as open no more, closed or not: the next stop signal's default action ends the process.
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
print("still running", flush=True)
"""


def test_sigterm_while_a_request_polls_the_workers_kills_them_and_fails_the_session(mlp):
    client = subprocess.Popen([sys.executable, "-c", SIGTERM_WHILE_POLLING, str(mlp[0])], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = client.communicate(timeout=STARTUP_S)
    finally:
        client.kill()
        client.wait()
    lines = out.splitlines()
    assert client.returncode == -signal.SIGTERM, (out, err)
    assert lines[1:] == ["interrupted by SIGTERM: stopped the session's workers", "Z Z",
                         "the session was interrupted by a stop signal; open a new one"], (out, err)
    assert _wait_gone([int(pid) for pid in lines[0].split()])


@pytest.fixture(scope="module")
def one_worker(kernel_cache, tmp_path_factory):
    """The same model on one worker, in 2 micro-batches (the pipeline's kernels, from the cache)."""
    model, weights = _mlp()
    artifact = compile(model, microbatches=2, profile=False, cache_dir=kernel_cache)
    return artifact.save(tmp_path_factory.mktemp("session") / "one"), weights


def test_a_single_worker_artifact_runs_in_this_process(one_worker):
    directory, weights = one_worker
    with InferenceSession(directory) as opened:
        assert opened.worker_pids == []
        feeds = _feeds(3)
        np.testing.assert_allclose(opened.run(feeds)["r3"], _expected(feeds["x"], weights), rtol=1e-4, atol=1e-4)
        assert opened.run_async(feeds).result()["r3"].shape == (16, 256)
    with pytest.raises(Exception, match="closed"):
        opened.run(feeds)


def test_bench_json_has_the_percentiles(one_worker, capsys):
    assert cli_main(["bench", str(one_worker[0]), "--iterations", "20", "--warmup", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["iterations"] == 20 and report["workers"] == 1
    assert set(report["latency_ms"]) == {"min", "mean", "p50", "p90", "p99", "max"}
    assert report["latency_ms"]["min"] <= report["latency_ms"]["p50"] <= report["latency_ms"]["max"]


@pytest.mark.parametrize("arguments", [["--iterations", "0"], ["--duration", "-1"], ["--duration", "1", "--iterations", "2"],
                                       ["--threads", "x"]])
def test_bench_refuses_bad_arguments_in_one_line(arguments, capsys):
    with pytest.raises(SystemExit) as done:
        cli_main(["bench", "somewhere", *arguments])
    assert done.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
