"""Parameter-server training of the digits CNN (examples/digits): test accuracy, wall time and bytes on the wire
for each consistency model and compression, and the synchronous PS against data-parallel all-reduce.

    python bench/ps_digits.py [--workers 4] [--servers 2] [--epochs 5] [--compare-dp] [--configs sync,async,...]
        [--seeds 0,1,2]

A config is `sync`, `async`, `ssp<s>` (bounded staleness s), optionally followed by `+1bit` or `+topk`. The
configs run the same compiled programs (only the job settings change), but for the servers' update: with
compression the workers keep SGD's momentum and the servers apply plain SGD (momentum correction,
compiler/ps_momentum.py; `--server-momentum` keeps it on the servers), so a seed compiles once per kind used.
The test accuracy is the job's model (compiler/ps_launch.model_parameters: with compressed pulls, worker 0's
weights); the servers' weights with the same statistics are shown beside it. Seconds are the slowest worker's
training loop (process start and TVM/torch imports excluded); bytes are per worker per step, headers
included; "vs float32" compares the gradient pushes with float32 pushes of the same gradients.
`--link-gbit G --link-latency-ms L` emulates a slow link (runtime/ps_job.throttle: each sender waits L plus
the message's time at G Gbit/s), reported as emulated.
With `--seeds`, every config runs once per seed k: the CNN initialised with torch seed k (compiled again for each
seed) and the batches shuffled with seed k. Synchronous runs are deterministic (the servers add pushes in rank
order), so a sync config's spread over seeds is the spread of the training itself, not of the processes'
timing; the summary gives each config's mean and median accuracy and each config's accuracy minus the first
config's, paired by seed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

import tessel
from tessel.compiler.ps_training import evaluate_job, prepare_job
from tessel.compiler.train_data import Dataset
from tessel.passes.machine import Link
from tessel.passes.ps_cost import exchange_plans
from tessel.runtime.ps_job import HEADER_BYTES, PSJob
from tessel.compiler.ps_launch import run_job

ROOT = Path(__file__).resolve().parents[1]
BATCH, LR, MOMENTUM = 32, 0.05, 0.9


def digits(directory: Path, init_seed: int = 0) -> tuple[Path, dict, dict]:
    """The digits CNN (ONNX, initialised with torch seed `init_seed`) and the train and test splits, made by
    examples/digits/prepare.py."""
    spec = importlib.util.spec_from_file_location("digits_prepare", ROOT / "examples/digits/prepare.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    train, test = prepare.split_digits()
    prepare.export_cnn(directory / "cnn.onnx", seed=init_seed)
    return directory / "cnn.onnx", train, test


def parse_config(text: str) -> dict:
    """A config's job settings: mode, staleness, compression."""
    mode, _, compression = text.partition("+")
    staleness = 0
    if mode.startswith("ssp"):
        mode, staleness = "ssp", int(mode[3:])
    return {"mode": mode, "staleness": staleness, "compression": compression or "none"}


def test_accuracy(directory: Path, state: dict, test: dict) -> float:
    """The test accuracy of the model with `state` (parameters and statistics), by the job's eval program."""
    logits = evaluate_job(directory, state, test, BATCH)
    return float((next(iter(logits.values())).argmax(axis=1) == test["labels"]).mean())


def run_config(directory: Path, base: PSJob, config: str, test: dict, async_lr: float, link: dict,
               topk_ratio: float) -> dict:
    """Run one config on the compiled job in `directory`; its row of the table. Async and SSP apply every
    worker's push as one update, so they take `async_lr` (by default LR / workers: the same step per sample)."""
    settings = parse_config(config)
    lr = LR if settings["mode"] == "sync" else async_lr
    job = replace(base, **settings, **link, topk_ratio=topk_ratio, optimizer={**base.optimizer, "lr": lr})
    job.write(directory)
    result = run_job(directory, timeout_s=1800)
    accuracy = test_accuracy(directory, result.model, test)
    # With compressed pulls the model is worker 0's weights (compiler/ps_launch.model_parameters); the
    # servers' weights with the same statistics, for comparison.
    servers = test_accuracy(directory, {**result.parameters, **result.statistics}, test)
    steps = job.steps
    pushed = np.mean([r["bytes_pushed"] for r in result.reports]) / steps
    pulled = np.mean([r["bytes_pulled"] for r in result.reports]) / steps
    floats = sum(int(np.prod(shape)) for shape in job.shapes.values())
    float32_push = 4 * floats + job.servers * HEADER_BYTES
    return {"config": config, "lr": lr, "accuracy": accuracy, "servers_accuracy": servers, "seconds": max(r["seconds"] for r in result.reports),
            "final_loss": float(np.mean([r["losses"][-1] for r in result.reports])),
            "push_bytes": float(pushed), "pull_bytes": float(pulled), "push_ratio": float32_push / pushed,
            "allreduce_bytes": 2 * (job.workers - 1) / job.workers * 4 * floats}


def compare_dp(model: Path, train: dict, workers: int, servers: int, steps: int, cache: str | None) -> float:
    """Largest difference between the weights of synchronous PS and of data-parallel all-reduce training
    after `steps` steps on the same batches."""
    optimizer = tessel.optim.SGD(lr=LR, momentum=MOMENTUM)
    options = {"cache_dir": cache} if cache else {}
    with tempfile.TemporaryDirectory(prefix="ps-dp-") as scratch:
        prepare_job(str(model), "cross_entropy", optimizer, train, Path(scratch), workers=workers, servers=servers,
                    batch=BATCH, steps=steps, **options)
        ps = run_job(scratch).parameters
    dp = tessel.compile_training(str(model), loss="cross_entropy", optimizer=optimizer,
                                 input_shapes={"x": (BATCH, 1, 8, 8)}, devices=workers, placement="data", **options)
    try:
        dataset = Dataset(train, len(train["labels"]))
        done, epoch = 0, 0
        while done < steps:
            for batch in dataset.batches(BATCH, 0, epoch):
                if done == steps:
                    break
                dp.step({"x": batch["x"]}, batch["labels"])
                done += 1
            epoch += 1
        state = dp.state
    finally:
        dp.close()
    return max(float(np.max(np.abs(ps[name] - state[name]))) for name in ps)


def _print_predictions(job: PSJob, link: Link, rows: list[dict]) -> None:
    """The α-β model's communication seconds per step (passes/ps_cost.py) on the emulated link, beside the
    measured seconds per step."""
    sizes = [4 * int(np.prod(shape)) for shape in job.shapes.values()]
    plans = {(p.kind, p.servers): p.seconds for p in exchange_plans(link, sizes, job.workers)}
    print(f"predicted communication per step on the emulated link: all-reduce {1e3 * plans[('allreduce', 0)]:.2f} ms, "
          f"PS with {job.servers} servers {1e3 * plans[('ps', job.servers)]:.2f} ms; measured step: "
          + ", ".join(f"{row['config']} {1e3 * row['seconds'] / job.steps:.2f} ms" for row in rows))


def print_summary(rows: list[dict]) -> None:
    """Each config's accuracy over the seeds (mean, median, range), and its difference from the first config's
    on the same seed."""
    configs = list(dict.fromkeys(row["config"] for row in rows))
    by = {(row["config"], row["seed"]): row for row in rows}
    seeds = sorted({row["seed"] for row in rows})
    print(f"over seeds {', '.join(map(str, seeds))}: accuracy (percentage points for the differences from "
          f"{configs[0]}, paired by seed)")
    print(f"| config | mean | median | min | max | median s | mean - {configs[0]} | median of differences |")
    print("|---|---|---|---|---|---|---|---|")
    for config in configs:
        accuracy = [100 * by[config, seed]["accuracy"] for seed in seeds]
        seconds = [by[config, seed]["seconds"] for seed in seeds]
        diffs = [a - 100 * by[configs[0], seed]["accuracy"] for a, seed in zip(accuracy, seeds)]
        print(f"| {config} | {statistics.mean(accuracy):.2f}% | {statistics.median(accuracy):.2f}% "
              f"| {min(accuracy):.2f}% | {max(accuracy):.2f}% | {statistics.median(seconds):.2f} "
              f"| {statistics.mean(diffs):+.2f} | {statistics.median(diffs):+.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--configs", default="sync,async,ssp1,ssp2,ssp4,sync+1bit,sync+topk")
    parser.add_argument("--compare-dp", type=int, default=0, metavar="STEPS",
                        help="also compare sync PS with data-parallel all-reduce after STEPS steps")
    parser.add_argument("--async-lr", type=float, default=None, help="async and SSP learning rate (LR / workers)")
    parser.add_argument("--topk-ratio", type=float, default=0.01, help="top-k: share of elements sent")
    parser.add_argument("--link-gbit", type=float, default=0.0, help="emulated link bandwidth, Gbit/s (0: none)")
    parser.add_argument("--link-latency-ms", type=float, default=0.0, help="emulated latency per message")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (initialisation and batch order)")
    parser.add_argument("--server-momentum", action="store_true",
                        help="with compression, keep SGD's momentum on the servers (no momentum correction)")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    with tempfile.TemporaryDirectory(prefix="ps-digits-") as scratch:
        directory = Path(scratch)
        if args.compare_dp:
            model, train, _ = digits(directory)
            diff = compare_dp(model, train, args.workers, args.servers, args.compare_dp, args.cache_dir)
            print(f"sync PS vs data-parallel all-reduce, {args.workers} workers, {args.compare_dp} steps: "
                  f"largest weight difference {diff:.3g}")
        options = {"cache_dir": args.cache_dir} if args.cache_dir else {}
        link = {"link_gbit_s": args.link_gbit, "link_latency_s": args.link_latency_ms / 1e3}
        rows = []
        for seed in seeds:
            seed_dir = directory / f"seed{seed}"
            seed_dir.mkdir()
            model, train, test = digits(seed_dir, init_seed=seed)
            steps = args.epochs * (len(train["labels"]) // BATCH)
            jobs: dict[bool, tuple[Path, PSJob]] = {}  # by momentum correction

            def job_for(config: str) -> tuple[Path, PSJob]:
                """The compiled job a config runs on: with or without momentum correction."""
                corrected = parse_config(config)["compression"] != "none" and not args.server_momentum
                if corrected not in jobs:
                    job_dir = seed_dir / f"job{int(corrected)}"
                    jobs[corrected] = job_dir, prepare_job(
                        str(model), "cross_entropy", tessel.optim.SGD(lr=LR, momentum=MOMENTUM), train, job_dir,
                        workers=args.workers, servers=args.servers, batch=BATCH, steps=steps, seed=seed,
                        momentum_correction=corrected, **options)
                return jobs[corrected]
            print(f"digits CNN (seed {seed}), {args.workers} workers, {args.servers} servers, global batch {BATCH}, "
                  f"{steps} steps per worker, SGD lr {LR} momentum {MOMENTUM}"
                  + (f"; EMULATED link {args.link_gbit:g} Gbit/s, {args.link_latency_ms:g} ms per message"
                     if args.link_gbit or args.link_latency_ms else ""))
            print("| config | lr | test accuracy | (servers' weights) | seconds | final loss | push B/step | pull B/step "
                  "| push vs float32 |")
            print("|---|---|---|---|---|---|---|---|---|")
            for config in args.configs.split(","):
                job_dir, base = job_for(config)
                row = run_config(job_dir, base, config, test, args.async_lr or LR / args.workers, link,
                                 args.topk_ratio)
                rows.append({**row, "seed": seed})
                print(f"| {row['config']} | {row['lr']:g} | {100 * row['accuracy']:.2f}% "
                      f"| {100 * row['servers_accuracy']:.2f}% | {row['seconds']:.2f} "
                      f"| {row['final_loss']:.4f} | {row['push_bytes']:.0f} | {row['pull_bytes']:.0f} "
                      f"| {row['push_ratio']:.1f}x |", flush=True)
        print(f"float32 ring all-reduce: {rows[0]['allreduce_bytes']:.0f} B sent per worker per step")
        if len(seeds) > 1:
            print_summary(rows)
        if args.link_gbit:
            _print_predictions(base, Link(args.link_latency_ms / 1e3, 8 / (args.link_gbit * 1e9)),
                               [row for row in rows if row["seed"] == seeds[-1]])
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))

if __name__ == "__main__":
    main()
