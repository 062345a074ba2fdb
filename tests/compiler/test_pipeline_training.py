"""Pipeline-parallel training (compiler/pipeline_training.py, pipeline_programs.py, pipeline_step.py):
compile_training(devices=K, parallel="pipeline", micro_batches=M) trains like one device on the whole batch
(the MLP of bench/training_models.py, no BatchNormalization) under GPipe and 1F1B; what each stage holds and
runs; what is refused."""
from __future__ import annotations

import copy

import numpy as np
import pytest

import tessel
from bench.training_models import SPECS, export
from tessel.compiler.options import CompileError
from tessel.passes.pipeline_schedule import stage_order
from tessel.runtime.errors import ArtifactError
from tessel.runtime.instructions import Assign, KernelCall, Recv, Send
from tessel.runtime.plan_schema import validate_plan

STEPS = 6
MICRO_BATCHES = 4


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    spec = SPECS["mlp"]
    path = export(spec.model(0), spec.input_shape, tmp_path_factory.mktemp("pipe") / "mlp.onnx")
    rng = np.random.default_rng(0)
    return spec, path, [spec.batch(rng) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def single(mlp, kernel_cache):
    """One device on the whole batch: its per-step losses and final state."""
    spec, path, batches = mlp
    trainer = _compile(spec, path, kernel_cache)
    return [trainer.step({"x": x}, labels) for x, labels in batches], trainer.state


def _compile(spec, path, kernel_cache, **options):
    return tessel.compile_training(str(path), loss=spec.loss, optimizer=tessel.optim.SGD(lr=0.05, momentum=0.9),
                                   input_shapes={"x": spec.input_shape}, cache_dir=kernel_cache, **options)


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-12))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_train_like_one_device_on_the_whole_batch(mlp, single, kernel_cache, schedule):
    spec, path, batches = mlp
    want_losses, want_state = single
    pipe = _compile(spec, path, kernel_cache, devices=2, parallel="pipeline", micro_batches=MICRO_BATCHES,
                    schedule=schedule)
    try:
        assert pipe.workers == 2
        losses = [pipe.step({"x": x}, labels) for x, labels in batches]
        assert losses == pytest.approx(want_losses, rel=1e-4)
        got_state = pipe.state
        assert set(got_state) == set(want_state)
        for name, value in want_state.items():
            assert _relative(got_state[name], value) < 1e-4, name
        # evaluate runs the whole batch on the stages' gathered state.
        x = batches[0][0]
        np.testing.assert_allclose(pipe.evaluate({"x": x})["y"], _mlp_forward(got_state, x), rtol=1e-4, atol=1e-5)
    finally:
        pipe.close()
    _check_plan(pipe.step_artifact.plan, schedule)


def _mlp_forward(state: dict, x: np.ndarray) -> np.ndarray:
    for k, layer in enumerate((0, 2, 4)):
        x = x @ state[f"net.{layer}.weight"].T + state[f"net.{layer}.bias"]
        x = np.maximum(x, 0) if k < 2 else x
    return x


def _check_plan(plan: dict, schedule: str) -> None:
    """Each stage holds its own parameters and slots, runs kernels, and trades activations and gradients."""
    from tessel.runtime.instructions import program_from_json

    pipeline = plan["pipeline"]
    assert pipeline["stages"] == 2 and pipeline["micro_batches"] == MICRO_BATCHES and pipeline["schedule"] == schedule
    assert pipeline["bubble_fraction_predicted"] == pytest.approx(1 / 5)
    assert pipeline["in_flight"] == ([MICRO_BATCHES] * 2 if schedule == "gpipe" else [2, 1])
    held = plan["state"]["workers"]
    assert sorted(held[0] + held[1]) == sorted(plan["state"]["names"]) and held[0] and held[1]
    for rank, section in enumerate(plan["workers"]):
        instructions = program_from_json(section["instructions"])
        assert any(isinstance(i, KernelCall) for i in instructions)
        assert any(isinstance(i, Send) for i in instructions) and any(isinstance(i, Recv) for i in instructions)
        # Each stage updates exactly the state it holds: by an Assign, or by its update kernel writing in place.
        names = set(plan["state"]["names"])
        written = {i.dst for i in instructions if isinstance(i, Assign)}
        written |= {name for i in instructions if isinstance(i, KernelCall) for name in i.writes() if name in names}
        assert written == set(held[rank])
        # The stage's blocks (for the step's timeline) cover its program, in the schedule's order.
        runs = pipeline["phases"][rank]
        assert sum(count for _, _, count in runs) == len(instructions)
        assert [(kind, m) for kind, m, _ in runs if kind in "FB"] == stage_order(schedule, 2, MICRO_BATCHES, rank)
    assert plan["workers"][0]["outputs"] == [f"loss@mb{m}" for m in range(MICRO_BATCHES)]
    validate_plan(plan, "plan.json")
    # Each state value is held by exactly one stage, and a stage assigns only what it holds.
    for edit, problem in [
        (lambda p: p["state"]["workers"][1].append(p["state"]["workers"][0][0]), "every state value once"),
        (lambda p: p["state"]["workers"].pop(), "1 lists for 2 workers"),
        (lambda p: p["state"]["workers"].reverse(), "is not a state value|is read before any instruction writes it"),
    ]:
        damaged = copy.deepcopy(plan)
        edit(damaged)
        with pytest.raises(ArtifactError, match=problem):
            validate_plan(damaged, "plan.json")


@pytest.mark.slow
def test_checkpoint_of_a_pipeline_resumes_on_its_stages(mlp, single, kernel_cache, tmp_path):
    spec, path, batches = mlp
    pipe = _compile(spec, path, kernel_cache, devices=2, parallel="pipeline", micro_batches=MICRO_BATCHES,
                    schedule="1f1b")
    try:
        for x, labels in batches[:3]:
            pipe.step({"x": x}, labels)
        saved = pipe.save(tmp_path / "checkpoint")
        rest = [pipe.step({"x": x}, labels) for x, labels in batches[3:]]
        final = pipe.state
    finally:
        pipe.close()
    resumed = tessel.load_training(saved)
    try:
        assert resumed.workers == 2 and resumed.steps_done == 3
        assert [resumed.step({"x": x}, labels) for x, labels in batches[3:]] == rest
        assert all(np.array_equal(resumed.state[name], value) for name, value in final.items())
    finally:
        resumed.close()


@pytest.mark.parametrize("options, problem", [
    ({"devices": 1, "micro_batches": 4}, "2 or more devices"),
    ({"devices": 2, "micro_batches": 3}, "not a multiple of 3"),
    ({"devices": 2, "micro_batches": 4, "schedule": "zigzag"}, "unknown pipeline schedule"),
    ({"devices": 2, "micro_batches": 4, "microbatches": 2}, "give --micro-batches"),
])
def test_pipeline_refusals(mlp, kernel_cache, options, problem):
    spec, path, _ = mlp
    with pytest.raises(CompileError, match=problem):
        _compile(spec, path, kernel_cache, parallel="pipeline", **options)


def test_unknown_parallel_is_refused(mlp, kernel_cache):
    spec, path, _ = mlp
    with pytest.raises(CompileError, match="unknown parallel training 'tensor'"):
        _compile(spec, path, kernel_cache, devices=2, parallel="tensor")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_four_stages_train_like_one_device(mlp, single, kernel_cache, schedule):
    spec, path, batches = mlp
    want_losses, want_state = single
    pipe = _compile(spec, path, kernel_cache, devices=4, parallel="pipeline", micro_batches=MICRO_BATCHES,
                    schedule=schedule)
    try:
        assert [pipe.step({"x": x}, labels) for x, labels in batches] == pytest.approx(want_losses, rel=1e-4)
        assert all(_relative(pipe.state[name], value) < 1e-4 for name, value in want_state.items())
        assert pipe.step_artifact.plan["pipeline"]["bubble_fraction_predicted"] == pytest.approx(3 / 7)
    finally:
        pipe.close()


@pytest.mark.slow
def test_transformer_block_on_two_stages_under_1f1b_with_adamw(kernel_cache, tmp_path):
    """Attention, LayerNorm and a residual crossing the cut; AdamW. Exported with a symbolic batch: the legacy
    exporter otherwise bakes the batch into the attention's Reshape, and the micro-batch could not import."""
    import torch

    spec = SPECS["transformer_block"]
    path = tmp_path / "block.onnx"
    torch.onnx.export(spec.model(0).eval(), (torch.zeros(spec.input_shape),), str(path), dynamo=False,
                      do_constant_folding=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    rng = np.random.default_rng(0)
    batches = [spec.batch(rng) for _ in range(5)]

    def compile_block(**options):
        return tessel.compile_training(str(path), loss=spec.loss, optimizer=tessel.optim.AdamW(lr=1e-3),
                                       input_shapes={"x": spec.input_shape}, cache_dir=kernel_cache, **options)

    single = compile_block()
    pipe = compile_block(devices=2, parallel="pipeline", micro_batches=MICRO_BATCHES, schedule="1f1b")
    try:
        want = [single.step({"x": x}, labels) for x, labels in batches]
        assert [pipe.step({"x": x}, labels) for x, labels in batches] == pytest.approx(want, rel=1e-4)
        # AdamW divides by the root of tiny second moments: summing micro-batch gradients in another order
        # moves some weights by a few 1e-4 of their scale.
        assert all(_relative(pipe.state[name], value) < 1e-3 for name, value in single.state.items())
    finally:
        pipe.close()
