"""ResNet-18 (batch 32, 2 workers) trained by a parameter server on an EMULATED slow link, with and without
1-bit gradient compression, in the same run: seconds per step and bytes on the wire per step.

    flock /tmp/tessel_heavy.lock python bench/ps_resnet18.py [--steps 4] [--link-gbit 1] [--repeats 5]
        [--baseline] [--job-dir DIR]

Each repeat runs the configs once, in the given order in the 1st, 3rd, ... repeat and reversed in the others
(A B, B A, ...), so that a load drifting during the run favours neither; the last table pairs each repeat's
seconds per step, with the load average (1 minute) when the pair ended.

The model is $TESSEL_MODELS/resnet18.onnx (224x224 images). The data are synthetic (a fixed set of normal
random images and random labels, seeded): the bench measures the step's time, not the accuracy, which the
digits bench (bench/ps_digits.py) measures. Both configs run the same compiled programs (one compile; with
`--job-dir` the compiled job is kept and reused by later runs); only the job's compression changes.

The link is emulated by runtime/ps_job.throttle: before a message leaves, its sender waits the latency plus
the message's time at the link's bandwidth (loopback between local processes is faster than any network).
Seconds are the slowest worker's training loop (process start and imports excluded; the first step's kernel
warm-up is in both configs alike).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

import tessel
from tessel.compiler.ps_launch import run_job
from tessel.compiler.ps_training import prepare_job
from tessel.runtime.ps_job import HEADER_BYTES, PSJob

BATCH, WORKERS, CLASSES = 32, 2, 1000
IMAGE = (3, 224, 224)


def synthetic_data(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """`rows` normal random images and uniform random labels."""
    rng = np.random.default_rng(seed)
    return {"input": rng.standard_normal((rows, *IMAGE), dtype=np.float32),
            "labels": rng.integers(0, CLASSES, rows).astype(np.int64)}


def compiled_job(model: Path, directory: Path, servers: int, layout: str, steps: int, cache: str | None) -> PSJob:
    """The compiled job in `directory` (compiled there first when it holds none)."""
    if (directory / "job.json").is_file():
        return PSJob.read(directory)
    import onnx

    from tessel.ir.onnx_import import with_batch

    started = time.perf_counter()
    options = {"cache_dir": cache} if cache else {}
    directory.mkdir(parents=True, exist_ok=True)
    batched = directory / "resnet18_b32.onnx"  # the model file fixes batch 1
    onnx.save(with_batch(onnx.load(str(model)), BATCH), str(batched))
    # Momentum on the workers (compiler/ps_momentum.py), as a compressed job has it: both configs run the same
    # programs, and uncompressed the workers' momentum equals the servers' (the momentum is linear).
    job = prepare_job(str(batched), "cross_entropy", tessel.optim.SGD(lr=0.01, momentum=0.9), synthetic_data(2 * BATCH),
                      directory, workers=WORKERS, servers=servers, batch=BATCH, steps=steps, layout=layout,
                      momentum_correction=True, **options)
    print(f"compiled the PS job in {time.perf_counter() - started:.0f} s", flush=True)
    return job


def run_config(directory: Path, base: PSJob, compression: str, steps: int, link_gbit: float,
               latency_s: float) -> dict:
    """One config's row: the job run with `compression` on the emulated link."""
    job = replace(base, compression=compression, steps=steps, link_gbit_s=link_gbit, link_latency_s=latency_s)
    job.write(directory)
    started = time.perf_counter()
    result = run_job(directory, timeout_s=3600)
    wall = time.perf_counter() - started
    floats = sum(int(np.prod(shape)) for shape in job.shapes.values())
    return {"compression": compression, "link_gbit_s": link_gbit, "link_latency_s": latency_s, "steps": steps,
            "wall_s": wall,
            "seconds": max(r["seconds"] for r in result.reports),
            "losses": [float(np.mean([r["losses"][k] for r in result.reports])) for k in range(steps)],
            "push_bytes": float(np.mean([r["bytes_pushed"] for r in result.reports]) / steps),
            "pull_bytes": float(np.mean([r["bytes_pulled"] for r in result.reports]) / steps),
            "float32_push_bytes": 4 * floats + job.servers * HEADER_BYTES,
            "allreduce_bytes": 2 * (job.workers - 1) / job.workers * 4 * floats}


def _print_pairs(configs: list[str], pairs: list[tuple[dict[str, float], float]]) -> None:
    """The emulated-link repeats side by side: each config's seconds per step, the last config's time over the
    first's, and the load average when the pair ended."""
    print(f"\n| pair | order | {' | '.join(f'{c} s/step' for c in configs)} | {configs[-1]} / {configs[0]} | load |")
    print("|---" * (len(configs) + 4) + "|")
    for index, (pair, load) in enumerate(pairs):
        order = " then ".join(configs if index % 2 == 0 else configs[::-1])
        print(f"| {index + 1} | {order} | {' | '.join(f'{pair[c]:.2f}' for c in configs)} | "
              f"{pair[configs[-1]] / pair[configs[0]]:.2f} | {load:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per config")
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--layout", choices=("standalone", "colocated"), default="standalone")
    parser.add_argument("--link-gbit", type=float, default=1.0, help="emulated link bandwidth, Gbit/s")
    parser.add_argument("--link-latency-ms", type=float, default=0.1, help="emulated latency per message")
    parser.add_argument("--configs", default="none,1bit", help="compressions to compare, in this order")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the configs this many times, alternating (the machine's load drifts)")
    parser.add_argument("--baseline", action="store_true",
                        help="also run each config once without the emulated link (loopback)")
    parser.add_argument("--job-dir", default=None, help="keep the compiled job here (reused when it exists)")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    model = Path(os.environ.get("TESSEL_MODELS", "/work/shared/models")) / "resnet18.onnx"
    directory = Path(args.job_dir or "/tmp/ps-resnet18-job")
    base = compiled_job(model, directory, args.servers, args.layout, args.steps, args.cache_dir)
    print(f"ResNet-18, {WORKERS} workers, {base.servers} server(s) ({base.layout}), global batch {BATCH}, "
          f"{args.steps} steps per config, synthetic data", flush=True)
    print("| compression | link | s/step | push B/step | pull B/step | push vs float32 | final loss |")
    print("|---|---|---|---|---|---|---|")
    emulated = (args.link_gbit, args.link_latency_ms / 1e3)
    links = [emulated] * args.repeats + ([(0.0, 0.0)] if args.baseline else [])
    configs = args.configs.split(",")
    rows, pairs = [], []
    for repeat, (gbit, latency_s) in enumerate(links):
        pair = {}
        for compression in configs if repeat % 2 == 0 else configs[::-1]:
            row = run_config(directory, base, compression, args.steps, gbit, latency_s)
            row["repeat"] = repeat
            rows.append(row)
            pair[compression] = row["seconds"] / args.steps
            link = f"EMULATED {gbit:g} Gbit/s, {1e3 * latency_s:g} ms" if gbit else "loopback"
            print(f"| {compression} | {link} | {row['seconds'] / args.steps:.2f} | {row['push_bytes']:.0f} | "
                  f"{row['pull_bytes']:.0f} | {row['float32_push_bytes'] / row['push_bytes']:.1f}x | "
                  f"{row['losses'][-1]:.3f} |", flush=True)
        if gbit:
            pairs.append((pair, os.getloadavg()[0]))
    _print_pairs(configs, pairs)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
