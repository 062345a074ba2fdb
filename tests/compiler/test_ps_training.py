"""Parameter-server training (compiler/ps_training.py, compiler/ps_*.py): shards balanced by bytes, the server's
update program, synchronous PS equal to one device on the whole batch, and a killed rank named in one line."""
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
from tessel.compiler.options import CompileError
from tessel.compiler.ps_server import Server
from tessel.compiler.ps_training import build_server_graph, prepare_job, shard_parameters
from tessel.compiler.train_checkpoints import mid_epoch_steps
from tessel.compiler.train_data import Dataset
from tessel.runtime.ps_compression import ErrorFeedback, make_codec
from tessel.runtime.ps_job import DONE, PUSH, PSJob
from tessel.compiler.ps_launch import PSFailure, run_job
from tests.compiler.train_fixtures import assert_resume_refused

STEPS, BATCH = 8, 16


def test_shards_are_balanced_by_bytes_largest_first():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 10}
    assert shard_parameters(sizes, 2) == [["a", "d"], ["b", "c"]]  # 110 bytes each
    assert shard_parameters(sizes, 1) == [["a", "b", "c", "d"]]
    with pytest.raises(CompileError, match="a server would hold nothing"):
        shard_parameters(sizes, 5)


def test_a_server_program_is_the_optimizer_update_of_its_shard():
    graph, state, scalars = build_server_graph({"w": np.ones((2, 3), np.float32)},
                                               tessel.optim.SGD(lr=0.1, momentum=0.9))
    assert [v.name for v in graph.inputs] == ["w", "w__grad", "optim.lr", "w.momentum"]
    assert [n.op_type for n in graph.nodes] == ["SGDUpdate"]
    assert set(state.initial) == {"w", "w.momentum"} and set(state.updates) == {"w", "w.momentum"}
    assert scalars == ["optim.lr"]


def test_a_job_with_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be one of sync, async, ssp"):
        PSJob(workers=1, servers=1, mode="bsp", staleness=0, steps=1, batch=1, seed=0, compression="none",
              topk_ratio=0.01, optimizer={}, data_inputs=[], label_input=None, loss_output="loss", model_outputs=[],
              parameters=[], gradients={}, shards=[], scalars=[], eval_inputs=[])


@pytest.fixture(scope="module")
def mlp_job(tmp_path_factory, kernel_cache):
    spec = SPECS["mlp"]
    root = tmp_path_factory.mktemp("ps")
    path = export(spec.model(0), spec.input_shape, root / "mlp.onnx")
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((48, 32)).astype(np.float32),
            "labels": rng.standard_normal((48, 4)).astype(np.float32)}
    optimizer = tessel.optim.SGD(lr=0.05, momentum=0.9)
    job = prepare_job(str(path), "mse", optimizer, data, root / "job", workers=2, servers=1, batch=BATCH,
                      steps=STEPS, cache_dir=kernel_cache)
    return path, data, optimizer, root / "job", job


@pytest.fixture(scope="module")
def standalone(mlp_job, tmp_path_factory):
    """The sync job with standalone servers, writing a checkpoint every 3 steps and after the last, stopped after
    6 steps (as tessel train --max-steps 6) and resumed from that final checkpoint to the end: (the resumed job's
    result, its run directory, the stopped job's result)."""
    directory, job = mlp_job[3], mlp_job[4]
    run_dir = tmp_path_factory.mktemp("ps_run")
    try:
        replace(job, run_dir=str(run_dir), checkpoint_every=3, steps=6).write(directory)
        stopped = run_job(directory)
        assert mid_epoch_steps(run_dir) == [6]
        replace(job, run_dir=str(run_dir), checkpoint_every=3, start=6).write(directory)
        return run_job(directory), run_dir, stopped
    finally:
        job.write(directory)


def test_synchronous_ps_trains_like_one_device_on_the_whole_batch(mlp_job, standalone, kernel_cache):
    path, data, optimizer, directory, job = mlp_job
    result = standalone[0]
    single = tessel.compile_training(str(path), loss="mse", optimizer=optimizer, input_shapes={"x": (BATCH, 32)},
                                     cache_dir=kernel_cache)
    batches = Dataset(data, 48)
    order = [batch for epoch in range(3) for batch in batches.batches(BATCH, 0, epoch)][:STEPS]
    losses = [single.step({"x": batch["x"]}, batch["labels"]) for batch in order]
    # Each worker's loss is on its half of the batch; their mean is the whole batch's loss.
    halves = np.mean([report["losses"] for report in result.reports], axis=0)
    np.testing.assert_allclose(halves, losses, rtol=1e-5)
    single_state = single.state
    for name in job.parameters:
        np.testing.assert_allclose(result.parameters[name], single_state[name], atol=1e-6, err_msg=name)
        np.testing.assert_allclose(result.slots[name + ".momentum"], single_state[name + ".momentum"], atol=1e-6)
    assert all(report["bytes_pushed"] > 4 * STEPS * sum(map(np.prod, job.shapes.values())) for report in result.reports)


def test_a_job_resumed_from_its_newest_checkpoint_goes_on_where_it_stopped(standalone):
    # That it ends with the uninterrupted job's weights: the test above (against one device) and, bit for bit,
    # tests/compiler/test_ps_checkpoint.py.
    resumed, run_dir, stopped = standalone
    assert mid_epoch_steps(run_dir) == [STEPS]  # the final checkpoint; the older ones removed
    for before, after in zip(stopped.reports, resumed.reports):
        assert len(after["losses"]) == STEPS and after["losses"][:6] == before["losses"]


def test_resuming_a_finished_job_is_refused_in_one_line(mlp_job, standalone):
    assert_resume_refused(mlp_job[3], standalone[1], STEPS)


def test_colocated_servers_train_as_standalone_ones(mlp_job, standalone):
    directory, job = mlp_job[3], mlp_job[4]
    replace(job, layout="colocated").write(directory)
    try:
        colocated = run_job(directory)
    finally:
        job.write(directory)
    for name, value in standalone[0].parameters.items():
        np.testing.assert_allclose(colocated.parameters[name], value, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(colocated.reports[0]["losses"], standalone[0].reports[0]["losses"], rtol=1e-5)
    # Worker 0's messages to the server in its own process cross no link.
    assert colocated.reports[0]["bytes_pushed"] == 0 < colocated.reports[1]["bytes_pushed"]


def test_a_killed_server_stops_every_rank_and_is_named_in_one_line(mlp_job, tmp_path):
    directory, job = mlp_job[3], mlp_job[4]
    job.steps = 10 ** 7  # runs until killed
    job.write(directory)
    failure: list[BaseException] = []
    runner = threading.Thread(target=lambda: _run_catching(directory, failure))
    runner.start()
    server = _child("tessel-ps server 0")
    time.sleep(1.0)
    server.kill()
    runner.join(timeout=60)
    assert not runner.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], PSFailure)
    message = str(failure[0])
    assert "\n" not in message and "server 0 (rank 2" in message and "killed by SIGKILL" in message, message
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("tessel-ps")]


def _run_catching(directory: Path, failure: list) -> None:
    try:
        run_job(directory, timeout_s=60)
    except PSFailure as exc:
        failure.append(exc)


def _child(name: str):
    for _ in range(200):
        found = [p for p in multiprocessing.active_children() if p.name == name]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no process {name!r} started")

@pytest.mark.parametrize("compression", ["none", "1bit"])
def test_a_synchronous_server_ends_with_the_same_weights_whatever_order_pushes_arrive_in(mlp_job, compression):
    # 4 workers (the server program does not depend on their number): two floats add up the same in either order.
    directory, job = mlp_job[3], replace(mlp_job[4], compression=compression, workers=4)
    size = sum(job.sizes(0))
    rng = np.random.default_rng(0)
    # Gradients of very different magnitudes per worker, so that float32 sums in arrival order would differ.
    scales = 10.0 ** np.array([4, -3, -4, -3])  # the small ones near half a unit in the last place of the big
    gradients = [[(rng.standard_normal(size) * scale).astype(np.float32) for scale in scales] for _ in range(4)]
    encoders = [ErrorFeedback(make_codec(compression, job.segments(0)), size) for _ in range(job.workers)]
    pushes = [[(w, PUSH, clock, encoders[w].encode(g)) for w, g in enumerate(clock_gradients)]
              for clock, clock_gradients in enumerate(gradients)]
    decoded = [encoders[0].codec.decode(message, size) for *_, message in pushes[0]]
    assert not np.array_equal(sum(decoded, np.zeros(size, np.float32)), sum(decoded[::-1], np.zeros(size, np.float32)))
    states = []
    for reverse in (False, True):
        inbox = [message for clock in pushes for message in (clock[::-1] if reverse else clock)]
        inbox += [(w, DONE, 0, None) for w in range(job.workers)]
        server = Server(job, directory, 0, wire=None)  # answers no pull: needs no wire
        server.serve(type("Inbox", (), {"get": lambda self: inbox.pop(0)})())
        assert server.updates == len(gradients)
        states.append(server.state())
    for name, value in states[0].items():
        np.testing.assert_array_equal(states[1][name], value, err_msg=name)


@pytest.mark.slow
def test_synchronous_ps_on_four_workers_ends_with_the_weights_of_all_reduce(tmp_path, kernel_cache):
    from bench.ps_digits import compare_dp, digits

    model, train, _ = digits(tmp_path)
    assert compare_dp(model, train, workers=4, servers=2, steps=20, cache=str(kernel_cache)) < 1e-5
