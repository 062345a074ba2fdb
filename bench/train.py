"""Training step time and memory: Tessel's compiled step against PyTorch eager (forward, loss, backward, SGD with
momentum), for ResNet-18 at batch 16, a transformer encoder block and an MLP (bench/training_models.py).

Each engine runs in a process of its own with the same thread count and the same batch; the processes alternate
(torch, tessel, torch, tessel, ...) for --repeats rounds so that a machine's slow phase hits both, and each round's
median step time (after warm-up steps) enters the median of the rounds. Tessel's step is compiled once, in a
process of its own beforehand, and loaded by each timing process (tessel.load_training), so neither the compile
nor its memory is counted.

Peak step memory counts tensor bytes, the same way for both engines: the persistent tensors (weights, BatchNorm
statistics, optimizer state) plus the most bytes a step holds at once on top of them. PyTorch's comes from its
profiler's allocation events over one step (after warm-up; gradients are set to None between steps, so they
count as the step's); Tessel's from the step's memory plan: its state plus the activation arena (inputs,
activations kept for backward, gradients, temporaries), and, as the planner's bound, its state plus the most
bytes live at once in the step's program.

With --memory-fraction F, Tessel's step is compiled for a device of F times the memory PyTorch's step peaked at
(measured first): the compile then recomputes activations in backward where the step would not fit
(passes/recompute.py), and the table shows what that costs in time.

    python bench/train.py [MODEL ...] [--threads N] [--repeats R] [--steps S] [--image-size 224]
                          [--memory-fraction 0.8] [--json]
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

BENCH_MODELS = {"resnet18": 16, "transformer_block": 16, "mlp": 16}  # model -> batch
DEFAULT_IMAGE_SIZE = 224  # ResNet-18's input height and width
LR = 0.01
MOMENTUM = 0.9
WARMUP_STEPS = 3
WORKER_TIMEOUT_S = 1800
MIB = 2**20


def _torch_step_peak(step, batch) -> int:
    """The most bytes PyTorch's allocator holds during one call of step(*batch) beyond what it held before: the
    largest "Total Allocated" of the profiler's allocation events (counted from the profile's start)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step(*batch)
    with tempfile.TemporaryDirectory() as scratch:
        trace = Path(scratch) / "trace.json"
        profiler.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    return max((e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"), default=0)


def _batch_spec(name: str, batch: int, image_size: int):
    """The model's spec at `batch` (and, for the CNNs, images of image_size x image_size)."""
    from dataclasses import replace

    from bench.training_models import SPECS

    spec = SPECS[name]
    sample = spec.input_shape[1:]
    if len(sample) == 3:
        sample = (sample[0], image_size, image_size)
    return replace(spec, input_shape=(batch,) + sample)


def _timed_steps(step, batches, steps: int) -> list[float]:
    """Warm-up, then `steps` timed calls of step(x, y): seconds per step."""
    for x, y in batches[:WARMUP_STEPS]:
        step(x, y)
    seconds = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        started = time.perf_counter()
        step(x, y)
        seconds.append(time.perf_counter() - started)
    return seconds


def worker_torch(name: str, batch: int, image_size: int, threads: int, steps: int) -> dict:
    """PyTorch eager: model.train(), zero_grad, forward, loss, backward, SGD step."""
    import numpy as np
    import torch

    from bench.training_models import torch_train_step

    torch.set_num_threads(threads)
    spec = _batch_spec(name, batch, image_size)
    model = spec.model().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    rng = np.random.default_rng(0)
    batches = [tuple(torch.from_numpy(a) for a in spec.batch(rng)) for _ in range(4)]

    step = torch_train_step(spec.loss, model, optimizer)

    seconds = _timed_steps(step, batches, steps)
    persistent = [*model.parameters(), *model.buffers(),
                  *(t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))]
    peak = sum(t.numel() * t.element_size() for t in persistent) + _torch_step_peak(step, batches[0])
    return {"seconds": seconds, "peak_bytes": peak}


def compile_tessel(name: str, batch: int, image_size: int, directory: Path, device_memory: int | None) -> dict:
    """Export the model and compile its training step (SGD with momentum) for a device of `device_memory` bytes
    (None: no limit), saved to `directory`."""
    import tessel
    from bench.training_models import export
    from tessel import optim

    spec = _batch_spec(name, batch, image_size)
    path = export(spec.model(), spec.input_shape, directory.parent / f"{name}.onnx")
    started = time.perf_counter()
    trainer = tessel.compile_training(str(path), loss=spec.loss, optimizer=optim.SGD(LR, momentum=MOMENTUM),
                                      input_shapes={"x": spec.input_shape}, device_memory=device_memory)
    compile_s = time.perf_counter() - started
    trainer.save(str(directory))
    memory = trainer.step_artifact.report()["memory"]
    state = sum(array.nbytes for array in trainer.state.values())
    return {"compile_s": compile_s, "state_bytes": state, "arena_bytes": memory["arena_bytes"],
            "bound_bytes": memory["bound_bytes"]}


def worker_tessel(name: str, batch: int, image_size: int, threads: int, steps: int, directory: str) -> dict:
    """Tessel: the compiled step loaded from `directory`, one Trainer.step per batch."""
    import numpy as np
    import torch

    import tessel
    from tessel.backends.tvm_env import set_threads

    torch.set_num_threads(threads)
    set_threads(threads)
    trainer = tessel.load_training(directory)
    rng = np.random.default_rng(0)
    spec = _batch_spec(name, batch, image_size)
    batches = [spec.batch(rng) for _ in range(4)]
    return {"seconds": _timed_steps(lambda x, y: trainer.step({"x": x}, y), batches, steps)}


def _isolated(argv: list[str], threads: int) -> dict:
    """Run this script's worker mode in a fresh process; its last JSON line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TESSEL_THREADS": str(threads), "TVM_NUM_THREADS": str(threads),
           "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", *argv], capture_output=True,
                          text=True, timeout=WORKER_TIMEOUT_S, cwd=ROOT, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["failed"])[-1]
        raise RuntimeError(f"{' '.join(argv[:2])}: {tail[:300]}")
    return json.loads(lines[-1])


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def bench_model(name: str, batch: int, image_size: int, threads: int, repeats: int, steps: int, scratch: Path,
                memory_fraction: float | None = None) -> dict:
    """Compile once (for `memory_fraction` of PyTorch's peak when given), then alternate the engines' timing
    processes: medians and peaks."""
    directory = scratch / name / "trainer"
    directory.parent.mkdir(parents=True)
    common = [name, str(batch), str(image_size), str(threads), str(steps)]
    runs = {"torch": [], "tessel": []}
    device_memory = "none"
    if memory_fraction is not None:
        runs["torch"].append(_isolated(["torch", *common], threads))
        device_memory = str(int(memory_fraction * runs["torch"][0]["peak_bytes"]))
    note = None
    try:
        plan = _isolated(["compile", *common, str(directory), device_memory], threads)
    except RuntimeError as exc:  # recomputation cannot bring the step under the budget: say so, measure unlimited
        if device_memory == "none":
            raise
        note, device_memory = str(exc), "none"
        plan = _isolated(["compile", *common, str(directory), device_memory], threads)
    for _ in range(repeats):
        if len(runs["torch"]) <= len(runs["tessel"]):
            runs["torch"].append(_isolated(["torch", *common], threads))
        runs["tessel"].append(_isolated(["tessel", *common, str(directory)], threads))
    shape = _batch_spec(name, batch, image_size).input_shape
    result = {"model": name, "batch": batch, "input_shape": list(shape), "threads": threads, **plan,
              "device_memory_bytes": None if device_memory == "none" else int(device_memory),
              **({"memory_fraction_unmet": note} if note else {})}
    for engine, measured in runs.items():
        result[f"{engine}_ms"] = 1e3 * _median([_median(m["seconds"]) for m in measured])
    result["torch_peak_bytes"] = max(m["peak_bytes"] for m in runs["torch"])
    result["tessel_peak_bytes"] = plan["state_bytes"] + plan["arena_bytes"]
    result["tessel_bound_bytes"] = plan["state_bytes"] + plan["bound_bytes"]
    result["time_ratio"] = result["tessel_ms"] / result["torch_ms"]
    result["memory_ratio"] = result["tessel_peak_bytes"] / result["torch_peak_bytes"]
    result["arena_vs_bound"] = result["arena_bytes"] / max(result["bound_bytes"], 1)
    return result


def _table(results: list[dict]) -> str:
    lines = ["| model | batch | PyTorch ms/step | Tessel ms/step | Tessel/PyTorch | PyTorch peak MiB | Tessel peak MiB "
             "| Tessel/PyTorch | Tessel bound MiB | arena/bound |", "|" + " --- |" * 10]
    for r in results:
        lines.append(f"| {r['model']} | {r['batch']} | {r['torch_ms']:.2f} | {r['tessel_ms']:.2f} | "
                     f"{r['time_ratio']:.2f}x | {r['torch_peak_bytes'] / MIB:.2f} | {r['tessel_peak_bytes'] / MIB:.2f} | "
                     f"{r['memory_ratio']:.2f}x | {r['tessel_bound_bytes'] / MIB:.2f} | {r['arena_vs_bound']:.2f}x |")
    return "\n".join(lines)


def geomean(values: list[float]) -> float:
    """The geometric mean."""
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _worker_main(argv: list[str]) -> int:
    kind, name, batch, image_size, threads, steps, *rest = argv
    batch, image_size, threads, steps = int(batch), int(image_size), int(threads), int(steps)
    if kind == "compile":
        result = compile_tessel(name, batch, image_size, Path(rest[0]), None if rest[1] == "none" else int(rest[1]))
    elif kind == "torch":
        result = worker_torch(name, batch, image_size, threads, steps)
    else:
        result = worker_tessel(name, batch, image_size, threads, steps, rest[0])
    print(json.dumps(result))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help=f"models (default: {', '.join(BENCH_MODELS)})")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of each engine (default: all cores)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of the two engines (default 3)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round (default 10)")
    parser.add_argument("--image-size", type=int, default=DEFAULT_IMAGE_SIZE,
                        help=f"ResNet-18's input height and width (default {DEFAULT_IMAGE_SIZE})")
    parser.add_argument("--memory-fraction", type=float, default=None,
                        help="compile Tessel's step for this fraction of PyTorch's measured peak (recomputing "
                             "activations to fit)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models) - set(BENCH_MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(BENCH_MODELS)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="tessel-bench-train-") as scratch:
        for name in args.models or list(BENCH_MODELS):
            results.append(bench_model(name, BENCH_MODELS[name], args.image_size, args.threads, args.repeats,
                                       args.steps, Path(scratch), args.memory_fraction))
            print(f"{name}: Tessel {results[-1]['tessel_ms']:.2f} ms/step, PyTorch {results[-1]['torch_ms']:.2f} ms/step",
                  file=sys.stderr, flush=True)
    for r in results:
        if "memory_fraction_unmet" in r:
            print(f"{r['model']}: compiled without a memory limit: {r['memory_fraction_unmet']}", file=sys.stderr)
    time_geomean = geomean([r["time_ratio"] for r in results])
    memory_geomean = geomean([r["memory_ratio"] for r in results])
    if args.json:
        print(json.dumps({"results": results, "time_ratio_geomean": time_geomean,
                          "memory_ratio_geomean": memory_geomean}, indent=2))
    else:
        print(_table(results))
        print(f"\nstep time Tessel/PyTorch, geomean: {time_geomean:.2f}x (goal <= 1.0x); "
              f"peak step memory Tessel/PyTorch, geomean: {memory_geomean:.2f}x (goal <= 0.8x); "
              f"{args.threads} thread(s) each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
