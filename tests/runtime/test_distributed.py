"""Multi-device runs on local workers (gloo): every corpus model, failure handling, micro-batches, torchrun."""
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

from tessel.compiler.api import compile
from tessel.runtime.errors import PEER_PREFIX
from tessel.runtime.instructions import Gather, KernelCall, Scatter, program_from_json
from tessel.runtime.launch import free_port, run_local, run_local_many
from tests.conftest import POSITIVE, assert_matches_onnxruntime, run_onnxruntime

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _isolated_profiles(tessel_cache, monkeypatch):
    # Profiles and link calibrations go into the session's cache root, not into ~/.cache.
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tessel_cache))


# Four workers on two cores take minutes per planner: `pytest -m slow` runs them; two workers cover each planner here.
@pytest.mark.parametrize("workers,placement", [(2, "pipeline"), (2, "list"),
                                               pytest.param(4, "pipeline", marks=pytest.mark.slow),
                                               pytest.param(4, "list", marks=pytest.mark.slow)])
def test_every_corpus_model_on_local_workers_matches_onnxruntime(workers, placement, kernel_cache):
    artifacts, feeds = [], []
    for model in POSITIVE:
        # Estimated node times (no profiling) keep this test fast; placement still splits every model.
        artifacts.append(compile(model.path, input_shapes=model.input_shapes, devices=workers, placement=placement,
                                 cache_dir=kernel_cache, profile=False))
        feeds.append(model.make_inputs())
    # One launch runs every model in turn (worker startup is paid once).
    results = run_local_many([a.directory for a in artifacts], workers, feeds, timeout=120)
    for model, (outputs, _), inputs in zip(POSITIVE, results, feeds):
        assert_matches_onnxruntime(outputs, run_onnxruntime(str(model.path), inputs))
    used = [a.report()["placement"]["transfer_bytes"] > 0 for a in artifacts]
    assert sum(used) >= len(POSITIVE) // 2, "most models should actually be split across the workers"


def _resnet():
    return next(m for m in POSITIVE if m.name == "resnet18")


def test_micro_batches_pipeline_through_two_workers(kernel_cache):
    model = _resnet()
    artifact = compile(model.path, batch=8, devices=2, placement="pipeline", microbatches=4, cache_dir=kernel_cache)
    assert artifact.microbatches == 4 and artifact.devices == 2
    feeds = {"input": np.random.default_rng(0).standard_normal((8, 3, 224, 224)).astype(np.float32)}
    import onnx

    from tessel.ir.onnx_import import with_batch

    batched = with_batch(onnx.load(str(model.path)), 8)
    assert_matches_onnxruntime(artifact.run(feeds), run_onnxruntime(batched, feeds))


@pytest.mark.parametrize("placement", ["data", "hybrid"])
def test_data_and_hybrid_placement_split_the_batch_across_workers(placement, kernel_cache):
    model = _resnet()
    artifact = compile(model.path, batch=8, devices=2, placement=placement, cache_dir=kernel_cache, profile=False)
    assert artifact.devices == 2
    doc = json.loads((artifact.directory / "reports" / "placement.json").read_text())
    assert doc["planner"] == placement and {(t["from"], t["to"]) for t in doc["transfers"]} == {(0, 1), (1, 0)}
    everywhere = [n["device"] == "all" for n in doc["nodes"].values()]
    kinds = [[type(i) for i in program_from_json(worker["instructions"])] for worker in artifact.plan["workers"]]
    # Each worker scatters (worker 0) or receives its slice first and gathers; with hybrid, worker 0 then runs
    # the tail alone.
    assert all(k[0] is Scatter and Gather in k for k in kinds)
    if placement == "data":
        assert all(everywhere) and kinds[0] == kinds[1]
    else:
        assert any(everywhere) and not all(everywhere) and kinds[0][-1] is KernelCall and kinds[1][-1] is Gather
    feeds = {"input": np.random.default_rng(1).standard_normal((8, 3, 224, 224)).astype(np.float32)}
    import onnx

    from tessel.ir.onnx_import import with_batch

    batched = with_batch(onnx.load(str(model.path)), 8)
    assert_matches_onnxruntime(artifact.run(feeds), run_onnxruntime(batched, feeds))


def _pids_alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def test_a_killed_worker_stops_the_others_with_a_clear_message(kernel_cache, tmp_path):
    model = _resnet()
    artifact = compile(model.path, input_shapes=model.input_shapes, devices=2, placement="pipeline", cache_dir=kernel_cache)
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TESSEL_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "tessel.runtime.worker", str(artifact.directory), "--repeat", "100000",
                                       "--timeout", "10"], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    try:
        time.sleep(8)  # both workers are now deep in their runs
        assert all(p.poll() is None for p in procs)
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = procs[0].communicate(timeout=30)
        waited = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert procs[0].returncode != 0 and waited <= 10 + 5
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(PEER_PREFIX + "rank 0:") and "rank 1" in lines[0], err
    assert "tensor '" in lines[0]
    assert _pids_alive([p.pid for p in procs]) == []


def test_launch_leaves_no_process_behind_when_a_worker_fails(kernel_cache, tmp_path):
    model = _resnet()
    artifact = compile(model.path, input_shapes=model.input_shapes, devices=2, placement="pipeline", cache_dir=kernel_cache)
    from tessel.runtime.errors import InputError

    with pytest.raises(InputError):
        artifact.run({"input": np.zeros((1, 3, 2, 2), np.float32)})
    before = subprocess.run(["pgrep", "-f", "tessel.runtime.worker"], capture_output=True, text=True).stdout.split()
    outputs, times = run_local(artifact.directory, 2, model.make_inputs(), repeat=1)
    assert times["runs"] == 1 and times["seconds_per_batch"] > 0 and set(outputs) == {"output"}
    after = subprocess.run(["pgrep", "-f", "tessel.runtime.worker"], capture_output=True, text=True).stdout.split()
    assert set(after) <= set(before)


def test_torchrun_runs_the_worker_module(kernel_cache, tmp_path):
    model = next(m for m in POSITIVE if m.name == "mtcnn_onet")
    artifact = compile(model.path, input_shapes=model.input_shapes, devices=2, placement="list", cache_dir=kernel_cache)
    inputs = model.make_inputs()
    np.savez(tmp_path / "in.npz", **inputs)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               "-m", "tessel.runtime.worker", str(artifact.directory), "--inputs", str(tmp_path / "in.npz"),
               "--outputs", str(tmp_path / "out.npz")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with np.load(tmp_path / "out.npz") as data:
        outputs = {name: data[name] for name in data.files}
    assert_matches_onnxruntime(outputs, run_onnxruntime(str(model.path), inputs))


def test_cli_compiles_runs_and_reports_on_two_workers(kernel_cache, tmp_path):
    model = next(m for m in POSITIVE if m.name == "mtcnn_rnet")
    out = tmp_path / "rnet2"
    shape = "x".join(map(str, model.input_shapes["input_2"]))

    def tessel(*args):
        return subprocess.run([sys.executable, "-m", "tessel.compiler.cli", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=600)

    machine = tmp_path / "machine.json"
    machine.write_text('{"devices": 2, "memory": "1GiB", "link": {"alpha_s": 5e-5, "beta_s_per_byte": 1e-9}}')
    compiled = tessel("compile", str(model.path), "-o", str(out), "--input-shape", f"input_2={shape}",
                      "--machine", str(machine), "--placement", "list")
    assert compiled.returncode == 0, compiled.stderr
    assert "placement list on 2 devices" in compiled.stdout
    ran = tessel("run", str(out), "--check", "--repeat", "2")
    assert ran.returncode == 0 and "check: ok" in ran.stdout and "placement predicted" in ran.stdout, ran.stderr
    wrong = tessel("run", str(out), "--workers", "3")
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1 and "--workers 2" in wrong.stderr
    report = tessel("report", str(out))
    assert report.returncode == 0 and "# Placement" in report.stdout and "# Memory" in report.stdout
    # The run's measured times and the prediction error are in the report now.
    assert "## Measured" in report.stdout and "prediction error" in report.stdout
    assert json.loads((out / "reports" / "placement.json").read_text())["measured"]["runs"] == 2
    assert (out / "reports" / "placement_gantt.png").read_bytes()[:4] == b"\x89PNG"
