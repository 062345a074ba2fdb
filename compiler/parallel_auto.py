"""compile_training(parallel="auto") and `tessel train --parallel auto`: train the way with the best predicted step.

On N > 1 workers the alternatives are data parallel (its buckets all-reduced by the chosen algorithm), pipeline
under GPipe and under 1F1B (the stage cut of compiler/pipeline_programs.py, `micro_batches` or, when not given,
`auto_micro_batches`), and the synchronous parameter server on 1 to N servers. Data parallel and GPipe are
compiled; each one's step is played out on its workers (compiler/step_timeline.py) with its kernels' times
(measured on this machine where possible, compiler/step_kernels.py) and the α-β link (`tessel calibrate`); a
local group's all-reduces are priced by the shared-memory all-reduce's own measured α-β when the group runs it
(runtime/shared_reduce_link.py). 1F1B replays GPipe's stage blocks in its own order, and is
compiled only when chosen. The parameter server's step is played out the same way on the data-parallel replica's
kernels, its pulls and pushes and the servers' updates (compiler/ps_timeline.py); it is chosen only where the
caller can run it (`tessel train`, which starts the servers: compile_training raises ParameterServerChosen).

The chosen step artifact's reports/parallel_auto.md and .json list every alternative's prediction and where its
kernel times came from, and reports/step_gantt.png/.svg draws the chosen step per worker. `record_measured` adds
the measured step time (median after warm-up), the prediction's error and, for a pipeline, the measured bubble.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from tessel.ir.types import TensorType
from tessel.passes.data_parallel import choose_allreduce
from tessel.passes.machine import Link
from tessel.passes.pipeline_schedule import GPIPE, ONE_F_ONE_B, bubble_fraction
from tessel.runtime.calibrate import measure_link
from tessel.runtime.instructions import KernelCall, program_from_json
from tessel.runtime.shared_reduce import available as shared_reduce_available
from tessel.runtime.shared_reduce_link import describe, load_shared_reduce_link, measure_shared_reduce

from .api import prepare_machine
from .measured_step import measured_timeline
from .options import CompileError, CompileOptions
from .plots.step_gantt import write_step_gantt
from .ps_timeline import simulate_ps
from .step_kernels import KernelTime, kernel_times
from .step_timeline import (ALLREDUCE, Timeline, WorkerProgram, forward_loss, replica_phases, reordered_stage,
                            simulate)

_log = logging.getLogger("tessel.compile")

REPORT = "parallel_auto"
GANTT = "step_gantt"
GANTT_MEASURED = "step_gantt_measured"
# Steps left out of the measured step time: the first ones fault pages in and warm the caches.
WARMUP_STEPS = 2
SHARED_MEMORY = "shared memory"
PARAMETER_SERVER = "parameter server"


@dataclass(frozen=True)
class Alternative:
    """One way to train a step on the workers and its predicted seconds (None: it cannot run, `note` says why)."""

    name: str
    parallel: str
    schedule: str | None
    predicted_s: float | None
    kernels: str = ""          # where the kernel times came from: "measured", "estimated", "k of n measured"
    host_s: float = 0.0        # the host's measured share of a step (Trainer.host_s; PS: the data-parallel one's)
    detail: str = ""
    runnable: bool = True
    note: str = ""
    bubble: dict = field(default_factory=dict)  # a pipeline's: stages, micro-batches, predicted and busy seconds
    servers: int = 0           # the parameter server's: how many servers


def auto_micro_batches(batch: int, stages: int) -> int:
    """Micro-batches for a pipeline of `stages` when none are given: the most up to 4 per stage that divide the
    batch (the bubble (K-1)/(M+K-1) shrinks with M; each micro-batch adds its kernels' fixed costs)."""
    return max(m for m in range(1, 4 * stages + 1) if batch % m == 0)


class ParameterServerChosen(CompileError):
    """compile_training(parallel="auto", auto_ps=True) predicted the parameter server fastest: no Trainer runs it
    (`tessel train` does, with server processes of its own). `servers` is the best server count; `write_reports`
    writes the auto report and the predicted step chart into a folder."""

    def __init__(self, servers: int, alternatives: Sequence[Alternative], chosen: Alternative, link: Link, where: str,
                 workers: int, timeline: Timeline):
        super().__init__(f"parallel auto: the parameter server with {servers} server(s) is predicted fastest "
                         f"({1e3 * chosen.predicted_s:.3f} ms a step); train it with `tessel train --parallel ps "
                         f"--servers {servers}`")
        self.servers = servers
        self._report = (alternatives, chosen, link, where, workers, timeline)

    def write_reports(self, reports: Path) -> None:
        """parallel_auto.json/.md and the predicted step chart into the folder `reports` (made if absent)."""
        alternatives, chosen, link, where, workers, timeline = self._report
        reports.mkdir(parents=True, exist_ok=True)
        write_report(reports, alternatives, chosen, link, where, workers)
        write_step_gantt(reports / GANTT, timeline, f"{chosen.name} on {workers} workers: one step, predicted "
                         f"({chosen.kernels} kernel times, α-β link)")


def compile_auto(compile_training, model, training: Mapping, options: Mapping, micro_batches: int, allreduce: str,
                 sync_batchnorm: bool, parameter_server: bool = False):
    """compile_training(parallel="auto") (compiler/trainer.py passes itself as `compile_training`, the training
    keywords as `training` and the compile options as `options`): the Trainer of the alternative with the best
    predicted step on options["devices"] workers, its reports written. With `parameter_server` (the caller can
    run it) the parameter server may be chosen too: then every Trainer is closed and ParameterServerChosen raised."""
    data = compile_training(model, allreduce=allreduce, sync_batchnorm=sync_batchnorm, **training, **options)
    devices = options.get("devices", 1)
    if devices < 2:
        _log.info("parallel auto: one device, nothing to choose")
        return data
    trainers = {"data": data}
    try:
        chosen, alternatives, timelines, link, where = _choose_and_compile(
            compile_training, model, training, options, micro_batches, allreduce, sync_batchnorm, trainers,
            parameter_server)
    except BaseException:
        for trainer in trainers.values():
            trainer.close()
        raise
    if chosen.parallel == "ps":
        for trainer in trainers.values():
            trainer.close()
        _log.info("parallel auto: %s (predicted %.3f ms a step)", chosen.name, 1e3 * chosen.predicted_s)
        raise ParameterServerChosen(chosen.servers, alternatives, chosen, link, where, devices, timelines[chosen.name])
    for name, trainer in trainers.items():
        if name != chosen.name:
            trainer.close()
    trainer = trainers[chosen.name]
    reports = Path(trainer.step_artifact.directory) / "reports"
    write_report(reports, alternatives, chosen, link, where, devices)
    write_step_gantt(reports / GANTT, timelines[chosen.name], f"{chosen.name} on {devices} workers: one step, "
                     f"predicted ({chosen.kernels} kernel times, α-β link)")
    _log.info("parallel auto: %s (predicted %.3f ms a step)", chosen.name, 1e3 * chosen.predicted_s)
    return trainer


def _choose_and_compile(compile_training, model, training: Mapping, options: Mapping, micro_batches: int,
                        allreduce: str, sync_batchnorm: bool, trainers: dict, parameter_server: bool):
    """Predict every alternative and compile the chosen one if it is not yet (`trainers` holds the data-parallel
    Trainer and gets every one compiled here, by name); (chosen, alternatives, timelines by name, link, where the
    link's α and β come from). A local group's shared-memory all-reduce is priced by its own measurement."""
    devices = options["devices"]
    data = trainers["data"]
    link, where = _measured(prepare_machine(CompileOptions.create(None, **options)).link)
    transport = allreduce_transport(devices)
    times = _step_kernel_times(data.step_artifact, devices, options.get("reprofile", False))
    alternative, timeline = predict_data(data.step_artifact, times, link, devices, allreduce, data.host_s(),
                                         transport)
    alternatives, timelines = [alternative], {"data": timeline}
    ps, ps_timeline = predict_ps(data.step_artifact, times, link, devices, data.names.parameters, alternative.host_s,
                                 parameter_server)
    alternatives.append(ps)
    if ps_timeline is not None:
        timelines[ps.name] = ps_timeline
    micro = micro_batches if micro_batches > 1 else auto_micro_batches(_whole_batch(data), devices)
    pipe, note = None, "sync_batchnorm: pipeline stages normalise per micro-batch"
    if not sync_batchnorm:
        try:
            pipe = compile_training(model, parallel="pipeline", micro_batches=micro, schedule=GPIPE, **training,
                                    **options)
            trainers[alternative_name(GPIPE)] = pipe
        except CompileError as exc:
            note = str(exc)
    pipe_times = (_step_kernel_times(pipe.step_artifact, devices, options.get("reprofile", False))
                  if pipe is not None else {})
    pipe_host_s = pipe.host_s() if pipe is not None else 0.0
    for schedule in (GPIPE, ONE_F_ONE_B):
        if pipe is None:
            alternative = Alternative(alternative_name(schedule), "pipeline", schedule, None, runnable=False, note=note)
        else:
            alternative, timelines[alternative_name(schedule)] = predict_pipeline(
                pipe.step_artifact, pipe_times, link, schedule, pipe_host_s)
        alternatives.append(alternative)
    chosen = choose(alternatives)
    if chosen.parallel == "pipeline" and chosen.name not in trainers:  # 1F1B: compiled only now (GPipe's kernels)
        trainers[chosen.name] = compile_training(model, parallel="pipeline", schedule=chosen.schedule,
                                                 micro_batches=micro, **training, **options)
    return chosen, alternatives, timelines, link, where


@dataclass(frozen=True)
class Transport:
    """How the local workers' all-reduces will run when not through gloo: the shared-memory all-reduce
    (runtime/shared_reduce.py) and its α-β cost, and where that cost comes from."""

    name: str
    link: Link
    source: str


def allreduce_transport(workers: int) -> Transport | None:
    """The shared-memory all-reduce's cost among `workers` local workers when their group will use it (see
    runtime/shared_reduce.py `available`): as `tessel calibrate` stored it, else measured now (a few seconds) and
    not stored. None when the group all-reduces through gloo (then the gloo link prices it)."""
    if not shared_reduce_available():
        return None
    stored = load_shared_reduce_link(workers)
    if stored is not None:
        return Transport(SHARED_MEMORY, stored, "measured by `tessel calibrate`")
    fit, _ = measure_shared_reduce(workers)
    _log.info("parallel auto: shared-memory all-reduce measured now (not stored; `tessel calibrate` stores it): %s",
              describe(fit))
    return Transport(SHARED_MEMORY, Link(fit.alpha, fit.beta, measured=True),
                     "measured now for this compile, not stored (`tessel calibrate` stores it)")


def _measured(link: Link) -> tuple[Link, str]:
    """(link, where it comes from): `link` when `tessel calibrate` (or the machine file) measured it; else the link
    measured now, as `tessel calibrate` does but not stored (the default's latency can be several times off, and
    messages are what the alternatives differ in)."""
    if link.measured:
        return link, "measured by `tessel calibrate` or the machine file"
    fit, _ = measure_link()
    _log.info("parallel auto: link measured now (not stored; `tessel calibrate` stores it): %s", fit.describe())
    return Link(fit.alpha, fit.beta, measured=True), \
        "measured now for this compile, not stored (`tessel calibrate` stores it)"


def alternative_name(schedule: str) -> str:
    """The name a pipeline alternative goes by in the report."""
    return f"pipeline {schedule}"


def choose(alternatives: Sequence[Alternative]) -> Alternative:
    """The runnable alternative with the least predicted step; CompileError when none can run."""
    runnable = [a for a in alternatives if a.runnable and a.predicted_s is not None]
    if not runnable:
        raise CompileError("parallel auto: no alternative can run: " + "; ".join(f"{a.name}: {a.note}"
                                                                                for a in alternatives))
    return min(runnable, key=lambda a: a.predicted_s)


# ---- predictions -------------------------------------------------------------------------------------------
def predict_data(artifact, times: Mapping[str, KernelTime], link: Link, workers: int, allreduce: str,
                 host_s: float, transport: Transport | None = None) -> tuple[Alternative, Timeline]:
    """The data-parallel step and its timeline: the host's measured share of a step (`host_s`, Trainer.host_s: the
    feeds made, the batch's slices on their way into the local workers, the answer back), then every replica's
    program with its all-reduces overlapping backward, each priced by `transport` when the group all-reduces
    through shared memory, else by the gloo `link` and its algorithm."""
    plan = artifact.plan
    programs = [program_from_json(w["instructions"]) for w in plan["workers"]]
    loss = forward_loss(plan)
    algorithms = set()

    def allreduce_s(nbytes: int) -> float:
        if transport is not None:
            algorithms.add(f"{transport.name}, {transport.source}")
            return transport.link.seconds(nbytes)
        choice = choose_allreduce(link, workers, nbytes, allreduce)
        algorithms.add(choice.algorithm)
        return choice.costs[choice.algorithm]

    replicas = [WorkerProgram(p, replica_phases(p, loss), w["values"]) for p, w in zip(programs, plan["workers"])]
    timeline = simulate(replicas, _kernel_seconds(times), link, allreduce_s, host_s)
    buckets = sum(1 for bar in timeline.bars if bar.worker == 0 and bar.phase == ALLREDUCE)
    detail = f"{buckets} all-reduce(s) a step ({', '.join(sorted(algorithms))})"
    return Alternative("data", "data", None, timeline.step_s, _source(times), host_s, detail), timeline


def predict_pipeline(artifact, times: Mapping[str, KernelTime], link: Link, schedule: str,
                     host_s: float) -> tuple[Alternative, Timeline | None]:
    """A pipeline step under `schedule` and its timeline (None when it cannot run), from a compile under any
    schedule (its stage blocks replayed in `schedule`'s order), after the host's measured cost of a step's request
    `host_s` (Trainer.host_s: the micro-batches on their way into the first stage, the answer back)."""
    plan = artifact.plan
    pipe = plan["pipeline"]
    stages, micro = pipe["stages"], pipe["micro_batches"]
    workers = []
    for s, (worker, runs) in enumerate(zip(plan["workers"], pipe["phases"])):
        instructions, phases = reordered_stage(program_from_json(worker["instructions"]), runs, schedule, stages,
                                               micro, s)
        workers.append(WorkerProgram(instructions, phases, worker["values"]))
    try:
        timeline = simulate(workers, _kernel_seconds(times), link, link.seconds, host_s)
    except ValueError as exc:
        return Alternative(alternative_name(schedule), "pipeline", schedule, None, _source(times), host_s,
                           runnable=False, note=str(exc)), None
    bubble = {"stages": stages, "micro_batches": micro, "predicted": bubble_fraction(stages, micro),
              "simulated": _bubble(timeline.busy_s, timeline.step_s), "busy_s": timeline.busy_s}
    detail = (f"{stages} stages, {micro} micro-batches; bubble (K-1)/(M+K-1) {100 * bubble['predicted']:.1f}%, "
              f"in the played-out step {100 * bubble['simulated']:.1f}%")
    return Alternative(alternative_name(schedule), "pipeline", schedule, timeline.step_s, _source(times), host_s,
                       detail, bubble=bubble), timeline


def predict_ps(artifact, times: Mapping[str, KernelTime], link: Link, workers: int, parameters: Sequence[str],
               host_s: float, runnable: bool) -> tuple[Alternative, Timeline | None]:
    """The synchronous parameter-server step and its timeline, played out (compiler/ps_timeline.py) on 1 to
    `workers` standalone servers, the fastest kept: after the host's share of a step (`host_s`, the data-parallel
    workers', as a like-for-like fixed cost; no slices are sent, its workers read their own rows of the data),
    each worker pulls the weights of `parameters`, runs one replica's forward and backward kernels and pushes the
    gradients; each server updates its shard.
    `runnable`: whether the caller can run a parameter server (`tessel train` can, with server processes of its
    own)."""
    plan = artifact.plan
    worker = plan["workers"][0]
    sizes = [_input_bytes(worker, [name]) for name in parameters]
    if not any(sizes):
        return Alternative(PARAMETER_SERVER, "ps", None, None, runnable=False, note="no parameters to serve"), None
    program = program_from_json(worker["instructions"])
    replica = WorkerProgram(program, replica_phases(program, forward_loss(plan)), worker["values"])
    played = {servers: simulate_ps(replica, workers, sizes, servers, _kernel_seconds(times), link, host_s)
              for servers in range(1, min(workers, sum(1 for size in sizes if size)) + 1)}
    servers = min(played, key=lambda count: played[count].step_s)
    note = "" if runnable else "runs through `tessel train --parallel ps` or `--parallel auto` (server processes)"
    return Alternative(PARAMETER_SERVER, "ps", None, played[servers].step_s, _source(times), host_s,
                       f"{servers} server(s), sync, no compression", runnable=runnable, note=note,
                       servers=servers), played[servers]


def _bubble(busy_s: Sequence[float], step_s: float) -> float:
    """The share of a step the stages idle on average."""
    return max(0.0, 1 - statistics.fmean(busy_s) / step_s) if step_s > 0 and busy_s else 0.0


def _kernel_seconds(times: Mapping[str, KernelTime]):
    """A kernel call's seconds (its pieces' when it runs in pieces) by `times`."""

    def seconds(call: KernelCall) -> float:
        keys = [piece.kernel for piece in call.pieces] if call.pieces else [call.kernel]
        return sum(times[k].seconds for k in keys)

    return seconds


def _step_kernel_times(artifact, workers: int, remeasure: bool) -> dict[str, KernelTime]:
    """Every kernel the step's workers call, timed with each worker's share of the cores (all again when
    `remeasure`: `--reprofile`)."""
    calls = [(key, i.node) for w in artifact.plan["workers"] for i in program_from_json(w["instructions"])
             if isinstance(i, KernelCall) for key in i.kernel_keys()]
    threads = max(1, (os.cpu_count() or 1) // workers)
    return kernel_times(Path(artifact.directory), artifact.plan, calls, threads, remeasure=remeasure)


def _source(times: Mapping[str, KernelTime]) -> str:
    """Where the kernel times came from, for the report: measured, estimated, or how many were measured."""
    measured = sum(t.measured for t in times.values())
    if measured == len(times):
        return "measured"
    return "estimated" if measured == 0 else f"{measured} of {len(times)} measured"


def _input_bytes(worker: Mapping, names: Sequence[str]) -> int:
    """Bytes of the values `names` of a worker's plan section (those it has)."""
    return sum(TensorType.parse(worker["values"][n]).nbytes for n in names if n in worker["values"])


def _whole_batch(trainer) -> int:
    """The whole batch a data-parallel trainer steps on: its workers' slices together."""
    worker = trainer.step_artifact.plan["workers"][0]
    return TensorType.parse(worker["values"][trainer.names.data_inputs[0]]).shape[0] * trainer.workers


# ---- report ------------------------------------------------------------------------------------------------
def write_report(reports: Path, alternatives: Sequence[Alternative], chosen: Alternative, link: Link, where: str,
                 workers: int, measured: Mapping | None = None) -> None:
    """reports/parallel_auto.json and .md: the link (`where` its α and β come from), every alternative's
    prediction, the choice, and (after training) the measured step."""
    doc = {"workers": workers, "chosen": chosen.name,
           "link": {"alpha_s": link.alpha, "beta_s_per_byte": link.beta, "source": where},
           "alternatives": [asdict(a) for a in alternatives], "measured": dict(measured or {})}
    (reports / f"{REPORT}.json").write_text(json.dumps(doc, indent=1))
    (reports / f"{REPORT}.md").write_text(report_markdown(doc))


def report_markdown(doc: Mapping) -> str:
    """The markdown of a parallel_auto.json document."""
    link = doc["link"]
    lines = [f"# Parallel training: auto on {doc['workers']} workers", "",
             f"Link α {1e6 * link['alpha_s']:.1f} µs, β {1e9 * link['beta_s_per_byte']:.3f} ns/byte "
             f"({link['source']}).", "",
             "| alternative | predicted step | kernel times | host's share of a step (measured) | detail |",
             "|---|---|---|---|---|"]
    for a in doc["alternatives"]:
        mark = " **(chosen)**" if a["name"] == doc["chosen"] else ""
        predicted = "-" if a["predicted_s"] is None else f"{1e3 * a['predicted_s']:.3f} ms"
        detail = "; ".join(part for part in (a["detail"], a["note"]) if part)
        host = f"{1e3 * a['host_s']:.3f} ms" if a["host_s"] else "-"
        lines.append(f"| {a['name']}{mark} | {predicted} | {a['kernels'] or '-'} | {host} | {detail} |")
    lines += ["", f"Chosen: **{doc['chosen']}** (the least predicted step of those that can run here). "
              f"Step chart: {GANTT}.png (predicted)."]
    measured = doc.get("measured") or {}
    if measured:
        lines += ["", "## Measured", "",
                  f"- step: {1e3 * measured['step_s']:.3f} ms (median of {measured['steps']} steps after "
                  f"{measured['warmup']} warm-up); predicted {1e3 * measured['predicted_s']:.3f} ms, "
                  f"error {100 * measured['error']:+.1f}%"]
        if "chart" in measured:
            lines.append(f"- step chart: {measured['chart']} (measured: the workers' step profile of the last step)")
        if "bubble" in measured:
            b = measured["bubble"]
            source = ("its profiled run spans less their waits / the profiled step" if b.get("busy") == "profiled"
                      else "from its measured kernel times / the measured step")
            lines.append(f"- pipeline bubble: measured {100 * b['measured']:.1f}% (1 − each stage's busy time "
                         f"{source}, averaged over stages), predicted "
                         f"(K−1)/(M+K−1) {100 * b['predicted']:.1f}%, in the played-out step "
                         f"{100 * b['simulated']:.1f}%")
    return "\n".join(lines) + "\n"


def record_measured(reports: Path, step_seconds: Sequence[float], warmup: int = WARMUP_STEPS,
                    timeline: Timeline | None = None) -> dict:
    """Add the measured step (the median of `step_seconds` after `warmup` steps, all of them when there are not
    more), the prediction's error and a pipeline's measured bubble to reports/parallel_auto.json and .md; the
    measured entry. With `timeline` (a step the workers profiled, compiler/measured_step.py) the measured step
    chart is drawn (reports/step_gantt_measured.png/.svg) and the bubble comes from the stages' profiled busy
    time; without, from their predicted busy time over the measured step."""
    path = Path(reports) / f"{REPORT}.json"
    doc = json.loads(path.read_text())
    timed = list(step_seconds[warmup:]) if len(step_seconds) > warmup else list(step_seconds)
    step = statistics.median(timed)
    chosen = next(a for a in doc["alternatives"] if a["name"] == doc["chosen"])
    measured = {"step_s": step, "steps": len(timed), "warmup": len(step_seconds) - len(timed),
                "predicted_s": chosen["predicted_s"], "error": (chosen["predicted_s"] - step) / step}
    if timeline is not None:
        write_step_gantt(Path(reports) / GANTT_MEASURED, timeline, f"{chosen['name']}: one step, measured "
                         "(the workers' step profile)")
        measured["chart"] = f"{GANTT_MEASURED}.png"
    if chosen["parallel"] == "pipeline":
        bubble = chosen["bubble"]
        busy = ("profiled", _bubble(timeline.busy_s, timeline.step_s)) if timeline is not None else \
            ("predicted", _bubble(bubble["busy_s"], step))
        measured["bubble"] = {"measured": busy[1], "busy": busy[0], "predicted": bubble["predicted"],
                              "simulated": bubble["simulated"]}
    doc["measured"] = measured
    path.write_text(json.dumps(doc, indent=1))
    (Path(reports) / f"{REPORT}.md").write_text(report_markdown(doc))
    return measured


def record_run(run_dir: Path, trainer, step_seconds: Sequence[float]) -> dict | None:
    """After `tessel train --parallel auto`: RUN_DIR/reports gets the chosen step artifact's parallel_auto
    report and step chart, with the measured step added (`record_measured`), and RUN_DIR/run.json the choice, the
    predictions and the measured step. None (nothing written) when the trainer's step was not chosen by auto (one
    device) or no step ran."""
    source = Path(trainer.step_artifact.directory) / "reports"
    reports = Path(run_dir) / "reports"
    if not step_seconds or not ((source / f"{REPORT}.json").is_file() or (reports / f"{REPORT}.json").is_file()):
        return None
    reports.mkdir(exist_ok=True)
    for name in (f"{REPORT}.json", f"{REPORT}.md", f"{GANTT}.png", f"{GANTT}.svg"):
        if (source / name).is_file() and (source / name).resolve() != (reports / name).resolve():
            shutil.copyfile(source / name, reports / name)
    profile = trainer.step_profile
    timeline = measured_timeline(trainer.step_artifact.plan, profile) if profile else None
    measured = record_measured(reports, step_seconds, timeline=timeline)
    doc = json.loads((reports / f"{REPORT}.json").read_text())
    run_file = Path(run_dir) / "run.json"
    settings = json.loads(run_file.read_text())
    settings[REPORT] = {"chosen": doc["chosen"], "measured": measured,
                        "predicted_s": {a["name"]: a["predicted_s"] for a in doc["alternatives"]}}
    run_file.write_text(json.dumps(settings, indent=2) + "\n")
    return measured
