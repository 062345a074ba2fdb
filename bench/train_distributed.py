"""Data-parallel training throughput, one core per worker: Tessel against PyTorch DistributedDataParallel (gloo).

    flock /tmp/tessel_heavy.lock python bench/train_distributed.py [MODEL ...] [--workers 2] [--repeats 2]
                                 [--steps S] [--image-size 224] [--batch 32] [--allreduce auto]

For each model (bench/training_models.py; ResNet-18 at batch 32, the transformer block at batch 1024 unless --batch
says otherwise: a step of tens of milliseconds, so that a time slice does not decide it) both engines train with SGD
(momentum 0.9) on the same batch, on 1 worker and on N workers (the batch split evenly), every worker with one
thread (torch.set_num_threads(1), Tessel threads=1). Every timing run is a process of its own (DDP: N processes in a
gloo group on 127.0.0.1); the runs alternate (DDP, Tessel, DDP, Tessel, ...) for --repeats rounds, and each engine
and worker count keeps its fastest round's median step time (after warm-up): the minimum of several medians, the
same for both engines, as bench/latency.py keeps them. This machine is shared, and a round some other program took
cores from is slower by that program's load, which neither engine nor the prediction is about; every round's median
is printed beside it. Tessel's steps are compiled once beforehand and loaded by each timing run, so compiles are not
timed.

Tessel's predicted step time is the compiler's own (compiler/parallel_auto.py `predict_data`, what
`--parallel auto` plans with), made at the start of each of its timing runs (the table gives the kept round's):
every worker's program played out (compiler/step_timeline.py) with its kernels' times on one thread (timed again
then, on this machine, inside the step's programs, all workers at once; compiler/step_kernels.py), the host's
measured share of a step (Trainer.host_s: the feeds, the batch's slices on their way, the answer), and each
all-reduce at the α-β of the transport the workers use: the shared-memory all-reduce (runtime/shared_reduce_link.py)
or gloo over the loopback link (runtime/calibrate.py), both measured first by this bench and not stored. Several
workers profile their timed steps (runtime/step_profile.py): the predicted and the measured phases per worker
(forward, backward, all-reduce beside them, waiting, update) are printed under the table. The table gives the
predicted and the measured step and the error, and how long each worker's threads waited for a core per step in the
round kept (runnable but not running, /proc/PID/task/*/schedstat; DDP: rank 0's): on a shared machine that is
other programs' load, which the prediction cannot know and which a 2-vs-1 comparison must not contain.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from bench.train import _batch_spec, _median  # noqa: E402

BENCH_MODELS = {"resnet18": 32, "transformer_block": 1024}  # model -> whole batch
BENCH_STEPS = {"resnet18": 5, "transformer_block": 20}  # model -> timed steps per run (ResNet-18's take seconds)
DEFAULT_IMAGE_SIZE = 224
LR, MOMENTUM = 0.01, 0.9
WARMUP_STEPS = 3
WORKER_TIMEOUT_S = 1800


def _export(name: str, batch: int, image_size: int, path: Path) -> Path:
    """The model as ONNX with a symbolic batch axis: a data-parallel replica re-imports it at its own batch, and
    reshapes that name the batch (the transformer block's heads) must follow."""
    import torch

    spec = _batch_spec(name, batch, image_size)
    model = spec.model(0).eval()
    torch.onnx.export(model, (torch.zeros(spec.input_shape),), str(path), dynamo=False, do_constant_folding=False,
                      input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    return path


def compile_tessel(name: str, batch: int, image_size: int, workers: int, directory: Path, allreduce: str) -> dict:
    """Compile the step (SGD with momentum) of `batch` on `workers` workers into `directory`; for several workers,
    the bytes of each all-reduce in issue order."""
    import tessel
    from tessel.backends.tvm_env import set_threads

    set_threads(1)
    spec = _batch_spec(name, batch, image_size)
    path = _export(name, batch, image_size, directory.parent / f"{directory.name}.onnx")
    started = time.perf_counter()
    trainer = tessel.compile_training(str(path), loss=spec.loss, optimizer=tessel.optim.SGD(LR, momentum=MOMENTUM),
                                      input_shapes={"x": spec.input_shape}, devices=workers,
                                      **({"allreduce": allreduce} if workers > 1 else {}))
    result = {"compile_s": time.perf_counter() - started}
    try:
        trainer.save(str(directory))
        if workers > 1:
            report = json.loads((Path(trainer.step_artifact.directory) / "reports" / "data_parallel.json").read_text())
            result["buckets"] = [r["nbytes"] for r in report["allreduces"]]
    finally:
        trainer.close()
    return result


def predicted_step(trainer, workers: int, allreduce: str, links: dict) -> dict:
    """The compiler's own prediction of the step (compiler/parallel_auto.py `predict_data`, what `--parallel auto`
    plans with): every worker's program played out with its kernels' times on one thread (timed inside the step's
    programs where the profile database lacks them: compiler/step_kernels.py), the host's measured share of a step
    (Trainer.host_s), and the all-reduces at the shared-memory all-reduce's α-β (`links`["transport"], else the gloo
    link's)."""
    from tessel.compiler.parallel_auto import Transport, predict_data
    from tessel.compiler.step_kernels import kernel_times
    from tessel.passes.machine import Link
    from tessel.runtime.instructions import KernelCall, program_from_json

    artifact = trainer.step_artifact
    calls = [(key, i.node) for w in artifact.plan["workers"] for i in program_from_json(w["instructions"])
             if isinstance(i, KernelCall) for key in i.kernel_keys()]
    # Timed again now (as `--reprofile`): the profile database may hold times measured under another load, up to
    # its age limit ago, and the prediction is to see the machine the timed steps see.
    times = kernel_times(Path(artifact.directory), artifact.plan, calls, threads=1, remeasure=True)
    link = Link(*links["link"], measured=True)
    transport = (Transport("shared memory", Link(*links["transport"], measured=True), "measured by this bench")
                 if links.get("transport") else None)
    alternative, timeline = predict_data(artifact, times, link, workers, allreduce, trainer.host_s(),
                                         transport)
    return {"predicted_s": alternative.predicted_s, "kernels": alternative.kernels, "host_s": alternative.host_s,
            "kernel_s": timeline.busy_s[0], "predicted_split": phase_seconds(timeline)}


def phase_seconds(timeline) -> list[dict]:
    """Seconds of each phase per worker in a step's timeline (compiler/step_timeline.py: forward, backward,
    update, waiting; the bars beside the kernels, all-reduces: how long at least one was in flight, not the sum of
    their overlapping spans, plus the phase's bars on the host), and the step's seconds."""
    split = [{"step": timeline.step_s} for _ in timeline.busy_s]
    beside: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for bar in timeline.bars:
        if bar.comm:
            beside.setdefault((bar.worker, bar.phase), []).append((bar.start_s, bar.finish_s))
        else:
            split[bar.worker][bar.phase] = split[bar.worker].get(bar.phase, 0.0) + bar.finish_s - bar.start_s
    for (worker, phase), spans in beside.items():
        # Added to the phase's host bars (a transfer's host overhead beside its time on the link).
        split[worker][phase] = split[worker].get(phase, 0.0) + _covered_seconds(spans)
    return split


def _covered_seconds(spans: list[tuple[float, float]]) -> float:
    """Seconds the union of the (start, finish) spans covers."""
    total, end = 0.0, float("-inf")
    for start, finish in sorted(spans):
        if finish > end:
            total += finish - max(start, end)
            end = finish
    return total


def queued_seconds(pid: int) -> float:
    """Seconds the threads of process `pid` have spent runnable but waiting for a core (/proc/PID/task/*/schedstat):
    the machine's load, which a worker on a core of its own never sees."""
    return sum(int((task / "schedstat").read_text().split()[1]) for task in Path(f"/proc/{pid}/task").iterdir()) / 1e9


def _timed(step, batches, steps: int, pids: list[int] | None = None) -> dict:
    """The timed steps' seconds, and the mean seconds per step each of `pids` (default: this process) waited for a
    core during them."""
    pids = pids or [os.getpid()]
    for x, y in batches[:WARMUP_STEPS]:
        step(x, y)
    seconds, queued = [], [queued_seconds(pid) for pid in pids]
    for i in range(steps):
        x, y = batches[(WARMUP_STEPS + i) % len(batches)]
        started = time.perf_counter()
        step(x, y)
        seconds.append(time.perf_counter() - started)
    waited = sum(queued_seconds(pid) - before for pid, before in zip(pids, queued))
    return {"seconds": seconds, "queued_s": waited / len(pids) / steps}


def _batches(name: str, batch: int, image_size: int, count: int) -> list:
    import numpy as np

    spec = _batch_spec(name, batch, image_size)
    rng = np.random.default_rng(0)
    return [spec.batch(rng) for _ in range(count)]


def worker_tessel(name: str, batch: int, image_size: int, steps: int, directory: str, allreduce: str,
                  links: dict) -> dict:
    """Tessel: the compiled step loaded from `directory`, here on one thread, or on the session's workers (each
    with the cores shared among them: one on a 2-core machine, the one this bench is for). The compiler's
    prediction (`predicted_step`, its kernels timed again) is made first, in this run: the machine a round's
    steps see is the one its prediction saw. The timed steps run unprofiled (a profiled step sends every worker's
    spans to rank 0 before it answers: up to a millisecond more); with several workers a second session of
    profiling workers then runs the same steps, and each of its steps' measured phases per worker come back."""
    import tessel
    from tessel.backends.tvm_env import set_threads
    from tessel.compiler.measured_step import measured_timeline
    from tessel.runtime.step_profile import PROFILE_ENV

    set_threads(1)
    batches = _batches(name, batch, image_size, 4)

    def run(profiled: bool) -> tuple[dict, list, int]:
        """The timed steps, each timed step's measured phases per worker when `profiled`, and the workers."""
        if profiled:
            os.environ[PROFILE_ENV] = "1"
        else:
            os.environ.pop(PROFILE_ENV, None)
        trainer = tessel.load_training(directory)
        profiles = []

        def step(x, y):
            trainer.step({"x": x}, y)
            profiles.append(trainer.step_profile)

        try:
            pids = trainer._step._session.worker_pids if trainer.workers > 1 else None
            if not profiled:
                prediction = predicted_step(trainer, trainer.workers, allreduce, links)
            timed = _timed(step, batches, steps, pids)
            if not profiled:
                timed["prediction"] = prediction
            splits = [phase_seconds(measured_timeline(trainer.step_artifact.plan, profile))
                      for profile in profiles[WARMUP_STEPS:]] if profiled else []
            return timed, splits, trainer.workers
        finally:
            trainer.close()

    result, _, workers = run(profiled=False)
    if workers > 1:
        _, result["splits"], _ = run(profiled=True)
    return result


def worker_ddp(name: str, batch: int, image_size: int, steps: int) -> dict:
    """One rank of PyTorch's DistributedDataParallel over gloo (RANK, WORLD_SIZE, MASTER_* in the environment), on
    its slice of each batch; a plain model on one worker. Rank 0 reports the step times."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from bench.training_models import torch_train_step

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    spec = _batch_spec(name, batch, image_size)
    model = spec.model(0).train()
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    part = batch // world
    batches = [tuple(torch.from_numpy(a[rank * part:(rank + 1) * part]) for a in b)
               for b in _batches(name, batch, image_size, 4)]

    step = torch_train_step(spec.loss, model, optimizer)

    result = _timed(step, batches, steps)
    if world > 1:
        # Without a barrier a rank may tear the group down while its peer still talks to it: gloo then aborts
        # ("terminate called without an active exception") after the result was printed.
        dist.barrier()
        dist.destroy_process_group()
    return result


def _environment() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TVM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
            "TESSEL_THREADS": "1"}


def _ranks(command: list[str], ranks: int = 1) -> str:
    """Run `command` as `ranks` fresh processes in one gloo group on 127.0.0.1; rank 0's stdout."""
    from tessel.runtime.launch import free_port

    port = str(free_port())
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                  env={**_environment(), "RANK": str(rank), "WORLD_SIZE": str(ranks),
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
                 for rank in range(ranks)]
    outputs = [p.communicate(timeout=WORKER_TIMEOUT_S) for p in processes]
    failed = next((err for p, (_, err) in zip(processes, outputs) if p.returncode != 0), None)
    if failed is not None:
        raise RuntimeError(f"{' '.join(command[2:5])}: {(failed.strip().splitlines() or ['failed'])[-1][:300]}")
    return outputs[0][0]


def _isolated(argv: list[str], ranks: int = 1) -> dict:
    """This script's worker mode in fresh processes (`ranks` of them in one gloo group); rank 0's JSON line."""
    out = _ranks([sys.executable, str(Path(__file__).resolve()), "--worker", *argv], ranks)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{' '.join(argv[:2])}: no result")
    return json.loads(lines[-1])


def measure_link(repeat: int):
    """The link between two local workers, measured now as `tessel calibrate` does (runtime/calibrate.py's
    ping-pong and fit) but not stored: the shared calibration stays the machine owner's."""
    from tessel.passes.machine import Link
    from tessel.runtime.calibrate import fit_link

    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "samples.json"
        _ranks([sys.executable, "-m", "tessel.runtime.calibrate", str(result), str(repeat)], 2)
        samples = [tuple(s) for s in json.loads(result.read_text())]
    fit = fit_link(samples)
    print(f"link: {fit.describe()}")
    return Link(fit.alpha, fit.beta, measured=True)


def measure_transport(workers: int, repeat: int):
    """The local workers' shared-memory all-reduce (runtime/shared_reduce.py), measured now as `tessel calibrate`
    does (runtime/shared_reduce_link.py) but not stored; None when the workers all-reduce through gloo."""
    from tessel.passes.machine import Link
    from tessel.runtime.shared_reduce import available
    from tessel.runtime.shared_reduce_link import describe, measure_shared_reduce

    if not available():
        return None
    fit, _ = measure_shared_reduce(workers, repeat)
    print(f"shared-memory all-reduce on {workers} workers: {describe(fit)}")
    return Link(fit.alpha, fit.beta, measured=True)


def bench_model(name: str, batch: int, image_size: int, workers: int, repeats: int, steps: int, scratch: Path,
                allreduce: str, links: dict) -> dict:
    """Compile, then alternate the engines' timing runs (Tessel's each with the compiler's prediction); the kept
    medians, the kept rounds' predictions, and the ratios."""
    common = [name, str(batch), str(image_size), str(steps)]
    plans = {count: _isolated(["compile", name, str(batch), str(image_size), str(count),
                               str(scratch / f"{name}_{count}"), allreduce])
             for count in (1, workers)}
    runs: dict[tuple[str, int], list[dict]] = {}
    for _ in range(repeats):
        for count in (1, workers):
            for engine in ("ddp", "tessel"):
                argv = [engine, *common] + ([str(scratch / f"{name}_{count}"), allreduce, json.dumps(links)]
                                            if engine == "tessel" else [])
                runs.setdefault((engine, count), []).append(_isolated(argv, ranks=count if engine == "ddp" else 1))
    fastest = {key: min(rounds, key=lambda r: _median(r["seconds"])) for key, rounds in runs.items()}
    for count in (1, workers):
        plans[count].update(fastest[("tessel", count)]["prediction"])
    # The measured phases beside the prediction are the kept round's too.
    plans[workers]["measured_splits"] = fastest[("tessel", workers)].get("splits", [])
    return {"model": name, "batch": batch, "workers": workers, "plans": plans, "runs": runs,
            "measured": {key: _median(r["seconds"]) for key, r in fastest.items()},
            "queued": {key: r["queued_s"] for key, r in fastest.items()},
            "rounds": {key: [_median(r["seconds"]) for r in rounds] for key, rounds in runs.items()}}


def _table(results: list[dict]) -> str:
    lines = ["| model | batch | engine | workers | ms/step | samples/s | N vs 1 worker | Tessel/DDP (throughput) | "
             "Tessel predicted ms | error | waited for a core, ms/step/worker | every round's median, ms |",
             "|" + " --- |" * 12]
    for r in results:
        m, workers, batch = r["measured"], r["workers"], r["batch"]
        for engine in ("ddp", "tessel"):
            for count in (1, workers):
                seconds = m[(engine, count)]
                scaling = m[(engine, 1)] / seconds
                versus = m[("ddp", count)] / m[("tessel", count)]
                if engine == "tessel":
                    guess = r["plans"][count]["predicted_s"]
                    prediction = f"{1e3 * guess:.1f} | {100 * (guess - seconds) / seconds:+.1f}%"
                else:
                    prediction = "- | -"
                lines.append(f"| {r['model']} | {batch} | {'Tessel' if engine == 'tessel' else 'PyTorch DDP'} | "
                             f"{count} | {1e3 * seconds:.1f} | {batch / seconds:.1f} | {scaling:.2f}x | "
                             f"{versus:.2f}x | {prediction} | {1e3 * r['queued'][(engine, count)]:.2f} | "
                             f"{' / '.join(f'{1e3 * s:.1f}' for s in r['rounds'][(engine, count)])} |")
    return "\n".join(lines)


def _split_lines(results: list[dict]) -> str:
    """Per model: the compiler's predicted phases per worker, and the measured ones (median over the profiled
    steps of the kept round), with the client's step beside the workers' span (the rest: host, request and
    batch)."""
    lines = []
    for r in results:
        plan = r["plans"][r["workers"]]
        lines.append(f"{r['model']}: predicted {1e3 * plan['predicted_s']:.1f} ms ({plan['kernels']} kernel times, "
                     f"the host's share {1e3 * plan['host_s']:.2f} ms); one worker: kernels "
                     f"{1e3 * r['plans'][1]['kernel_s']:.1f} ms predicted")
        lines.append("  predicted, per worker: " + "; ".join(_phases(w) for w in plan["predicted_split"]))
        splits = plan["measured_splits"]
        if splits:
            merged = [{key: _median([s[w].get(key, 0.0) for s in splits]) for key in splits[0][w]}
                      for w in range(len(splits[0]))]
            lines.append("  measured (step profile), per worker: " + "; ".join(_phases(w) for w in merged))
    return "\n".join(lines)


def _phases(split: dict) -> str:
    return ", ".join(f"{key} {1e3 * value:.1f}" for key, value in split.items()) + " ms"


def _worker_main(argv: list[str]) -> int:
    kind, name, batch, image_size, *rest = argv
    batch, image_size = int(batch), int(image_size)
    if kind == "compile":
        result = compile_tessel(name, batch, image_size, int(rest[0]), Path(rest[1]), rest[2])
    elif kind == "ddp":
        result = worker_ddp(name, batch, image_size, int(rest[0]))
    else:
        result = worker_tessel(name, batch, image_size, int(rest[0]), rest[1], rest[2], json.loads(rest[3]))
    print(json.dumps(result), flush=True)
    if kind == "ddp":
        # gloo's threads still abort now and then while the interpreter tears the group down, after the barrier and
        # destroy_process_group ("terminate called without an active exception"): the result is out, so leave
        # without running destructors.
        os._exit(0)
    return 0


def main(argv=None) -> int:
    """Print the table."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return _worker_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(BENCH_MODELS), help=f"of {', '.join(BENCH_MODELS)}")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None, help="whole batch (default: per model)")
    parser.add_argument("--image-size", type=int, default=DEFAULT_IMAGE_SIZE)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default: per model)")
    parser.add_argument("--allreduce", default="auto", help="all-reduce algorithm: auto, gloo, ring, halving_doubling")
    parser.add_argument("--link-repeats", type=int, default=50, help="ping-pongs per message size")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in BENCH_MODELS]
    if unknown or args.workers < 2 or args.repeats < 1 or (args.steps is not None and args.steps < 1):
        print(f"train_distributed: unknown model(s) {', '.join(unknown)}" if unknown else
              "train_distributed: --workers must be at least 2, --repeats and --steps at least 1", file=sys.stderr)
        return 2
    link = measure_link(args.link_repeats)
    transport = measure_transport(args.workers, args.link_repeats)
    links = {"link": [link.alpha, link.beta],
             "transport": [transport.alpha, transport.beta] if transport is not None else None}
    results = []
    with tempfile.TemporaryDirectory(prefix="tessel-dp-bench-") as scratch:
        for name in args.models:
            batch = args.batch or BENCH_MODELS[name]
            if batch % args.workers:
                print(f"train_distributed: batch {batch} does not split over {args.workers} workers", file=sys.stderr)
                return 2
            results.append(bench_model(name, batch, args.image_size, args.workers, args.repeats,
                                       args.steps or BENCH_STEPS[name],
                                       Path(scratch), args.allreduce, links))
    print(_table(results))
    print(_split_lines(results))
    for r in results:
        buckets = r["plans"][args.workers]["buckets"]
        print(f"{r['model']}: {len(buckets)} all-reduce(s) a step, {sum(buckets) / 2**20:.2f} MiB in all")
    if args.json:
        print(json.dumps([{**r, "links": links, "measured": {f"{e}_{n}": s for (e, n), s in r["measured"].items()},
                           "queued": {f"{e}_{n}": s for (e, n), s in r["queued"].items()},
                           "rounds": {f"{e}_{n}": s for (e, n), s in r["rounds"].items()},
                           "runs": {f"{e}_{n}": runs for (e, n), runs in r["runs"].items()}}
                          for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
