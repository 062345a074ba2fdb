"""Persistent state: the Assign instruction, the plan's "state" checks, and state kept across runs on both hosts."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from tessel.compiler.api import ModelSource, compile_graph, prepare_machine
from tessel.compiler.options import CompileError, CompileOptions
from tessel.compiler.state_program import PersistentState
from tessel.runtime.errors import ArtifactError, InputError
from tessel.runtime.executor import Executor
from tessel.runtime.instructions import Assign, ProgramFormatError, from_json, program_from_json, program_to_json
from tessel.runtime.native_host import native_able
from tessel.passes.optimizer_update import LR
from tessel.runtime.plan_schema import validate_plan
from tests.compiler.step_graphs import batch, linear_step_graph, numpy_step, step_model

HOSTS = ["native", "python"]
RATE = 0.1


def _compile_step(kernel_cache, **options):
    step = linear_step_graph()
    options = CompileOptions.create(None, cache_dir=kernel_cache, **options)
    return compile_graph(step.graph, options, prepare_machine(options), ModelSource("linear", step_model(), None, {}, 0.0),
                         state=PersistentState(step.state, step.state_updates))


@pytest.fixture(scope="module")
def artifact(kernel_cache):
    return _compile_step(kernel_cache)


def _feeds(seed: int) -> dict[str, np.ndarray]:
    x, y = batch(seed)
    return {"x": x, "labels": y, LR: np.array(RATE, np.float32)}


def test_assign_round_trips_through_json_text():
    assign = Assign("assign/W", "Assign", src="W_next", dst="W")
    assert assign.to_json() == {"kind": "assign", "node": "assign/W", "op": "Assign", "src": "W_next", "dst": "W"}
    assert program_from_json(json.loads(json.dumps(program_to_json([assign])))) == [assign]
    assert list(assign.reads()) == [("src", "W_next")] and assign.writes() == ("W",)
    assert assign.renamed({"W": "V"}).dst == "V"
    assert native_able(assign)  # a memmove in the native program: a step stays one native call


def test_assign_fields_are_typed():
    with pytest.raises(ProgramFormatError, match=r"step\.dst: must be a string"):
        from_json({"kind": "assign", "node": "n", "op": "Assign", "src": "a", "dst": 3}, "step")


def test_the_plan_names_the_state_outside_inputs_outputs_and_arena(artifact):
    plan = artifact.plan
    worker = plan["workers"][0]
    assert plan["state"] == {"names": ["W", "b"], "updates": {"W": "W_next", "b": "b_next"}, "file": "state.npz"}
    assert worker["inputs"] == ["x", "labels", LR] and worker["outputs"] == ["loss"]
    assert not {"W", "b"} & set(worker["memory"]["offsets"])
    assigns = [step for step in program_from_json(worker["instructions"]) if isinstance(step, Assign)]
    assert {(a.src, a.dst) for a in assigns} == {("W_next", "W"), ("b_next", "b")}
    # Nothing that reads the state runs at load: the state changes every run.
    assert not any(step.get("init") and {"W", "b"} & set(step.get("inputs", [])) for step in worker["instructions"])


@pytest.mark.parametrize("host", HOSTS)
def test_state_persists_across_runs_as_numpy_steps_it(artifact, host):
    executor = Executor(artifact.directory, host=host)
    assert executor.host == host and executor.state_names == ("W", "b")
    w, b = executor.state()["W"], executor.state()["b"]
    for seed in range(4):
        executor.poison()
        loss = executor.run(_feeds(seed))["loss"]
        want, w, b = numpy_step(w, b, *batch(seed), RATE)
        np.testing.assert_allclose(loss, want, rtol=1e-5)
    state = executor.state()
    np.testing.assert_allclose(state["W"], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["b"], b, rtol=1e-5, atol=1e-6)


def test_both_hosts_step_identically(artifact):
    losses = []
    for host in HOSTS:
        executor = Executor(artifact.directory, host=host)
        losses.append([float(executor.run(_feeds(seed))["loss"]) for seed in range(3)])
    assert losses[0] == losses[1]


def test_set_state_restarts_from_given_values(artifact):
    executor = Executor(artifact.directory)
    start = executor.state()
    first = float(executor.run(_feeds(0))["loss"])
    executor.run(_feeds(1))
    state = executor.state()
    state["W"][0, 0] = 123.0  # a copy: the executor's state is untouched
    assert executor.state()["W"][0, 0] != 123.0
    executor.set_state(start)
    assert float(executor.run(_feeds(0))["loss"]) == first
    executor.set_state({"b": np.array([4.0], np.float32)})
    np.testing.assert_array_equal(executor.state(["b"])["b"], [4.0])


def test_set_state_refuses_unknown_names_and_other_types(artifact):
    executor = Executor(artifact.directory)
    with pytest.raises(InputError, match="'x' is not a state value of this artifact; it holds W, b"):
        executor.set_state({"x": np.zeros((8, 3), np.float32)})
    with pytest.raises(InputError, match=r"state 'W' is float64\[3,1\], the artifact holds float32\[3,1\]"):
        executor.set_state({"W": np.zeros((3, 1))})


def test_state_is_not_a_per_run_input(artifact):
    with pytest.raises(InputError, match="unknown 'W'"):
        Executor(artifact.directory).run({**_feeds(0), "W": np.zeros((3, 1), np.float32)})


def _plan_fault(plan: dict) -> str:
    with pytest.raises(ArtifactError) as error:
        validate_plan(plan, "plan.json")
    return str(error.value)


def _edited(artifact, edit) -> dict:
    plan = copy.deepcopy(artifact.plan)
    edit(plan, plan["workers"][0])
    return plan


def _assign_index(worker: dict, state: str) -> int:
    return next(k for k, i in enumerate(program_from_json(worker["instructions"]))
                if isinstance(i, Assign) and i.dst == state)


def _producer(worker: dict, name: str) -> dict:
    return next(i for i in worker["instructions"] if name in i.get("outputs", []))


def _writes_w_without_reading_it(kernel: dict) -> None:
    kernel.update(outputs=["W"], inputs=["W_next" if name == "W" else name for name in kernel["inputs"]])


def test_the_plan_as_compiled_validates(artifact):
    validate_plan(artifact.plan, "plan.json")


@pytest.mark.parametrize("edit, problem", [
    (lambda plan, w: w["instructions"][_assign_index(w, "b")].update(dst="x"), "'x' is not a state value"),
    (lambda plan, w: w["instructions"][_assign_index(w, "b")].update(src="W_next"),
     "assigns 'W_next' (float32[3,1]) to state 'b'"),
    (lambda plan, w: w["instructions"].insert(0, w["instructions"].pop(_assign_index(w, "W"))),
     "reads 'W' after the Assign of state 'W'"),
    (lambda plan, w: w["instructions"].append(dict(w["instructions"][_assign_index(w, "b")])),
     "state 'b' is assigned twice"),
    (lambda plan, w: w["memory"]["offsets"].update(W=0), "memory.offsets: 'W' is persistent state"),
    (lambda plan, w: plan["state"]["updates"].update(W="b_next"), "does not assign 'b_next' to 'W'"),
    (lambda plan, w: plan["state"]["updates"].pop("b"), "assigns 'b' but the state lists no update"),
    (lambda plan, w: plan["state"].update(file="../state.npz"), "state.file"),
    (lambda plan, w: plan.update(workers=[w, {**w, "instructions": [i for i in w["instructions"] if i.get("dst") != "W"]}]),
     "state.updates['W']: the program does not assign"),
    (lambda plan, w: _producer(w, "W_next").update(outputs=["W"]), "state 'W' is assigned twice"),
    (lambda plan, w: _writes_w_without_reading_it(_producer(w, "W_next")), "writes state 'W' without reading it"),
])
def test_plan_checks_refuse_a_damaged_state(artifact, edit, problem):
    assert problem in _plan_fault(_edited(artifact, edit))


def test_an_instruction_run_at_load_may_not_read_the_state(artifact):
    def read_w_at_load(plan, worker):
        worker["instructions"].insert(0, {"kind": "view", "node": "peek", "op": "Identity", "input": "W",
                                          "output": "W_next", "init": True})

    assert "'W' is neither a weight nor an earlier init instruction's output" in _plan_fault(_edited(artifact, read_w_at_load))


def test_training_compiles_for_one_device_only(kernel_cache):
    with pytest.raises(CompileError, match="training compiles for one device and one micro-batch"):
        _compile_step(kernel_cache, devices=2)
