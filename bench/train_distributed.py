"""Data-parallel training throughput, one core per worker: Tessel against PyTorch DistributedDataParallel (gloo).

    flock /tmp/tessel_heavy.lock python bench/train_distributed.py [MODEL ...] [--workers 2] [--repeats 2]
                                 [--steps S] [--image-size 224] [--batch 32] [--allreduce auto]

For each model (bench/training_models.py; ResNet-18 at batch 32, the transformer block at batch 256 unless --batch
says otherwise) both engines train with SGD (momentum 0.9) on the same batch, on 1 worker and on N workers
(the batch split evenly), every worker with one thread (torch.set_num_threads(1), Tessel threads=1). Every timing
run is a process of its own (DDP: N processes in a gloo group on 127.0.0.1); the runs alternate (DDP, Tessel,
DDP, Tessel, ...) for --repeats rounds, each round's median step time (after warm-up) enters the median of the
rounds. Tessel's steps are compiled once beforehand and loaded by each timing run, so compiles are not timed.

Tessel's predicted step time is its own cost model: the kernels' measured time for one replica's step (a
one-worker compile at the replica's batch, timed kernel by kernel on the native host) plus the batch's delivery
(the client writes each worker its slice in turn: a linear scatter over the link) and the gradient buckets' all-reduce under the α-β link measured first (runtime/calibrate.py's ping-pong and fit,
not stored), each bucket all-reduced by the algorithm passes/data_parallel.py chooses (every algorithm's cost is
printed) or, where the local workers all-reduce through shared memory (the default), at that all-reduce's own
measured α-β (runtime/shared_reduce_link.py, measured first, not stored), issued as backward produces it (backward taken as the last 2/3 of the
step's kernel time, its progress as the share of gradient bytes done) and overlapped with the rest of backward.
The table gives the predicted and the measured time and the error, and how long each worker's threads waited
for a core per step (runnable but not running, /proc/PID/task/*/schedstat; DDP: rank 0's): on a shared machine
that is other programs' load, which the prediction cannot know and which a 2-vs-1 comparison must not contain.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from bench.train import _batch_spec, _median  # noqa: E402

BENCH_MODELS = {"resnet18": 32, "transformer_block": 256}  # model -> whole batch
BENCH_STEPS = {"resnet18": 3, "transformer_block": 30}  # model -> timed steps per run (ResNet-18's take seconds)
DEFAULT_IMAGE_SIZE = 224
LR, MOMENTUM = 0.01, 0.9
WARMUP_STEPS = 2
WORKER_TIMEOUT_S = 1800
# Share of a training step's kernel time spent in the forward pass (backward: about twice the forward's FLOPs).
FORWARD_SHARE = 1 / 3


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
    """Compile the step (SGD with momentum) of `batch` on `workers` workers into `directory`; for several, the bytes
    of each all-reduce in issue order."""
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
    trainer.save(str(directory))
    if workers > 1:
        report = json.loads((Path(trainer.step_artifact.directory) / "reports" / "data_parallel.json").read_text())
        result["buckets"] = [r["nbytes"] for r in report["allreduces"]]
    trainer.close()
    return result


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


def worker_tessel(name: str, batch: int, image_size: int, steps: int, directory: str) -> dict:
    """Tessel: the compiled step loaded from `directory`, here on one thread, or on the session's workers (each
    with the cores shared among them: one on a 2-core machine, the one this bench is for). A one-worker step also
    gives its kernels' seconds (timed call by call on the native host, `steps` runs)."""
    import numpy as np

    import tessel
    from tessel.backends.tvm_env import set_threads

    set_threads(1)
    trainer = tessel.load_training(directory)
    batches = _batches(name, batch, image_size, 4)
    try:
        pids = trainer._step._session.worker_pids if trainer.workers > 1 else None
        result = _timed(lambda x, y: trainer.step({"x": x}, y), batches, steps, pids)
        if trainer.workers == 1:
            executor = trainer._step
            x, labels = batches[0]
            feeds = {"x": x, trainer.names.label_input: labels, **trainer.optimizer.step_scalars(0)}
            types = executor.input_types
            feeds = {k: np.asarray(a, dtype=str(types[k].dtype)).reshape(types[k].shape) for k, a in feeds.items()}
            result["kernel_s"] = _median(executor.kernel_times(feeds, steps))
        return result
    finally:
        trainer.close()


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


def allreduce_seconds(bucket, transport) -> float:
    """A bucket's all-reduce seconds: by the shared-memory all-reduce's fit when the workers run it, else by the
    gloo link's algorithm."""
    return transport.seconds(bucket.nbytes) if transport is not None else bucket.costs[bucket.algorithm]


def predicted_seconds(kernel_s: float, buckets: list, link, workers: int, input_bytes: int, transport=None) -> float:
    """Predicted data-parallel step time: the batch's slices delivered in turn, one replica's kernels, and each
    bucket's all-reduce issued once backward produced it (progress taken as the share of gradient bytes done),
    the link doing one at a time; the step ends when both the kernels and the last all-reduce are done."""
    from tessel.passes.collectives import scatter_linear

    total = sum(b.nbytes for b in buckets) or 1
    done_bytes, link_free = 0, 0.0
    for bucket in buckets:
        done_bytes += bucket.nbytes
        ready = kernel_s * (FORWARD_SHARE + (1 - FORWARD_SHARE) * done_bytes / total)
        link_free = max(link_free, ready) + allreduce_seconds(bucket, transport)
    return scatter_linear(link, workers, input_bytes) + max(kernel_s, link_free)


def bench_model(name: str, batch: int, image_size: int, workers: int, repeats: int, steps: int, scratch: Path,
                allreduce: str, link, transport=None) -> dict:
    """Compile, then alternate the engines' timing runs; medians, ratios and Tessel's prediction."""
    from tessel.passes.data_parallel import choose_allreduce

    common = [name, str(batch), str(image_size), str(steps)]
    plans = {}
    for count in (1, workers):
        plans[count] = _isolated(["compile", name, str(batch), str(image_size), str(count),
                                  str(scratch / f"{name}_{count}"), allreduce])
    _isolated(["compile", name, str(batch // workers), str(image_size), "1", str(scratch / f"{name}_replica"),
               allreduce])
    runs: dict[tuple[str, int], list[float]] = {}
    queued: dict[tuple[str, int], list[float]] = {}
    kernels: dict[int, list[float]] = {1: [], workers: []}
    for _ in range(repeats):
        for count in (1, workers):
            timed = _isolated(["ddp", *common], ranks=count)
            runs.setdefault(("ddp", count), []).append(_median(timed["seconds"]))
            queued.setdefault(("ddp", count), []).append(timed["queued_s"])
            timed = _isolated(["tessel", *common, str(scratch / f"{name}_{count}")])
            runs.setdefault(("tessel", count), []).append(_median(timed["seconds"]))
            queued.setdefault(("tessel", count), []).append(timed["queued_s"])
            if count == 1:
                kernels[1].append(timed["kernel_s"])
        # One replica's kernels: the one-worker step at the replica's batch (the same kernels as each worker's).
        kernels[workers].append(_isolated(["tessel", name, str(batch // workers), str(image_size), str(steps),
                                           str(scratch / f"{name}_replica")])["kernel_s"])
    spec = _batch_spec(name, batch, image_size)
    input_bytes = batch * (4 * math.prod(spec.input_shape[1:]) + 8)  # float32 samples, int64 labels
    measured = {key: _median(values) for key, values in runs.items()}
    buckets = [choose_allreduce(link, workers, nbytes, allreduce) for nbytes in plans[workers]["buckets"]]
    predicted = {1: _median(kernels[1]),
                 workers: predicted_seconds(_median(kernels[workers]), buckets, link, workers, input_bytes,
                                            transport)}
    return {"model": name, "batch": batch, "workers": workers, "measured": measured, "predicted": predicted,
            "buckets": buckets, "link": link, "transport": transport,
            "queued": {key: _median(values) for key, values in queued.items()}}


def _table(results: list[dict]) -> str:
    lines = ["| model | batch | engine | workers | ms/step | samples/s | N vs 1 worker | Tessel/DDP (throughput) | "
             "Tessel predicted ms | error | waited for a core, ms/step/worker |", "|" + " --- |" * 11]
    for r in results:
        m, workers, batch = r["measured"], r["workers"], r["batch"]
        for engine in ("ddp", "tessel"):
            for count in (1, workers):
                seconds = m[(engine, count)]
                scaling = m[(engine, 1)] / seconds
                versus = m[("ddp", count)] / m[("tessel", count)]
                if engine == "tessel":
                    guess = r["predicted"][count]
                    prediction = f"{1e3 * guess:.1f} | {100 * (guess - seconds) / seconds:+.1f}%"
                else:
                    prediction = "- | -"
                lines.append(f"| {r['model']} | {batch} | {'Tessel' if engine == 'tessel' else 'PyTorch DDP'} | "
                             f"{count} | {1e3 * seconds:.1f} | {batch / seconds:.1f} | {scaling:.2f}x | "
                             f"{versus:.2f}x | {prediction} | {1e3 * r['queued'][(engine, count)]:.2f} |")
    return "\n".join(lines)


def _allreduce_lines(results: list[dict]) -> str:
    lines = []
    for r in results:
        link = r["link"]
        transport = r["transport"]
        lines.append(f"{r['model']}: link alpha {1e6 * link.alpha:.1f} us, beta {1e9 * link.beta:.3f} ns/byte; "
                     f"{len(r['buckets'])} all-reduce(s) per step:")
        lines += [f"  {bucket.describe()}" for bucket in r["buckets"]]
        if transport is not None:
            lines.append(f"  run through shared memory (alpha {1e6 * transport.alpha:.1f} us, beta "
                         f"{1e9 * transport.beta:.3f} ns/byte): " + ", ".join(
                             f"{1e3 * transport.seconds(b.nbytes):.3f} ms" for b in r["buckets"]))
    return "\n".join(lines)


def _worker_main(argv: list[str]) -> int:
    kind, name, batch, image_size, *rest = argv
    batch, image_size = int(batch), int(image_size)
    if kind == "compile":
        result = compile_tessel(name, batch, image_size, int(rest[0]), Path(rest[1]), rest[2])
    elif kind == "ddp":
        result = worker_ddp(name, batch, image_size, int(rest[0]))
    else:
        result = worker_tessel(name, batch, image_size, int(rest[0]), rest[1])
    print(json.dumps(result))
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
    if unknown or args.workers < 2:
        print(f"train_distributed: unknown model(s) {', '.join(unknown)}" if unknown else
              "train_distributed: --workers must be at least 2", file=sys.stderr)
        return 2
    link = measure_link(args.link_repeats)
    transport = measure_transport(args.workers, args.link_repeats)
    results = []
    with tempfile.TemporaryDirectory(prefix="tessel-dp-bench-") as scratch:
        for name in args.models:
            batch = args.batch or BENCH_MODELS[name]
            if batch % args.workers:
                print(f"train_distributed: batch {batch} does not split over {args.workers} workers", file=sys.stderr)
                return 2
            results.append(bench_model(name, batch, args.image_size, args.workers, args.repeats,
                                       args.steps or BENCH_STEPS[name],
                                       Path(scratch), args.allreduce, link, transport))
    print(_table(results))
    print(_allreduce_lines(results))
    if args.json:
        print(json.dumps([{**r, "measured": {f"{e}_{n}": s for (e, n), s in r["measured"].items()},
                           "queued": {f"{e}_{n}": s for (e, n), s in r["queued"].items()},
                           "buckets": [asdict(b) for b in r["buckets"]], "link": asdict(r["link"]),
                           "transport": asdict(r["transport"]) if r["transport"] else None}
                          for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
