"""`tessel bench DIR`: latency percentiles and throughput of an artifact, with trtexec's and benchmark_app's habits.

The artifact runs in an InferenceSession (a multi-worker artifact on its
workers, started once: the first call's time, start-up included, is printed
apart). After `--warmup` runs, runs are timed one after the other for
`--duration` seconds or `--iterations` runs: min, mean, p50, p90, p99, max and
the throughput of those runs. A multi-worker artifact also prints the session's
overhead per run (the round trip minus the time rank 0 spent on the request:
the pipes, not the compute or the transfers between workers) and the
throughput of as many runs streamed through the workers (`run_many`).

`--compare onnxruntime` times the original model (found as `tessel run --check`
finds it) the same way in its own process (compiler/bench_onnxruntime.py), with
as many threads as the artifact's workers use together, and prints the ratio.
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
from typing import Callable

import numpy as np

from tessel.ir.errors import TesselError

from .arg_types import count_from, positive_seconds

DEFAULT_DURATION_S = 10.0
DEFAULT_WARMUP = 10
PERCENTILES = (50, 90, 99)
# How long the onnxruntime process may take beyond its own measurement (start-up, loading the model).
COMPARE_SLACK_S = 300.0


class BenchError(TesselError):
    """The benchmark cannot run as asked (e.g. onnxruntime failed on the original model)."""


def add_bench_parser(commands, parents) -> None:
    """Register `tessel bench` among the CLI's subcommands (`parents`: the options every command takes)."""
    bench = commands.add_parser("bench", parents=parents, help="measure an artifact's latency percentiles and throughput")
    bench.add_argument("artifact", help="artifact directory written by 'tessel compile'")
    bench.add_argument("--warmup", type=count_from(0), default=DEFAULT_WARMUP, metavar="N",
                       help=f"untimed runs first (default {DEFAULT_WARMUP})")
    length = bench.add_mutually_exclusive_group()
    length.add_argument("--duration", type=positive_seconds, metavar="S",
                        help=f"time runs for S seconds (default {DEFAULT_DURATION_S:g})")
    length.add_argument("--iterations", type=count_from(1), metavar="N", help="time exactly N runs")
    bench.add_argument("--threads", type=count_from(1), metavar="N",
                       help="threads per worker (default: the cores shared among the workers)")
    bench.add_argument("--inputs", metavar="IN.npz", help="inputs by name (default: random inputs)")
    bench.add_argument("--input-value", action="append", default=[], metavar="NAME=VALUE",
                       help="set an input (a scalar or control input) to VALUE, broadcast to its shape")
    bench.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    bench.add_argument("--compare", choices=["onnxruntime"],
                       help="also time the original model with onnxruntime in its own process and print the ratio")
    bench.add_argument("--reference", metavar="MODEL.onnx", help="the model --compare runs (default: as run --check finds it)")
    bench.add_argument("--timeout", type=positive_seconds, default=30.0, metavar="S",
                       help="seconds a run (and a transfer between workers) may take (default 30)")
    bench.set_defaults(run=run_bench)


def latency_stats(seconds: list[float]) -> dict[str, float]:
    """min, mean, p50, p90, p99, max of the samples, in milliseconds."""
    ms = np.asarray(seconds) * 1e3
    stats = {"min": float(ms.min()), "mean": float(ms.mean())}
    stats.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    stats["max"] = float(ms.max())
    return stats


def time_calls(call: Callable[[], object], warmup: int, duration: float | None, iterations: int | None) -> list[float]:
    """Seconds per call of `call`, after `warmup` untimed calls, for `iterations` calls or `duration` seconds."""
    for _ in range(warmup):
        call()
    samples = []
    until = None if iterations else time.perf_counter() + (duration or DEFAULT_DURATION_S)
    while (len(samples) < iterations) if iterations else (time.perf_counter() < until or not samples):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


def measure_stream(session, feeds: dict[str, np.ndarray], runs: int) -> dict:
    """What `tessel run --repeat N` records for a placement: the latency of one run alone, then the time per batch
    over `runs` runs streamed through the session's workers (reports/placement.json's "measured")."""
    started = time.perf_counter()
    session.run(feeds)
    latency = time.perf_counter() - started
    started = time.perf_counter()
    for _ in session.run_many(feeds for _ in range(runs)):
        pass
    workers = session.workers
    return {"latency_s": latency, "seconds_per_batch": (time.perf_counter() - started) / runs, "runs": runs,
            "workers": workers, "threads": session.threads or max(1, (os.cpu_count() or 1) // workers)}


def run_bench(args: argparse.Namespace) -> int:
    """The `tessel bench` command."""
    from tessel.runtime.session import InferenceSession

    from .api import load
    from .input_values import parse_input_values, run_inputs

    artifact = load(args.artifact)
    reference = None
    if args.compare:  # found before the long measurement: a missing model is reported at once
        from .reference_check import reference_model

        reference = reference_model(artifact.directory, args.reference)
    feeds, _ = run_inputs(args.inputs, artifact, parse_input_values(args.input_value))
    started = time.perf_counter()
    with InferenceSession(artifact, threads=args.threads, timeout=args.timeout) as session:
        session.run(feeds)
        first_s = time.perf_counter() - started
        worker_s: list[float] = []

        def one_run() -> None:
            if session.workers == 1:  # in this process: the plain call, as a user makes it
                session.run(feeds)
                return
            request = session.run_async(feeds)
            request.result()
            if getattr(request, "worker_seconds", None) is not None:
                worker_s.append(request.worker_seconds)

        samples = time_calls(one_run, args.warmup, args.duration, args.iterations)
        worker_s = worker_s[-len(samples):]
        workers = artifact.devices
        threads = args.threads or max(1, (os.cpu_count() or 1) // workers)
        result = {"artifact": str(artifact.directory), "workers": workers, "threads_per_worker": threads,
                  "first_run_s": first_s, "warmup": args.warmup, "iterations": len(samples),
                  "latency_ms": latency_stats(samples), "throughput_per_s": len(samples) / sum(samples)}
        if worker_s:
            overheads = np.asarray(samples) - np.asarray(worker_s)
            result["worker_ms_p50"] = 1e3 * float(np.median(worker_s))
            result["overhead_ms_p50"] = 1e3 * float(np.median(overheads))
            streamed_started = time.perf_counter()
            for _ in session.run_many(feeds for _ in range(len(samples))):
                pass
            result["streamed_throughput_per_s"] = len(samples) / (time.perf_counter() - streamed_started)
    if reference is not None:
        result["onnxruntime"] = _onnxruntime_stats(reference, feeds, threads * workers, args)
        result["ratio_p50"] = result["latency_ms"]["p50"] / result["onnxruntime"]["latency_ms"]["p50"]
    print(json.dumps(result, indent=1) if args.json else format_result(result))
    return 0


def _onnxruntime_stats(reference, feeds: dict[str, np.ndarray], threads: int, args: argparse.Namespace) -> dict:
    """The same measurement of the original model with onnxruntime, in a process of its own."""
    with tempfile.TemporaryDirectory(prefix="tessel-bench-") as scratch:
        model = reference.source
        if isinstance(model, bytes):
            Path(scratch, "model.onnx").write_bytes(model)
            model = str(Path(scratch, "model.onnx"))
        inputs = Path(scratch, "inputs.npz")
        np.savez(inputs, **feeds)
        command = [sys.executable, "-m", "tessel.compiler.bench_onnxruntime", model, str(inputs),
                   "--threads", str(threads), "--warmup", str(args.warmup)]
        command += ["--iterations", str(args.iterations)] if args.iterations else \
            ["--duration", str(args.duration or DEFAULT_DURATION_S)]
        from tessel import IMPORT_ROOT

        try:
            done = subprocess.run(command, capture_output=True, text=True, cwd=IMPORT_ROOT,
                                  timeout=(args.duration or DEFAULT_DURATION_S) + COMPARE_SLACK_S)
        except subprocess.TimeoutExpired:
            raise BenchError(f"onnxruntime did not finish timing {reference.label} in time") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise BenchError(f"onnxruntime cannot time {reference.label}: {lines[-1]}")
    return {**json.loads(done.stdout), "model": reference.label}


def format_result(result: dict) -> str:
    """The text `tessel bench` prints."""
    stats = result["latency_ms"]
    lines = [f"{result['artifact']}: {result['workers']} worker(s), {result['threads_per_worker']} thread(s) each",
             f"first run (start-up included): {1e3 * result['first_run_s']:.1f} ms",
             f"latency over {result['iterations']} runs (after {result['warmup']} warm-up): " +
             ", ".join(f"{key} {value:.3f} ms" for key, value in stats.items()),
             f"throughput: {result['throughput_per_s']:.1f} runs/s (one at a time)"]
    if "overhead_ms_p50" in result:
        lines.append(f"session overhead: {result['overhead_ms_p50']:.3f} ms per run (median round trip "
                     f"{stats['p50']:.3f} ms minus {result['worker_ms_p50']:.3f} ms rank 0 spent on the run)")
        lines.append(f"streamed throughput: {result['streamed_throughput_per_s']:.1f} runs/s "
                     f"({result['iterations']} runs streamed through the workers with run_many)")
    if "onnxruntime" in result:
        ort = result["onnxruntime"]
        lines.append(f"onnxruntime ({ort['threads']} thread(s), {ort['model']}): " +
                     ", ".join(f"{key} {value:.3f} ms" for key, value in ort["latency_ms"].items()))
        lines.append(f"tessel/onnxruntime: {result['ratio_p50']:.2f}x (p50 latency; below 1 is faster)")
    return "\n".join(lines)
