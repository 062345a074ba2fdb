"""Momentum correction (compiler/ps_momentum.py): the workers' momentum against a numpy reference of
torch.optim.SGD, DGC's momentum factor masking with top-k, the servers' optimizer and the checkpointed buffers
(the jobs that use it: tests/compiler/test_ps_checkpoint.py, slow)."""
from __future__ import annotations

import numpy as np
import pytest

import tessel
from tessel.compiler.options import CompileError
from tessel.compiler.ps_checkpoint import read_worker, write_worker
from tessel.compiler.ps_momentum import WorkerMomentum, corrects_momentum, server_optimizer
from tessel.runtime.ps_compression import ErrorFeedback, make_codec

WORKERS, SIZE, STEPS, LR = 3, 50, 6, 0.1


def reference_sgd(weights, mean_gradients, momentum, dampening, nesterov, weight_decay):
    """torch.optim.SGD on one device, in float64: the weights after each mean gradient."""
    weights, buffer = weights.astype(np.float64), None
    for gradient in mean_gradients:
        d = gradient + weight_decay * weights
        buffer = d.copy() if buffer is None else momentum * buffer + (1 - dampening) * d
        weights = weights - LR * (d + momentum * buffer if nesterov else buffer)
    return weights


@pytest.mark.parametrize("settings", [{"momentum": 0.9},
                                      {"momentum": 0.9, "dampening": 0.5, "weight_decay": 0.01},
                                      {"momentum": 0.8, "nesterov": True, "weight_decay": 0.1}])
def test_workers_momenta_and_plain_sgd_on_the_servers_make_torch_sgd(settings):
    # Uncompressed, the mean of the workers' pushes applied by plain SGD is SGD with momentum on the mean gradient.
    optimizer = tessel.optim.SGD(lr=LR, **settings)
    rng = np.random.default_rng(0)
    start = rng.standard_normal(SIZE).astype(np.float32)
    gradients = rng.standard_normal((STEPS, WORKERS, SIZE)).astype(np.float32)
    workers = [WorkerMomentum(optimizer, [SIZE]) for _ in range(WORKERS)]
    weights = start.copy()
    for step, step_gradients in enumerate(gradients):
        pushes = [worker.step(0, gradient.copy(), weights, first=step == 0)
                  for worker, gradient in zip(workers, step_gradients)]
        weights = weights - np.float32(LR) * np.mean(pushes, axis=0)
    expected = reference_sgd(start, gradients.astype(np.float64).mean(axis=1), settings["momentum"],
                             settings.get("dampening", 0.0), settings.get("nesterov", False),
                             settings.get("weight_decay", 0.0))
    np.testing.assert_allclose(weights, expected, rtol=1e-5, atol=1e-5)


def test_a_worker_pushes_its_momentum_buffer_as_dgc_keeps_it():
    # DGC's u <- m * u + g, bit for bit in float32, one buffer per shard; the push is a copy the buffer's next
    # step leaves alone (a colocated server may decode it later).
    optimizer = tessel.optim.SGD(lr=LR, momentum=0.9)
    rng = np.random.default_rng(1)
    worker = WorkerMomentum(optimizer, [SIZE, 7])
    u = np.zeros(SIZE, np.float32)
    pushes = []
    for step in range(STEPS):
        g = rng.standard_normal(SIZE).astype(np.float32)
        u = np.float32(0.9) * u + g
        pushes.append((worker.step(0, g.copy(), np.zeros(SIZE, np.float32), first=step == 0), u.copy()))
    for pushed, expected in pushes:
        np.testing.assert_array_equal(pushed, expected)
    np.testing.assert_array_equal(worker.buffers[1], np.zeros(7, np.float32))


def test_top_k_clears_the_momentum_of_the_elements_it_sent():
    optimizer = tessel.optim.SGD(lr=LR, momentum=0.9)
    worker = WorkerMomentum(optimizer, [SIZE])
    pusher = ErrorFeedback(make_codec("topk", [SIZE], topk_ratio=0.1), SIZE)
    gradient = np.random.default_rng(2).standard_normal(SIZE).astype(np.float32)
    message = pusher.encode(worker.step(0, gradient.copy(), np.zeros(SIZE, np.float32), first=True))
    sent = pusher.codec.sent(message)
    worker.mask(0, sent)
    assert sent.size == 5 and set(sent) == set(np.argsort(-np.abs(gradient))[:5])
    kept = np.setdiff1d(np.arange(SIZE), sent)
    np.testing.assert_array_equal(worker.buffers[0][sent], 0)
    np.testing.assert_array_equal(worker.buffers[0][kept], gradient[kept])


def test_the_servers_keep_only_the_learning_rate_and_its_schedule():
    optimizer = tessel.optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01,
                                 schedule=tessel.optim.step(5, gamma=0.5))
    server = server_optimizer(optimizer)
    assert (server.momentum, server.nesterov, server.weight_decay) == (0.0, False, 0.0)
    assert [server.lr_at(step) for step in range(12)] == [optimizer.lr_at(step) for step in range(12)]
    assert corrects_momentum(optimizer) and not corrects_momentum(server)
    with pytest.raises(CompileError, match="AdamW with momentum None has none to move"):
        server_optimizer(tessel.optim.AdamW())


def test_a_workers_checkpoint_part_keeps_its_momentum_buffers(tmp_path):
    vectors = [np.arange(4, dtype=np.float32) + k for k in range(6)]
    write_worker(tmp_path, 1, vectors[:2], vectors[2:4], vectors[4:], {"bn": vectors[0]}, {"losses": [1.0]})
    weights, residuals, momenta, statistics, report = read_worker(tmp_path, 1, 2)
    for got, expected in zip(weights + residuals + momenta, vectors):
        np.testing.assert_array_equal(got, expected)
    assert report == {"losses": [1.0]} and list(statistics) == ["bn"]
    write_worker(tmp_path, 0, vectors[:2], vectors[2:4], [], {}, {})  # no momentum correction: no buffers
    assert read_worker(tmp_path, 0, 2)[2] == []


@pytest.mark.slow  # a compile and a job: about 20 s on the shared 2-core machine
def test_an_uncompressed_job_with_momentum_correction_trains_like_one_device(tmp_path, kernel_cache):
    from bench.training_models import SPECS, export
    from tessel.compiler.ps_launch import run_job
    from tessel.compiler.ps_training import prepare_job
    from tessel.compiler.train_data import Dataset

    spec, batch, steps = SPECS["mlp"], 16, 8
    path = export(spec.model(0), spec.input_shape, tmp_path / "mlp.onnx")
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((48, 32)).astype(np.float32),
            "labels": rng.standard_normal((48, 4)).astype(np.float32)}
    optimizer = tessel.optim.SGD(lr=0.05, momentum=0.9, weight_decay=0.01)
    job = prepare_job(str(path), "mse", optimizer, data, tmp_path / "job", workers=2, servers=1, batch=batch,
                      steps=steps, momentum_correction=True, cache_dir=kernel_cache)
    result = run_job(tmp_path / "job")
    assert not result.slots  # the server keeps no momentum
    single = tessel.compile_training(str(path), loss="mse", optimizer=optimizer, input_shapes={"x": (batch, 32)},
                                     cache_dir=kernel_cache)
    order = [b for epoch in range(3) for b in Dataset(data, 48).batches(batch, 0, epoch)][:steps]
    for b in order:
        single.step({"x": b["x"]}, b["labels"])
    state = single.state
    for name in job.parameters:
        np.testing.assert_allclose(result.parameters[name], state[name], atol=1e-6, err_msg=name)
