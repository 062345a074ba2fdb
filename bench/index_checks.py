"""What the run-time index checks cost: one model's latency with and without them, interleaved in one process.

Compiles the model (default minigpt_small), then builds every kernel that checks
its indices a second time without the checks. One executor runs both programs on
the same memory, alternating in rounds, so the machine's load drifts equally over
both; prints the median and fastest milliseconds per run of each and their
ratio, and the same for the checking kernels alone (their difference is the
checks' own time, which a loaded machine's noise on whole runs can hide).

    python bench/index_checks.py [MODEL] [--rounds 30] [--threads N] [--cpu-time]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from tessel.compiler.corpus import load_corpus  # noqa: E402

MIN_SAMPLE_S = 0.02


def unchecked_kernels(executor, cache_dir: Path, out_dir: Path) -> dict[str, object]:
    """Key → the kernel built without its index checks, for each kernel of the program that has checks."""
    from tessel.backends.cpu import schedule as cpu
    from tessel.backends.kernel import KernelSpec
    from tessel.backends.lower import schedule_kernel
    from tessel.backends.lowering.index_checks import CHECK_ATTR
    from tessel.backends.target import parse_target
    from tessel.backends.tvm_env import tvm

    target = parse_target(executor.plan["target"])
    kernels = {}
    for key in executor.plan["kernels"]:
        record = json.loads((cache_dir / f"{key}.json").read_text())
        spec = KernelSpec.from_json(record.get("spec", record))  # the cache's record holds the spec
        func, scheduled = schedule_kernel(spec, target)
        if scheduled or CHECK_ATTR not in func.script():
            continue  # hand-scheduled kernels hold no Gather; the others have nothing to leave out
        library = out_dir / f"{key}.so"
        tvm().compile(cpu.schedule(func, index_checks=False), target="llvm").export_library(str(library))
        kernels[key] = tvm().runtime.load_module(str(library))["main"]
    return kernels


def per_run_ms(run, clock=time.perf_counter) -> float:
    """Milliseconds per call over one sample of at least MIN_SAMPLE_S of `clock`."""
    calls, started = 0, clock()
    while clock() - started < MIN_SAMPLE_S:
        run()
        calls += 1
    return 1e3 * (clock() - started) / calls


def main(argv: list[str] | None = None) -> int:
    """Measure and print the A/B table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="minigpt_small")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with the process's CPU clock (with --threads 1: immune to other processes' load)")
    args = parser.parse_args(argv)
    from tessel.compiler.api import compile
    from tessel.runtime.executor import Executor

    model = next(m for m in load_corpus() if m.name == args.model)
    with tempfile.TemporaryDirectory() as tmp:
        cache, artifact_dir = Path(tmp) / "cache", Path(tmp) / "artifact"
        compile(str(model.path), input_shapes=model.input_shapes, cache_dir=cache, profile=False).save(str(artifact_dir))
        executor = Executor(artifact_dir, threads=args.threads, host="python")  # it swaps the bound python ops
        unchecked = unchecked_kernels(executor, cache, Path(tmp))
        if not unchecked:
            print(f"{args.model}: no kernel checks indices")
            return 1
        inputs = model.make_inputs()
        checked_ops = executor._ops
        executor._kernels.update(unchecked)
        unchecked_ops = executor._bind(executor.run_instructions)
        checked_steps = [k for k, i in enumerate(executor.run_instructions) if getattr(i, "kernel", None) in unchecked]

        def kernels_alone(ops) -> None:
            # Later kernels reuse the inputs' memory: write them again (the same copy for both variants).
            for name in executor.plan["inputs"]:
                executor._memory.write(executor._buffer(name), inputs[name])
            for k in checked_steps:
                ops[k]()

        variants = {
            "checked": (lambda: executor.run(inputs), checked_ops),
            "unchecked": (lambda: executor.run(inputs), unchecked_ops),
            # The kernels that differ, alone: their own cost, without the noise of the whole run.
            "checked kernels": (lambda: kernels_alone(checked_ops), checked_ops),
            "unchecked kernels": (lambda: kernels_alone(unchecked_ops), unchecked_ops),
        }
        samples: dict[str, list[float]] = {name: [] for name in variants}
        executor.run(inputs)
        for round_index in range(args.rounds + 2):
            order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
            for name in order:
                run, executor._ops = variants[name]
                ms = per_run_ms(run, time.process_time if args.cpu_time else time.perf_counter)
                if round_index >= 2:  # the first rounds warm caches and thread pools
                    samples[name].append(ms)
    medians = {name: sorted(values)[len(values) // 2] for name, values in samples.items()}
    # The fastest sample is the one least disturbed by other processes: on a loaded machine its ratio
    # says more than the medians'.
    fastest = {name: min(values) for name, values in samples.items()}
    clock = "process CPU time" if args.cpu_time else "wall time"
    print(f"{args.model}: {len(unchecked)} kernel(s) check indices; {args.rounds} interleaved rounds of {clock} (measured)")
    for name in samples:
        print(f"  {name:17s} median {medians[name]:.4f} ms, fastest {fastest[name]:.4f} ms per run")
    for label, ms in (("median", medians), ("fastest", fastest)):
        extra = ms["checked kernels"] - ms["unchecked kernels"]
        print(f"  {label}: whole run checked / unchecked = {ms['checked'] / ms['unchecked']:.4f}; the checks' own "
              f"time {1e3 * extra:+.2f} us per run = {100 * extra / ms['unchecked']:+.3f}% of the run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
