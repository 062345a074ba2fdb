"""Data-parallel training (compiler/dp_training.py): compile_training(devices=N) on N local workers trains like
one device on the whole batch (the MLP of bench/training_models.py, no BatchNormalization; CNNs with
BatchNormalization under sync_batchnorm); per-replica BN statistics as PyTorch DDP; the replica step's AllReduce
nodes; what is refused."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import tessel
from bench.training_models import SPECS, export
from tessel.compiler.options import CompileError
from tessel.compiler.step_timeline import ALLREDUCE, FORWARD, forward_loss, replica_phases
from tessel.compiler.training import build_step_graph
from tessel.ir.schema import TESSEL_DOMAIN
from tessel.ir.interpret import interpret
from tessel.passes.collectives import allreduce_halving_doubling, allreduce_ring
from tessel.passes.data_parallel import (DEFAULT_BUCKET_BYTES, MAX_BUCKET_BYTES, MIN_BUCKET_BYTES, bucket_bytes_for,
                                         choose_allreduce)
from tessel.passes.machine import Link
from tessel.runtime.instructions import program_from_json
from tests.passes.test_sync_batchnorm import conv_bn_model, input_batch

STEPS = 20


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    spec = SPECS["mlp"]
    path = export(spec.model(0), spec.input_shape, tmp_path_factory.mktemp("dp") / "mlp.onnx")
    rng = np.random.default_rng(0)
    return spec, path, [spec.batch(rng) for _ in range(STEPS)]


def _compile(spec, path, kernel_cache, **options):
    return tessel.compile_training(str(path), loss=spec.loss, optimizer=tessel.optim.SGD(lr=0.05, momentum=0.9),
                                   input_shapes={"x": spec.input_shape}, cache_dir=kernel_cache, **options)


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-12))


def test_two_workers_train_like_one_device_on_the_whole_batch(mlp, kernel_cache, tmp_path):
    spec, path, batches = mlp
    single = _compile(spec, path, kernel_cache)
    # 10 kB buckets: the MLP's gradients make buckets of one and of several.
    parallel = _compile(spec, path, kernel_cache, devices=2, placement="data", bucket_bytes=10_000)
    try:
        assert parallel.workers == 2
        # The forward pass ends at the replica's own loss (recorded in the plan), not at its mean, which comes back
        # with the last bucket after the backward pass.
        plan = parallel.step_artifact.plan
        phases = replica_phases(program_from_json(plan["workers"][0]["instructions"]), forward_loss(plan))
        assert FORWARD in phases and max(k for k, p in enumerate(phases) if p == FORWARD) < phases.index(ALLREDUCE)
        # Every all-reduce (each bucket, the loss riding in the last) is costed by algorithm; gloo's own runs.
        report = (parallel.step_artifact.directory / "reports" / "data_parallel.md").read_text()
        assert report.count("-> gloo") >= 2 and "ring" in report and "halving_doubling" in report
        # The host's share of a step (what a prediction adds to the programs): measured on real steps, after which
        # training goes on as if they had not run (the comparison below).
        assert parallel.host_s(3) > 0 and single.host_s(3) == 0.0 and parallel.steps_done == 0
        for x, labels in batches:
            want, got = single.step({"x": x}, labels), parallel.step({"x": x}, labels)
            assert got == pytest.approx(want, rel=1e-4)
        want_state, got_state = single.state, parallel.state
        assert set(got_state) == set(want_state)
        for name, value in want_state.items():
            assert _relative(got_state[name], value) < 1e-4, name
        # The checkpoint holds rank 0's state; evaluate runs the whole batch on it.
        saved = parallel.save(tmp_path / "checkpoint")
        with np.load(saved / "state.npz") as stored:
            assert all(np.array_equal(stored[name], got_state[name]) for name in got_state)
        x = batches[0][0]
        np.testing.assert_allclose(parallel.evaluate({"x": x})["y"], single.evaluate({"x": x})["y"], rtol=1e-4,
                                   atol=1e-5)
    finally:
        parallel.close()


def _all_reduces(step) -> list[int]:
    return [k for k, node in enumerate(step.graph.nodes) if node.domain == TESSEL_DOMAIN and node.op_type == "AllReduce"]


def test_a_replica_step_averages_each_gradient_right_after_it_is_computed(mlp):
    spec, path, _ = mlp
    step = build_step_graph(str(path), {"x": spec.input_shape}, spec.loss, tessel.optim.SGD(lr=0.1), replicas=2,
                            bucket_bytes=1)
    nodes, reduces = step.graph.nodes, _all_reduces(step)
    assert len(reduces) == len(step.parameters) + 1  # every gradient and the loss
    # The loss's mean is read only when the step ends. The last bucket holds one gradient, all-reduced where it
    # lies (the loss riding in it would copy the gradient there and back): the loss is issued just before it.
    loss = next(k for k in reduces if nodes[k].inputs[0].name.startswith("loss"))
    assert loss == reduces[-2] and all(nodes[k].attrs["reduction"] == "mean" for k in reduces)
    for k in reduces:
        if k == loss:
            continue
        node = nodes[k]
        producer = node.inputs[0].producer
        # Issued as soon as its value exists: right after its producer (or after an earlier AllReduce there).
        assert all(nodes[j].op_type == "AllReduce" for j in range(nodes.index(producer) + 1, k))


def test_recompute_and_the_step_phases_see_the_forward_pass_end_at_the_replicas_own_loss(mlp):
    spec, path, _ = mlp
    step = build_step_graph(str(path), {"x": spec.input_shape}, spec.loss, tessel.optim.SGD(lr=0.1), replicas=2)
    nodes = step.graph.nodes
    assert nodes.index(step.graph.lookup(step.forward_loss).producer) < min(_all_reduces(step))
    assert forward_loss({"replica_loss": "mine", "workers": [{"outputs": ["loss"]}]}) == "mine"
    assert forward_loss({"workers": [{"outputs": ["loss"]}]}) == "loss"  # an artifact from before the field


def test_a_loss_that_is_a_model_output_of_shape_1_trains_on_two_workers_as_on_one(tmp_path, kernel_cache):
    """The model's own output is the loss, of shape [1]: made a scalar (a Reshape), then flattened into the last
    bucket (another), a chain of views the compile collapses. The forward pass must still end at the replica's loss."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((3, 2)).astype(np.float32), "W"),
               numpy_helper.from_array(rng.standard_normal(2).astype(np.float32), "b"),
               numpy_helper.from_array(np.array([1], np.int64), "one")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"]),
             helper.make_node("Mul", ["y", "y"], ["squares"]),
             helper.make_node("ReduceMean", ["squares"], ["mean"], keepdims=1), helper.make_node("Reshape", ["mean", "one"], ["l"])]
    graph = helper.make_graph(nodes, "output_loss", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
                              [helper.make_tensor_value_info("l", TensorProto.FLOAT, [1])], weights)
    path = tmp_path / "output_loss.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    options = {"loss": "l", "optimizer": tessel.optim.SGD(lr=0.05), "input_shapes": {"x": [4, 3]},
               "cache_dir": kernel_cache}
    single = tessel.compile_training(str(path), **options)
    parallel = tessel.compile_training(str(path), devices=2, placement="data", **options)
    try:
        assert parallel.step_artifact.plan["replica_loss"] == "mean"  # what the views of the loss reshape
        for _ in range(3):
            x = rng.standard_normal((4, 3)).astype(np.float32)
            assert parallel.step({"x": x}) == pytest.approx(single.step({"x": x}), rel=1e-5)
        got_state = parallel.state
    finally:
        parallel.close()
    for name, value in single.state.items():
        assert _relative(got_state[name], value) < 1e-5, name


def test_gradients_share_a_bucket_up_to_its_size(mlp):
    spec, path, _ = mlp
    step = build_step_graph(str(path), {"x": spec.input_shape}, spec.loss, tessel.optim.SGD(lr=0.1), replicas=2)
    nodes, reduces = step.graph.nodes, _all_reduces(step)
    assert len(reduces) == 1  # the MLP's 27 KB of gradients in one bucket, the loss with them
    bucket = nodes[reduces[0]].inputs[0].producer
    assert bucket.op_type == "Concat" and len(bucket.inputs) == len(step.parameters) + 1
    # The bucket is split back only after the last backward node, just before the updates.
    split = next(k for k, node in enumerate(nodes) if node.op_type == "Split")
    backward = [k for k, node in enumerate(nodes) if node.name.endswith(("_grad", "_grad_1", "_grad_2"))]
    assert split > max(backward)


def test_the_bucket_size_keeps_the_link_latency_a_tenth_of_a_bucket_all_reduce():
    assert bucket_bytes_for(None) == DEFAULT_BUCKET_BYTES
    # 100 µs latency, 1 GB/s: 900 kB take 900 µs, the latency a tenth of the whole.
    assert bucket_bytes_for(Link(alpha=1e-4, beta=1e-9)) == 900_000
    assert bucket_bytes_for(Link(alpha=1e-9, beta=1e-9)) == MIN_BUCKET_BYTES
    assert bucket_bytes_for(Link(alpha=1.0, beta=1e-9)) == MAX_BUCKET_BYTES


def test_each_all_reduce_algorithm_is_costed_and_auto_runs_the_cheapest_executed():
    link, size = Link(alpha=1e-5, beta=1e-9), 4 << 20
    choice = choose_allreduce(link, 4, size)
    assert choice.costs == {"ring": allreduce_ring(link, 4, size), "halving_doubling":
                            allreduce_halving_doubling(link, 4, size), "gloo": allreduce_ring(link, 4, size)}
    assert choice.algorithm == "gloo" and "-> gloo" in choice.describe()
    with pytest.raises(ValueError, match="costed but not executed"):
        choose_allreduce(link, 4, size, "ring")
    with pytest.raises(ValueError, match="unknown all-reduce algorithm 'tree'"):
        choose_allreduce(link, 4, size, "tree")


@pytest.mark.parametrize("options, problem", [
    ({"devices": 2, "placement": "pipeline"}, "runs data-parallel only"),
    ({"devices": 3, "placement": "data"}, "not a multiple of 3"),
    ({"devices": 2, "placement": "data", "allreduce": "halving_doubling"}, "costed but not executed"),
])
def test_unsupported_data_parallel_training_is_refused(mlp, kernel_cache, options, problem):
    spec, path, _ = mlp
    with pytest.raises(CompileError, match=problem):
        _compile(spec, path, kernel_cache, **options)


# About a minute on two cores (four worker processes started twice, AdamW's kernels): `pytest -m slow`.
@pytest.mark.slow
def test_four_workers_with_adamw_resume_from_a_checkpoint_as_if_never_stopped(mlp, kernel_cache, tmp_path):
    spec, path, batches = mlp
    optimizer = tessel.optim.AdamW(lr=0.01)
    single = tessel.compile_training(str(path), loss=spec.loss, optimizer=optimizer,
                                     input_shapes={"x": spec.input_shape}, cache_dir=kernel_cache)
    parallel = tessel.compile_training(str(path), loss=spec.loss, optimizer=optimizer,
                                       input_shapes={"x": spec.input_shape}, cache_dir=kernel_cache, devices=4)
    try:
        for x, labels in batches[:3]:
            parallel.step({"x": x}, labels)
        parallel.save(tmp_path / "checkpoint")
        uninterrupted = [parallel.step({"x": x}, labels) for x, labels in batches[3:6]]
        want_state = parallel.state
    finally:
        parallel.close()
    resumed = tessel.load_training(tmp_path / "checkpoint")
    try:
        assert resumed.workers == 4
        assert [resumed.step({"x": x}, labels) for x, labels in batches[3:6]] == uninterrupted
        got_state = resumed.state
    finally:
        resumed.close()
    for x, labels in batches[:6]:
        single.step({"x": x}, labels)
    for name, value in single.state.items():
        assert np.array_equal(got_state[name], want_state[name]), name
        assert _relative(got_state[name], value) < 1e-4, name


# Compiles the CNN's gradient kernels (shared with test_training_torch.py's cnn_bn at batch 8 in one session).
@pytest.mark.slow
def test_batchnorm_statistics_are_per_replica_as_pytorch_ddp_without_syncbatchnorm(tmp_path, kernel_cache):
    """With BatchNormalization the replicas normalise with their own slice's statistics: not one device on the
    whole batch, but PyTorch on each half with the losses averaged (DistributedDataParallel without
    SyncBatchNorm)."""
    torch = pytest.importorskip("torch")
    from bench.training_models import torch_loss

    spec = SPECS["cnn_bn"]
    shape = (16, *spec.input_shape[1:])
    model = spec.model(0)
    path = export(model, shape, tmp_path / "cnn.onnx")
    rng = np.random.default_rng(0)
    batches = [type(spec)(spec.name, spec.build, shape, spec.loss, spec.outputs).batch(rng) for _ in range(5)]
    parallel = tessel.compile_training(str(path), loss=spec.loss, optimizer=tessel.optim.SGD(lr=0.05, momentum=0.9),
                                       input_shapes={"x": shape}, cache_dir=kernel_cache, devices=2)
    model.train()
    reference = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    try:
        for x, labels in batches:
            got = parallel.step({"x": x}, labels)
            reference.zero_grad()
            halves = [torch_loss(spec.loss, model(torch.from_numpy(x[k * 8:(k + 1) * 8])),
                                 torch.from_numpy(labels[k * 8:(k + 1) * 8])) for k in range(2)]
            loss = (halves[0] + halves[1]) / 2
            loss.backward()
            reference.step()
            assert got == pytest.approx(float(loss.detach()), rel=1e-4)
        state = parallel.state
    finally:
        parallel.close()
    parameters = dict(model.named_parameters())
    assert set(parameters) <= set(state)
    for name, value in parameters.items():
        assert _relative(state[name], value.detach().numpy()) < 1e-4, name


def _interpreted_training(step, batches, optimizer) -> tuple[list[float], dict[str, np.ndarray]]:
    """One device's training on the whole batch: the step graph interpreted in float64, step after step."""
    state = {name: value.astype(np.float64) for name, value in step.state.items()}
    losses = []
    for t, (x, labels) in enumerate(batches):
        out = interpret(step.graph, {**state, "x": x.astype(np.float64), step.label_input: labels,
                                     **optimizer.step_scalars(t)})
        losses.append(float(out[step.loss_output]))
        state = {name: out[step.state_updates[name]] if name in step.state_updates else value
                 for name, value in state.items()}
    return losses, state


# 40-100 s on two cores (compiling the replica step's kernels, starting two workers): `pytest -m slow`. The
# default run checks the same step graphs on simulated replicas (tests/passes/test_sync_batchnorm.py).
@pytest.mark.slow
def test_synchronised_batchnorm_on_two_workers_trains_as_one_device_on_the_whole_batch(kernel_cache, tmp_path):
    """compile_training(devices=2, sync_batchnorm=True) on a small CNN with BatchNormalization, 20 SGD-momentum
    steps: losses, weights and BN running statistics equal one device's on the whole batch (its step graph
    interpreted in float64) within 1e-4 relative. 64-byte buckets: the BN gradients' all-reduces run between a
    bucket of one gradient (the filter's) and one of two (BN's scale and bias)."""
    batch = 8
    path = tmp_path / "cnn_bn.onnx"
    onnx.save(conv_bn_model(batch), path)
    optimizer = tessel.optim.SGD(lr=0.05, momentum=0.9)
    rng = np.random.default_rng(0)
    batches = [input_batch(rng, batch) for _ in range(STEPS)]
    want_losses, want_state = _interpreted_training(
        build_step_graph(str(path), {"x": batches[0][0].shape}, "cross_entropy", optimizer), batches, optimizer)
    parallel = tessel.compile_training(str(path), loss="cross_entropy", optimizer=optimizer,
                                       input_shapes={"x": batches[0][0].shape}, cache_dir=kernel_cache, devices=2,
                                       sync_batchnorm=True, bucket_bytes=64)
    try:
        got_losses = [parallel.step({"x": x.astype(np.float32)}, labels) for x, labels in batches]
        got_state = parallel.state
    finally:
        parallel.close()
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-4)
    assert set(got_state) == set(want_state)
    for name, value in want_state.items():
        assert _relative(got_state[name], value) < 1e-4, name


# Several minutes on two cores (the CNN's kernels at batch 16 and 4, four worker processes): `pytest -m slow`.
@pytest.mark.slow
def test_synchronised_batchnorm_on_four_workers_trains_the_cnn_as_one_device(tmp_path, kernel_cache):
    """bench/training_models.py's CNN with BatchNormalization, batch 16 on 4 workers with synchronised BN against
    one compiled device on the whole batch: 20 SGD-momentum steps, weights and BN statistics within 1e-4."""
    spec = SPECS["cnn_bn"]
    shape = (16, *spec.input_shape[1:])
    path = export(spec.model(0), shape, tmp_path / "cnn.onnx")
    rng = np.random.default_rng(0)
    batches = [type(spec)(spec.name, spec.build, shape, spec.loss, spec.outputs).batch(rng) for _ in range(STEPS)]
    optimizer = tessel.optim.SGD(lr=0.05, momentum=0.9)
    options = {"loss": spec.loss, "optimizer": optimizer, "input_shapes": {"x": shape}, "cache_dir": kernel_cache}
    _check_synchronised_training(path, batches, options, 4)


# Tens of minutes on two cores (ResNet-18's float64 kernels, up to four worker processes): `pytest -m slow`.
@pytest.mark.slow
@pytest.mark.parametrize("workers", [2, 4])
def test_resnet18_with_synchronised_batchnorm_trains_as_one_device(workers, tmp_path, kernel_cache):
    """ResNet-18 at batch 4 (224×224), 20 SGD-momentum steps on 2 and 4 workers with synchronised BatchNorm against
    one compiled device on the whole batch: weights and BN statistics within 1e-4. In float64, at the training
    issue's settings (tests/compiler/test_training_torch.py RESNET18): in float32 these steps are chaotic, and the
    replicas' different summation order alone moves the weights by more than that (as PyTorch float32 against
    float64)."""
    spec = SPECS["resnet18"]
    shape = (4, 3, 224, 224)
    path = export(spec.model(0), shape, tmp_path / "resnet18.onnx")
    rng = np.random.default_rng(0)
    batches = [type(spec)(spec.name, spec.build, shape, spec.loss, spec.outputs).batch(rng) for _ in range(STEPS)]
    options = {"loss": spec.loss, "optimizer": tessel.optim.SGD(lr=0.01, momentum=0.9), "input_shapes": {"x": shape},
               "cache_dir": kernel_cache, "precision": "fp64"}
    _check_synchronised_training(path, batches, options, workers)


def _check_synchronised_training(path, batches, options, workers: int) -> None:
    """`workers` data-parallel workers with synchronised BatchNorm step like one compiled device on the whole batch:
    every step's loss, then the weights and BN statistics, within 1e-4."""
    single = tessel.compile_training(str(path), **options)
    parallel = tessel.compile_training(str(path), devices=workers, sync_batchnorm=True, **options)
    try:
        for x, labels in batches:
            assert parallel.step({"x": x}, labels) == pytest.approx(single.step({"x": x}, labels), rel=1e-4)
        got_state = parallel.state
    finally:
        parallel.close()
    for name, value in single.state.items():
        assert _relative(got_state[name], value) < 1e-4, name
