"""InferenceSession measurements (issue 16's "done when"), all in one run.

1. A 2-worker session (`--two DIR`, e.g. resnet18 compiled with --devices 2): the first call (start-up included),
   then later calls: the round trip, the time rank 0 spends on the request (compute and transfers between the
   workers), and the session's overhead (the difference); beside it the same model on one worker in this process
   (`--one DIR`, compiled with --devices 1), when given.
2. `--loop N` calls in a loop: open files (/proc/PID/fd) and resident memory (VmRSS) of this process and of every
   worker, before and after (after a warm-up), and the workers' pids (the same ones, and no other process).
3. kill -9 of a worker: how long the next call takes to fail, its one line, how long close() takes, and whether
   any worker is left.
4. Streaming (`--pipeline DIR`, e.g. resnet18 --batch 8 --devices 2 --placement pipeline --microbatches 4): `--stream`
   requests through the 2-worker pipeline session (one thread per worker) against the same batch on one worker
   (`--pipeline-one DIR`: resnet18 --batch 8; one thread), each streamed in its own process, the two alternating
   which goes first, `--repeats` times: medians, ratios per repeat, and per request where each worker's time went
   (on a core, queued for a core, blocked on a peer or a request), its CPU and wake-ups; the ratio that CPU
   time alone allows (one worker's CPU per request over the busiest stage's) and the compiler's predictions.

    python bench/session.py --two r18_d2 --one r18_d1 --pipeline r18_b8_pipe --pipeline-one r18_b8_d1 [--loop 1000]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# A child streaming for --baseline imports Tessel from that checkout instead.
ROOT = Path(os.environ.get("TESSEL_BENCH_ROOT") or Path(__file__).resolve().parent.parent)
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from tessel.compiler.artifact import load  # noqa: E402
from tessel.runtime.errors import ExecutionError  # noqa: E402
from tessel.runtime.inputs import random_input  # noqa: E402
from tessel.runtime.session import InferenceSession  # noqa: E402


def _feeds(artifact, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: random_input(t, rng) for name, t in artifact.batch_input_types().items()}


def _usage(pid: int) -> tuple[int, int]:
    """(open files, resident KiB) of process `pid`."""
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return len(os.listdir(f"/proc/{pid}/fd")), rss


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except OSError:
                pass
    return sorted(found)


def _ms(seconds) -> str:
    return f"{1e3 * float(seconds):.3f} ms"


def two_workers(directory: str, one: str | None, calls: int, loop: int) -> None:
    started = time.perf_counter()
    session = InferenceSession(directory, threads=1)
    feeds = _feeds(load(directory))
    session.run(feeds)
    print(f"2-worker session of {directory}: first call (start-up included) {_ms(time.perf_counter() - started)}")
    rounds, inside, there, back = [], [], [], []
    for _ in range(calls + 5):
        t0 = time.perf_counter()
        request = session.run_async(feeds)
        request.result()
        rounds.append(time.perf_counter() - t0)
        inside.append(request.worker_seconds)
        there.append(request.worker_span[0] - request.submitted_at)
        back.append(request.answered_at - request.worker_span[1])
    rounds, inside = np.array(rounds[5:]), np.array(inside[5:])
    print(f"  later calls ({calls}): round trip p50 {_ms(np.median(rounds))}, rank 0 on the request "
          f"(compute + transfers) p50 {_ms(np.median(inside))}, overhead p50 {_ms(np.median(rounds - inside))} "
          f"(p10 {_ms(np.percentile(rounds - inside, 10))}, p90 {_ms(np.percentile(rounds - inside, 90))}): "
          f"the request's way to rank 0 p50 {_ms(np.median(there[5:]))}, the answer's way back p50 "
          f"{_ms(np.median(back[5:]))}")
    if one:
        with InferenceSession(one, threads=1) as alone:
            single = _feeds(load(one))
            alone.run(single)
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                alone.run(single)
                times.append(time.perf_counter() - t0)
        print(f"  the same model on one worker in this process (1 thread): p50 {_ms(np.median(times))}")
    if loop:
        pids = session.worker_pids
        for _ in range(20):
            session.run(feeds)
        before = {pid: _usage(pid) for pid in [os.getpid(), *pids]}
        t0 = time.perf_counter()
        for _ in range(loop):
            session.run(feeds)
        spent = time.perf_counter() - t0
        after = {pid: _usage(pid) for pid in [os.getpid(), *pids]}
        print(f"  {loop} calls in a loop ({_ms(spent / loop)} each): workers {pids} -> {session.worker_pids}, "
              f"children of this process {_children(os.getpid())}")
        for pid, label in zip(before, ["client", *(f"rank {r}" for r in range(len(pids)))]):
            print(f"    {label}: open files {before[pid][0]} -> {after[pid][0]}, RSS {before[pid][1]} -> {after[pid][1]} KiB")
    pids = session.worker_pids
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.perf_counter()
    try:
        session.run(feeds)
        print("  kill -9 of rank 1: the next call did NOT fail")
    except ExecutionError as exc:
        print(f"  kill -9 of rank 1: the next call failed after {_ms(time.perf_counter() - t0)} "
              f"(timeout {session.timeout:g} s): {type(exc).__name__}: {exc}")
    t0 = time.perf_counter()
    session.close()
    print(f"  close() returned after {_ms(time.perf_counter() - t0)}; children left: {_children(os.getpid())}")


def _cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, every thread) process `pid` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _schedstat(pid: int, thread: int | None = None) -> tuple[float, float, int]:
    """(seconds on a core, seconds runnable but waiting for a core, times scheduled in) of thread `thread` of
    process `pid` (its main thread by default), from /proc/PID/task/TID/schedstat."""
    on_cpu, queued, slices = Path(f"/proc/{pid}/task/{thread or pid}/schedstat").read_text().split()
    return int(on_cpu) / 1e9, int(queued) / 1e9, int(slices)


def _wakeups(pid: int) -> int:
    """Times every thread of process `pid` was scheduled in (its own threads' wake-ups, the main one's included)."""
    return sum(_schedstat(pid, int(task.name))[2] for task in Path(f"/proc/{pid}/task").iterdir())


def stream_once(directory: str, requests: int) -> dict:
    """Stream `requests` runs through a session of `directory` (one thread per worker) after a warm-up: requests
    per second, and for each worker (a one-worker artifact runs in this process, with the client's own work) per
    request: CPU milliseconds of all its threads (`cpu_ms`), and where its main thread's wall time went: on a
    core (`run_ms`), runnable but waiting for a core (`queued_ms`: the machine's load, not the pipeline's) and
    blocked (`blocked_ms`: waiting for a peer, a request or a send, the pipeline's own waits); `wakeups`: times
    its threads were scheduled in. `busy` and `queued` are CPU and queued seconds over the stream's wall."""
    feeds = [_feeds(load(directory), seed) for seed in range(4)]
    with InferenceSession(directory, threads=1) as session:
        for item in feeds:
            session.run(item)
        pids = session.worker_pids or [os.getpid()]
        cpu = (lambda: [_cpu_seconds(pid) for pid in pids]) if session.worker_pids else (lambda: [time.process_time()])
        stats = lambda: [(*_schedstat(pid)[:2], _wakeups(pid)) for pid in pids]  # noqa: E731
        cpu_before, stats_before, t0 = cpu(), stats(), time.perf_counter()
        for _ in session.run_many(feeds[k % len(feeds)] for k in range(requests)):
            pass
        wall = time.perf_counter() - t0
        cpu_after, stats_after = cpu(), stats()
    used = [after - before for before, after in zip(cpu_before, cpu_after)]
    main = [[after - before for before, after in zip(b, a)] for b, a in zip(stats_before, stats_after)]
    per = 1e3 / requests
    return {"requests_per_s": requests / wall, "wall_s": wall, "busy": [u / wall for u in used],
            "queued": [m[1] / wall for m in main], "cpu_ms": [per * u for u in used],
            "run_ms": [per * m[0] for m in main], "queued_ms": [per * m[1] for m in main],
            "blocked_ms": [per * (wall - m[0] - m[1]) for m in main], "wakeups": [m[2] / requests for m in main]}


def _breakdown(result: dict) -> str:
    """Per worker: where its main thread's time per request went, its threads' CPU and wake-ups per request."""
    return "; ".join(f"{label}: run {run:.1f} queued {queued:.1f} blocked {blocked:.1f} ms, CPU {cpu:.1f} ms, "
                     f"{wakeups:.0f} wake-ups" for label, run, queued, blocked, cpu, wakeups in
                     zip([f"rank {r}" for r in range(len(result["cpu_ms"]))], result["run_ms"], result["queued_ms"],
                         result["blocked_ms"], result["cpu_ms"], result["wakeups"]))


def _stream_in_child(directory: str, requests: int, root: str | None = None) -> dict:
    """`stream_once` in a fresh process (each configuration starts from the same state), with Tessel from the
    checkout `root` when given."""
    env = {**os.environ, "TESSEL_BENCH_ROOT": root} if root else None
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--stream-child", directory,
                           "--stream", str(requests)], capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"streaming {directory} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def predicted(pipeline_dir: str) -> tuple[float, float] | None:
    """Requests per second the compiler predicts from the pipeline's measured node times (reports/placement.json):
    streaming through the pipeline (its steady state: one batch per bottleneck stage's busy time), and one worker
    running every micro-batch of both stages in turn. None without the report."""
    report_file = Path(pipeline_dir) / "reports" / "placement.json"
    if not report_file.is_file():
        return None
    report = json.loads(report_file.read_text())
    one_worker_s = report["microbatches"] * sum(device["compute_s"] for device in report["per_device"])
    return 1.0 / report["predicted_steady_s"], 1.0 / one_worker_s


def pipeline(directory: str, one: str, requests: int, repeats: int, baseline: str | None = None) -> None:
    """The pipeline session against one worker on the same batch, each streamed in its own process, alternating
    which goes first, `repeats` times; medians and per-pair ratios. With `baseline` (another checkout), the
    pipeline also streams on that checkout's runtime, in the same rounds."""
    runs: dict[str, list[dict]] = {"pipeline": [], "one": []}
    order = [("pipeline", directory, None), ("one", one, None)]
    if baseline:
        runs["baseline"] = []
        order.append(("baseline", directory, baseline))
    for r in range(repeats):
        for name, path, root in (order if r % 2 == 0 else order[::-1]):
            runs[name].append(_stream_in_child(path, requests, root))
            result = runs[name][-1]
            print(f"  repeat {r + 1} {name:8s}: {result['requests_per_s']:.3f} requests/s; per request "
                  f"{_breakdown(result)}", flush=True)
    rate = {name: float(np.median([run["requests_per_s"] for run in found])) for name, found in runs.items()}
    pairs = [p["requests_per_s"] / o["requests_per_s"] for p, o in zip(runs["pipeline"], runs["one"])]
    busy = np.median([run["busy"] for run in runs["pipeline"]], axis=0)
    print(f"streaming {requests} requests, {repeats} repeats, medians: pipeline {rate['pipeline']:.3f} requests/s "
          f"(workers busy {' / '.join(f'{100 * b:.0f}%' for b in busy)}), one worker {rate['one']:.3f} requests/s "
          f"(busy {100 * float(np.median([run['busy'][0] for run in runs['one']])):.0f}%): "
          f"{rate['pipeline'] / rate['one']:.2f}x (per repeat {', '.join(f'{x:.2f}' for x in pairs)})")
    # Load-free: one worker's CPU per request over the busiest stage's (the ratio if no stage ever waited).
    one_cpu = float(np.median([run["cpu_ms"][0] for run in runs["one"]]))
    stage_cpu = np.median([run["cpu_ms"] for run in runs["pipeline"]], axis=0)
    print(f"  CPU per request: one worker {one_cpu:.1f} ms, stages {' / '.join(f'{c:.1f}' for c in stage_cpu)} ms: "
          f"{one_cpu / float(max(stage_cpu)):.2f}x on free cores (one worker's CPU over the busiest stage's)")
    if baseline:
        base = runs["baseline"]
        print(f"  the pipeline on {baseline}'s runtime: {float(np.median([b['requests_per_s'] for b in base])):.3f} "
              f"requests/s (workers busy {' / '.join(f'{100 * b:.0f}%' for b in np.median([b['busy'] for b in base], axis=0))}), "
              f"{float(np.median([b['requests_per_s'] for b in base])) / rate['one']:.2f}x one worker")
    guess = predicted(directory)
    if guess:
        pipe, single = guess
        print(f"  predicted: pipeline {pipe:.3f} requests/s, one worker {single:.3f} requests/s: {pipe / single:.2f}x; "
              f"measured / predicted: pipeline {rate['pipeline'] / pipe:.2f}, one worker {rate['one'] / single:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--two", metavar="DIR", help="an artifact compiled with --devices 2")
    parser.add_argument("--one", metavar="DIR", help="the same model compiled for one device")
    parser.add_argument("--calls", type=int, default=50, help="later calls timed")
    parser.add_argument("--loop", type=int, default=0, metavar="N", help="calls in the leak check")
    parser.add_argument("--pipeline", metavar="DIR", help="a pipeline artifact (--devices 2 --microbatches K)")
    parser.add_argument("--pipeline-one", metavar="DIR", help="the same batch compiled for one device")
    parser.add_argument("--stream", type=int, default=64, metavar="N", help="requests streamed")
    parser.add_argument("--repeats", type=int, default=3, metavar="N", help="streams of each configuration")
    parser.add_argument("--baseline", metavar="ROOT", help="also stream the pipeline on this checkout's runtime")
    parser.add_argument("--stream-child", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stream_child:
        print(json.dumps(stream_once(args.stream_child, args.stream)))
        return
    if args.two:
        two_workers(args.two, args.one, args.calls, args.loop)
    if args.pipeline and args.pipeline_one:
        pipeline(args.pipeline, args.pipeline_one, args.stream, args.repeats, args.baseline)


if __name__ == "__main__":
    main()
