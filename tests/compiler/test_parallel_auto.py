"""compile_training(parallel="auto") and `tessel train --parallel auto` (compiler/parallel_auto.py): the step of
each alternative played out on hand-made worker programs (compiler/step_timeline.py), its phases, the report and
the measured step; the whole run on two workers is slow-marked."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tessel.compiler.parallel_auto import (Alternative, ParameterServerChosen, auto_micro_batches, choose,
                                           predict_data, predict_ps, record_measured, record_run, report_markdown,
                                           write_report)
from tessel.compiler.ps_timeline import shard_loads, simulate_ps
from tessel.compiler.step_kernels import KernelTime
from tessel.compiler.pipeline_programs import block_runs
from tessel.compiler.plots.step_gantt import write_step_gantt
from tessel.compiler.options import CompileError
from tessel.compiler.step_timeline import (ALLREDUCE, BACKWARD, FORWARD, TRANSFER, UPDATE, WAIT, WorkerProgram,
                                           reordered_stage, replica_phases, simulate, stage_phases)
from tessel.passes.machine import Link
from tessel.runtime.instructions import AllReduce, Assign, KernelCall, Recv, Send, program_to_json

LINK = Link(alpha=1e-3, beta=1e-6)  # 1 ms + 1 µs per byte: round numbers
F32 = "float32[250]"  # 1000 bytes: one transfer costs 2 ms


def _kernel(node: str, inputs: list[str], outputs: list[str]) -> KernelCall:
    return KernelCall(node, "Op", kernel=f"k_{node}", inputs=inputs, outputs=outputs)


def _values(*names: str) -> dict[str, str]:
    return dict.fromkeys(names, F32)


def _replica() -> list:
    """forward (f1, loss), the loss all-reduced, backward (g) with its gradient all-reduced, then the update
    (reading the averaged gradient and the parameter, which it writes in place) and a state copy."""
    return [_kernel("f1", ["x", "w"], ["h"]), _kernel("loss_k", ["h"], ["l"]),
            AllReduce("ar_loss", "AllReduce", tensor="l", reduction="mean", output="loss"),
            _kernel("g", ["h", "l"], ["gw"]),
            AllReduce("ar_g", "AllReduce", tensor="gw", reduction="mean", output="gm"),
            _kernel("other", ["h"], ["o"]), _kernel("upd", ["w", "gm"], ["w"]),
            Assign("keep", "Assign", src="o", dst="s")]


def test_replica_phases_follow_the_data_flow():
    # The forward reads w before the update writes it: w's later writer is not a forward instruction.
    assert replica_phases(_replica(), "loss") == [FORWARD, FORWARD, ALLREDUCE, BACKWARD, ALLREDUCE, BACKWARD, UPDATE,
                                                  UPDATE]


def test_all_reduce_overlaps_the_kernels_after_it():
    program = _replica()
    worker = WorkerProgram(program, replica_phases(program, "loss"), _values("x", "w", "h", "l", "loss", "gw", "gm",
                                                                              "o", "s"))
    timeline = simulate([worker, worker], lambda call: {"other": 5e-3}.get(call.node, 1e-3), LINK,
                        allreduce_s=lambda nbytes: 4e-3, start_s=0.5e-3)
    # f1, loss_k: 0.5-2.5 ms; loss all-reduce 2.5-6.5; g 2.5-3.5; gradient all-reduce waits for the link: 6.5-10.5;
    # "other" 3.5-8.5 overlaps it; upd waits for the averaged gradient: 10.5-11.5; the copy: 2 KB at 5 GB/s.
    assert timeline.step_s == pytest.approx(11.5e-3 + 2000 / 5e9)
    assert timeline.busy_s == [pytest.approx(9e-3 + 2000 / 5e9)] * 2
    bars = {(bar.node, bar.worker): bar for bar in timeline.bars}
    assert bars["ar_g", 0].start_s == pytest.approx(6.5e-3) and bars["ar_g", 0].comm
    assert bars["upd", 1].start_s == pytest.approx(10.5e-3) and bars["upd", 1].phase == UPDATE


def _two_stages():
    """Stage 0 computes a and sends it; stage 1 receives it, computes b and sends back its gradient."""
    first = [_kernel("a", ["x"], ["a"]), Send("send_a", "Send", tensor="a", peer=1, tag=7),
             Recv("recv_g", "Recv", output="g", peer=1, tag=8), _kernel("ga", ["g"], ["gx"])]
    second = [Recv("recv_a", "Recv", output="a", peer=0, tag=7), _kernel("b", ["a"], ["g"]),
              Send("send_g", "Send", tensor="g", peer=0, tag=8)]
    values = _values("x", "a", "g", "gx")
    return (WorkerProgram(first, [FORWARD, FORWARD, BACKWARD, BACKWARD], values),
            WorkerProgram(second, [FORWARD, FORWARD, BACKWARD], values))


def test_sends_arrive_after_the_link_and_receivers_wait():
    timeline = simulate(list(_two_stages()), lambda call: 1e-3, LINK, allreduce_s=LINK.seconds)
    # a 0-1 ms, its send's overhead (α/2) 1-1.5; a arrives at 3; b 3-4; its gradient arrives at 6; ga 6-7.
    assert timeline.step_s == pytest.approx(7e-3)
    waits = [(bar.worker, bar.start_s, bar.finish_s) for bar in timeline.bars if bar.phase == WAIT]
    assert waits == [(1, 0.0, pytest.approx(3e-3)), (0, pytest.approx(1.5e-3), pytest.approx(6e-3))]
    assert timeline.busy_s == [pytest.approx(2e-3), pytest.approx(1e-3)]


def test_back_to_back_sends_share_the_bandwidth_not_the_latency():
    values = _values("a", "b")
    sends = [Send("s1", "Send", tensor="a", peer=1, tag=1), Send("s2", "Send", tensor="b", peer=1, tag=2)]
    receives = [Recv("r1", "Recv", output="a", peer=0, tag=1), Recv("r2", "Recv", output="b", peer=0, tag=2)]
    sender, receiver = (WorkerProgram(program, [TRANSFER, TRANSFER], values) for program in (sends, receives))
    timeline = simulate([sender, receiver], lambda call: 0.0, LINK, allreduce_s=LINK.seconds)
    # The first leaves at 0 and arrives at 2 ms; the second leaves after the first's 1 ms of bytes: arrives at 3.
    assert timeline.step_s == pytest.approx(3e-3)


def test_programs_that_would_deadlock_are_refused():
    first, second = _two_stages()
    stuck = WorkerProgram([Recv("r", "Recv", output="a", peer=1, tag=9)], [FORWARD], first.values)
    with pytest.raises(ValueError, match="deadlock"):
        simulate([stuck, second], lambda call: 1e-3, LINK, allreduce_s=LINK.seconds)


def test_a_stage_replays_its_blocks_in_1f1b_order():
    # A GPipe first stage of 2 with 2 micro-batches: once, F0, F1, B0, B1, update (a block of one instruction each).
    runs = [["once", None, 1], ["F", 0, 1], ["F", 1, 1], ["B", 0, 1], ["B", 1, 1], ["update", None, 1]]
    instructions = [_kernel(name, [], [name]) for name in ("once", "F0", "F1", "B0", "B1", "update")]
    assert stage_phases(runs) == [FORWARD, FORWARD, FORWARD, BACKWARD, BACKWARD, UPDATE]
    sequence, phases = reordered_stage(instructions, runs, "1f1b", 2, 2, 1)
    assert [i.node for i in sequence] == ["once", "F0", "B0", "F1", "B1", "update"]
    assert phases == [FORWARD, FORWARD, BACKWARD, FORWARD, BACKWARD, UPDATE]


def test_pipeline_blocks_give_transfers_their_neighbours_phase():
    once, f0, b0, update = (_kernel(n, [], [n]) for n in ("once", "f0", "b0", "update"))
    blocks = [("once", None, [once]), ("F", 0, [f0]), ("B", 0, [b0]), ("update", None, [update])]
    send = Send("s", "Send", tensor="f0", peer=1, tag=1)
    recv = Recv("r", "Recv", output="g", peer=1, tag=2)
    # A Send goes with the block before it, a Recv with the block it feeds.
    assert block_runs(blocks, [once, f0, send, recv, b0, update]) == [
        ["once", None, 1], ["F", 0, 2], ["B", 0, 2], ["update", None, 1]]


def test_micro_batches_default_to_up_to_four_per_stage_dividing_the_batch():
    assert auto_micro_batches(16, 2) == 8
    assert auto_micro_batches(12, 2) == 6
    assert auto_micro_batches(7, 2) == 7
    assert auto_micro_batches(5, 4) == 5


def _alternatives() -> list[Alternative]:
    return [Alternative("data", "data", None, 4e-3, "measured", detail="1 all-reduce(s) a step (gloo)"),
            Alternative("parameter server", "ps", None, 1e-3, "measured", detail="1 server(s)", runnable=False,
                        note="runs through `tessel train --parallel ps`"),
            Alternative("pipeline gpipe", "pipeline", "gpipe", 3e-3, "2 of 3 measured", 0.5e-3, "2 stages",
                        bubble={"predicted": 0.2, "simulated": 0.25, "busy_s": [1.5e-3, 2.5e-3]}),
            Alternative("pipeline 1f1b", "pipeline", "1f1b", None, note="cannot cut", runnable=False)]


def test_the_least_predicted_runnable_alternative_is_chosen():
    assert choose(_alternatives()).name == "pipeline gpipe"
    with pytest.raises(CompileError, match="no alternative can run: data: none"):
        choose([Alternative("data", "data", None, None, runnable=False, note="none")])


def test_the_report_lists_every_prediction_then_the_measured_step(tmp_path):
    alternatives = _alternatives()
    write_report(tmp_path, alternatives, choose(alternatives), LINK, "given", 2)
    text = (tmp_path / "parallel_auto.md").read_text()
    assert "| pipeline gpipe **(chosen)** | 3.000 ms | 2 of 3 measured | 0.500 ms | 2 stages |" in text
    assert "| parameter server | 1.000 ms | measured | - | 1 server(s); runs through" in text
    assert "| pipeline 1f1b | - | - | - | cannot cut |" in text
    assert "Link α 1000.0 µs, β 1000.000 ns/byte (given)." in text
    # Warm-up steps are left out; the median of the rest is the step.
    measured = record_measured(tmp_path, [1.0, 1.0, 4e-3, 5e-3, 6e-3])
    assert measured["step_s"] == pytest.approx(5e-3) and measured["steps"] == 3
    assert measured["error"] == pytest.approx((3e-3 - 5e-3) / 5e-3)
    assert measured["bubble"]["measured"] == pytest.approx(1 - 2e-3 / 5e-3)
    doc = json.loads((tmp_path / "parallel_auto.json").read_text())
    assert doc["measured"] == measured and report_markdown(doc) == (tmp_path / "parallel_auto.md").read_text()
    assert "error -40.0%" in report_markdown(doc)
    assert "pipeline bubble: measured 60.0%" in report_markdown(doc)


def test_a_run_directory_gets_the_report_and_run_json_the_choice(tmp_path):
    artifact, run = tmp_path / "artifact", tmp_path / "run"
    (artifact / "reports").mkdir(parents=True)
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"parallel": "auto"}))
    alternatives = _alternatives()
    write_report(artifact / "reports", alternatives, choose(alternatives), LINK, "given", 2)
    trainer = SimpleNamespace(step_artifact=SimpleNamespace(directory=artifact), step_profile=None)
    measured = record_run(run, trainer, [1.0, 1.0, 2e-3])
    assert measured["step_s"] == 2e-3
    settings = json.loads((run / "run.json").read_text())
    assert settings["parallel"] == "auto" and settings["parallel_auto"]["chosen"] == "pipeline gpipe"
    assert settings["parallel_auto"]["predicted_s"]["data"] == 4e-3
    assert "## Measured" in (run / "reports" / "parallel_auto.md").read_text()
    # A one-device run (no report) and a run without steps write nothing.
    assert record_run(run, SimpleNamespace(step_artifact=SimpleNamespace(directory=tmp_path / "none")), []) is None


def test_the_step_chart_is_written_with_its_title(tmp_path):
    first, second = _two_stages()
    timeline = simulate([first, second], lambda call: 1e-3, LINK, allreduce_s=LINK.seconds)
    paths = write_step_gantt(tmp_path / "step", timeline, "one step, predicted")
    assert [p.suffix for p in paths] == [".png", ".svg"] and all(p.stat().st_size for p in paths)
    assert "one step, predicted" in paths[1].read_text()


@pytest.mark.slow
def test_tessel_train_parallel_auto_on_two_workers(tmp_path):
    """~1-2 minutes: compiles the data-parallel and pipeline steps of the bench MLP, trains 6 steps."""
    from bench.training_models import SPECS, export
    from tessel.compiler.cli import main

    spec = SPECS["mlp"]
    model = export(spec.model(0), spec.input_shape, tmp_path / "mlp.onnx")
    rng = np.random.default_rng(0)
    x, y = zip(*(spec.batch(rng) for _ in range(6)))
    np.savez(tmp_path / "data.npz", x=np.concatenate(x), labels=np.concatenate(y))
    run = tmp_path / "run"
    assert main(["train", str(model), "--data", str(tmp_path / "data.npz"), "--loss", "mse", "--lr", "0.05",
                 "--batch", str(spec.input_shape[0]), "--epochs", "1", "--devices", "2", "--parallel", "auto",
                 "-o", str(run)]) == 0
    settings = json.loads((run / "run.json").read_text())
    auto = settings["parallel_auto"]
    assert settings["parallel"] == "auto" and auto["chosen"] in ("data", "pipeline gpipe", "pipeline 1f1b")
    assert set(auto["predicted_s"]) == {"data", "parameter server", "pipeline gpipe", "pipeline 1f1b"}
    assert auto["measured"]["step_s"] > 0
    text = (run / "reports" / "parallel_auto.md").read_text()
    assert "## Measured" in text and (run / "reports" / "step_gantt.png").is_file()


def _deadlocks(*args):
    raise ValueError("the step's programs would deadlock")


class _FakeTrainer:
    """What compile_auto reads of a compiled Trainer; `closed` once closed."""

    def __init__(self, directory, **how):
        self.how, self.closed = how, False
        self.step_artifact = SimpleNamespace(directory=directory)
        self.names = SimpleNamespace(parameters=["w"])

    def host_s(self):
        return 2e-4

    def close(self):
        self.closed = True


def _fake_auto(monkeypatch, tmp_path, predicted: dict, fail_pipeline: bool = False, compiled: list | None = None,
               fail_prediction: bool = False, parameter_server: bool = False):
    """compile_auto with its compiles and predictions replaced: `predicted` seconds by alternative name (with
    `fail_pipeline` the pipeline does not compile; with `fail_prediction` the pipeline's prediction fails); the fake
    trainers compiled (into `compiled`), in order."""
    from tessel.compiler import parallel_auto

    compiled = [] if compiled is None else compiled

    def compile_training(model, **how):
        if fail_pipeline and how.get("parallel") == "pipeline":
            raise CompileError("cannot cut")
        directory = tmp_path / f"artifact{len(compiled)}"
        (directory / "reports").mkdir(parents=True)
        compiled.append(_FakeTrainer(directory, **how))
        return compiled[-1]

    def alternative(name, parallel, schedule=None, runnable=True):
        return Alternative(name, parallel, schedule, predicted[name], "measured", runnable=runnable,
                           bubble={"predicted": 0.2, "simulated": 0.3, "busy_s": [1e-3]} if schedule else {},
                           servers=1 if parallel == "ps" else 0)

    first, second = _two_stages()
    timeline = simulate([first, second], lambda call: 1e-3, LINK, allreduce_s=LINK.seconds)
    monkeypatch.setattr(parallel_auto, "_measured", lambda link: (LINK, "given"))
    monkeypatch.setattr(parallel_auto, "_step_kernel_times", lambda artifact, workers, remeasure: {})
    monkeypatch.setattr(parallel_auto, "_whole_batch", lambda trainer: 16)
    monkeypatch.setattr(parallel_auto, "predict_data", lambda *a: (alternative("data", "data"), timeline))
    monkeypatch.setattr(parallel_auto, "predict_ps", lambda *a: (alternative("parameter server", "ps",
                                                                             runnable=a[-1]), timeline))
    monkeypatch.setattr(parallel_auto, "predict_pipeline", _deadlocks if fail_prediction else (
        lambda artifact, times, link, schedule, host: (alternative(f"pipeline {schedule}", "pipeline", schedule),
                                                      timeline)))
    monkeypatch.setattr(parallel_auto, "allreduce_transport", lambda workers: None)
    trainer = parallel_auto.compile_auto(compile_training, "model.onnx", {"loss": "mse"}, {"devices": 2}, 1, "auto",
                                         False, parameter_server)
    return trainer, compiled


def test_auto_compiles_1f1b_only_when_chosen_and_closes_the_others(monkeypatch, tmp_path):
    predicted = {"data": 3e-3, "parameter server": 1e-3, "pipeline gpipe": 2e-3, "pipeline 1f1b": 1.5e-3}
    trainer, compiled = _fake_auto(monkeypatch, tmp_path, predicted)
    assert [t.how.get("parallel", "data") for t in compiled] == ["data", "pipeline", "pipeline"]
    assert compiled[1].how["schedule"] == "gpipe" and compiled[1].how["micro_batches"] == 8
    assert compiled[2].how["schedule"] == "1f1b" and compiled[2].how["micro_batches"] == 8
    assert trainer is compiled[2] and not trainer.closed and compiled[0].closed and compiled[1].closed
    reports = tmp_path / "artifact2" / "reports"
    assert "| pipeline 1f1b **(chosen)** | 1.500 ms |" in (reports / "parallel_auto.md").read_text()
    assert (reports / "step_gantt.png").is_file()


def test_auto_trains_data_parallel_when_the_pipeline_cannot_be_cut(monkeypatch, tmp_path):
    predicted = {"data": 3e-3, "parameter server": 1e-3}
    trainer, compiled = _fake_auto(monkeypatch, tmp_path, predicted, fail_pipeline=True)
    assert trainer is compiled[0] and len(compiled) == 1 and not trainer.closed
    text = (tmp_path / "artifact0" / "reports" / "parallel_auto.md").read_text()
    assert "| data **(chosen)** |" in text and "| pipeline gpipe | - | - | - | cannot cut |" in text


def test_a_failing_prediction_closes_every_compiled_trainer(monkeypatch, tmp_path):
    compiled = []
    with pytest.raises(ValueError, match="deadlock"):
        _fake_auto(monkeypatch, tmp_path, {"data": 1e-3, "parameter server": 1e-3}, compiled=compiled,
                   fail_prediction=True)
    assert len(compiled) == 2 and all(t.closed for t in compiled)


def test_parameters_are_shared_out_largest_first_to_the_lightest_server():
    assert shard_loads([100, 400, 300, 200], 2) == [500, 500]
    assert shard_loads([100, 400, 300, 200], 1) == [1000]


def test_a_parameter_server_step_pulls_computes_pushes_then_updates():
    program = _replica()
    replica = WorkerProgram(program, replica_phases(program, "loss"), _values("x", "w", "h", "l", "loss", "gw", "gm",
                                                                               "o", "s"))
    timeline = simulate_ps(replica, 2, [1000], 1, lambda call: {"upd": 3e-3}.get(call.node, 1e-3), LINK)
    # The server sends 1000 B to each worker: the link holds each 1 ms, so they arrive at 2 and 3 ms (α + β·bytes).
    # Worker 1 from 3 ms: f1, loss_k, g, other: 4 ms of kernels (the update's kernel and the state copy are the
    # server's), then its push leaves at 7 ms and arrives at 9; the server updates its one shard: 3 ms.
    assert timeline.step_s == pytest.approx(12e-3)
    kinds = {(bar.worker, bar.node) for bar in timeline.bars}
    assert {(0, "ps_pull_0"), (2, "ps_pull_0"), (2, "ps_update_0"), (1, "other")} <= kinds
    assert not any(bar.node in ("upd", "ar_g", "ar_loss") for bar in timeline.bars)


def _tiny_plan_artifact():
    """A data-parallel replica's plan (the hand-made `_replica`) as parallel auto reads it."""
    values = _values("x", "w", "h", "l", "loss", "gw", "gm", "o", "s")
    worker = {"instructions": program_to_json(_replica()), "values": values, "outputs": ["loss"], "inputs": ["x"]}
    return SimpleNamespace(plan={"workers": [worker, worker]})


@pytest.mark.parametrize("link, chosen", [(Link(alpha=50e-3, beta=1e-6), "parameter server"),
                                          (Link(alpha=20e-6, beta=1e-9), "data")], ids=["slow", "fast"])
def test_auto_picks_the_parameter_server_on_a_slow_link_only(link, chosen):
    artifact = _tiny_plan_artifact()
    times = {f"k_{node}": KernelTime(1e-3, True) for node in ("f1", "loss_k", "g", "other", "upd")}
    data, _ = predict_data(artifact, times, link, 2, "auto", 1e-4)
    ps, timeline = predict_ps(artifact, times, link, 2, ["w"], 1e-4, True)
    assert ps.servers == 1 and ps.runnable and timeline.step_s == ps.predicted_s
    assert choose([data, ps]).name == chosen
    # A caller that cannot start servers never gets the parameter server.
    unrunnable, _ = predict_ps(artifact, times, link, 2, ["w"], 1e-4, False)
    assert choose([data, unrunnable]).name == "data" and "tessel train" in unrunnable.note


def test_auto_hands_a_parameter_server_choice_to_its_caller(monkeypatch, tmp_path):
    predicted = {"data": 3e-3, "parameter server": 1e-3, "pipeline gpipe": 2e-3, "pipeline 1f1b": 2.5e-3}
    compiled = []
    with pytest.raises(ParameterServerChosen, match="--parallel ps --servers 1") as raised:
        _fake_auto(monkeypatch, tmp_path, predicted, compiled=compiled, parameter_server=True)
    assert all(t.closed for t in compiled)
    raised.value.write_reports(tmp_path / "run" / "reports")
    text = (tmp_path / "run" / "reports" / "parallel_auto.md").read_text()
    assert "| parameter server **(chosen)** | 1.000 ms |" in text
    assert (tmp_path / "run" / "reports" / "step_gantt.png").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("link, workers, parameter_server",
                         [(Link(50e-3, 8e-9), 4, True), (Link(20e-6, 1e-9), 2, False)],
                         ids=["emulated-slow-link", "fast-link"])
def test_auto_on_the_bench_mlp_picks_the_parameter_server_on_a_slow_link_only(tmp_path, monkeypatch, link, workers,
                                                                                parameter_server):
    """~1 min: compiles the bench MLP's data-parallel and pipeline steps and predicts them on an emulated link
    (every message and all-reduce priced by it): a 1 Gbit/s network with 50 ms latency on 4 workers, where an
    all-reduce pays the latency 2(p - 1) = 6 times (ring) against the parameter server's push and pull (on 2 workers,
    with the loss riding in the last gradient bucket, both pay it alike); or a fast one on 2 workers. (The MLP's
    step is a fraction of a millisecond: on 4 workers sharing 2 cores the host's share decides it, not the link.)"""
    import tessel
    from bench.training_models import SPECS, export
    from tessel.compiler import parallel_auto

    monkeypatch.setattr(parallel_auto, "_measured", lambda measured: (link, "emulated"))
    monkeypatch.setattr(parallel_auto, "allreduce_transport", lambda workers: None)
    spec = SPECS["mlp"]
    model = export(spec.model(0), spec.input_shape, tmp_path / "mlp.onnx")

    def compile_auto():
        return tessel.compile_training(str(model), loss="mse", optimizer=tessel.optim.SGD(0.05), devices=workers,
                                       input_shapes={"x": spec.input_shape}, parallel="auto", auto_ps=True)

    if parameter_server:
        with pytest.raises(ParameterServerChosen, match="--parallel ps --servers"):
            compile_auto()
        return
    trainer = compile_auto()
    try:
        doc = json.loads((Path(trainer.step_artifact.directory) / "reports" / "parallel_auto.json").read_text())
        assert doc["chosen"] != "parameter server" and doc["link"]["source"] == "emulated"
    finally:
        trainer.close()


def test_tessel_train_runs_the_parameter_server_when_auto_chooses_it(tmp_path, monkeypatch):
    import onnx
    from onnx import TensorProto, helper

    import tessel
    from tessel.compiler import train_command
    from tessel.compiler.cli import main

    alternatives = _alternatives()
    ps = Alternative("parameter server", "ps", None, 1e-3, "measured", servers=2)
    first, second = _two_stages()
    timeline = simulate([first, second], lambda call: 1e-3, LINK, allreduce_s=LINK.seconds)

    def compile_training(*args, **kwargs):
        assert kwargs["auto_ps"] and kwargs["parallel"] == "auto"
        raise ParameterServerChosen(2, [alternatives[0], ps], ps, LINK, "given", 2, timeline)

    ran = {}

    def run_ps(settings, run_dir, data, val, steps_per_epoch, first_output, args):
        ran.update(parallel=settings.parallel, servers=args.servers, run_dir=run_dir)
        return 0

    monkeypatch.setattr(tessel, "compile_training", compile_training)
    monkeypatch.setattr(train_command, "run_ps", run_ps)
    model = tmp_path / "linear.onnx"
    weight = helper.make_tensor("w", TensorProto.FLOAT, [3, 2], [0.1] * 6)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "linear",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    x = np.ones((4, 3), np.float32)
    np.savez(tmp_path / "data.npz", x=x, labels=np.zeros((4, 2), np.float32))
    run = tmp_path / "run"
    assert main(["train", str(model), "--data", str(tmp_path / "data.npz"), "--loss", "mse", "--lr", "0.05",
                 "--batch", str(len(x)), "--epochs", "1", "--devices", "2", "--parallel", "auto", "-o", str(run)]) == 0
    assert ran == {"parallel": "ps", "servers": 2, "run_dir": run}
    assert "| parameter server **(chosen)** | 1.000 ms |" in (run / "reports" / "parallel_auto.md").read_text()
