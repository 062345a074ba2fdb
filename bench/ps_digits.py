"""Parameter-server training of the digits CNN (examples/digits): test accuracy, wall time and bytes on the wire
for each consistency model and compression, and the synchronous PS against data-parallel all-reduce.

    python bench/ps_digits.py [--workers 4] [--servers 2] [--epochs 5] [--compare-dp] [--configs sync,async,...]

A config is `sync`, `async`, `ssp<s>` (bounded staleness s), optionally followed by `+1bit` or `+topk`. Every
config runs the same compiled programs (one compile; only the job settings change). Seconds are the slowest
worker's training loop (process start and TVM/torch imports excluded); bytes are per worker per step, headers
included; "vs float32" compares the gradient pushes with float32 pushes of the same gradients.
`--link-gbit G --link-latency-ms L` emulates a slow link (runtime/ps_job.throttle: each sender waits L plus
the message's time at G Gbit/s), reported as emulated.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
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


def digits(directory: Path) -> tuple[Path, dict, dict]:
    """The digits CNN (ONNX) and the train and test splits, made by examples/digits/prepare.py."""
    spec = importlib.util.spec_from_file_location("digits_prepare", ROOT / "examples/digits/prepare.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    train, test = prepare.split_digits()
    prepare.export_cnn(directory / "cnn.onnx")
    return directory / "cnn.onnx", train, test


def parse_config(text: str) -> dict:
    """A config's job settings: mode, staleness, compression."""
    mode, _, compression = text.partition("+")
    staleness = 0
    if mode.startswith("ssp"):
        mode, staleness = "ssp", int(mode[3:])
    return {"mode": mode, "staleness": staleness, "compression": compression or "none"}


def run_config(directory: Path, base: PSJob, config: str, test: dict, async_lr: float, link: dict,
               topk_ratio: float) -> dict:
    """Run one config on the compiled job in `directory`; its row of the table. Async and SSP apply every
    worker's push as one update, so they take `async_lr` (by default LR / workers: the same step per sample)."""
    settings = parse_config(config)
    lr = LR if settings["mode"] == "sync" else async_lr
    job = replace(base, **settings, **link, topk_ratio=topk_ratio, optimizer={**base.optimizer, "lr": lr})
    job.write(directory)
    result = run_job(directory, timeout_s=1800)
    logits = evaluate_job(directory, {**result.parameters, **result.statistics}, test, BATCH)
    accuracy = float((next(iter(logits.values())).argmax(axis=1) == test["labels"]).mean())
    steps = job.steps
    pushed = np.mean([r["bytes_pushed"] for r in result.reports]) / steps
    pulled = np.mean([r["bytes_pulled"] for r in result.reports]) / steps
    floats = sum(int(np.prod(shape)) for shape in job.shapes.values())
    float32_push = 4 * floats + job.servers * HEADER_BYTES
    return {"config": config, "lr": lr, "accuracy": accuracy, "seconds": max(r["seconds"] for r in result.reports),
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
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ps-digits-") as scratch:
        directory = Path(scratch)
        model, train, test = digits(directory)
        if args.compare_dp:
            diff = compare_dp(model, train, args.workers, args.servers, args.compare_dp, args.cache_dir)
            print(f"sync PS vs data-parallel all-reduce, {args.workers} workers, {args.compare_dp} steps: "
                  f"largest weight difference {diff:.3g}")
        steps = args.epochs * (len(train["labels"]) // BATCH)
        job_dir = directory / "job"
        options = {"cache_dir": args.cache_dir} if args.cache_dir else {}
        base = prepare_job(str(model), "cross_entropy", tessel.optim.SGD(lr=LR, momentum=MOMENTUM), train, job_dir,
                           workers=args.workers, servers=args.servers, batch=BATCH, steps=steps, **options)
        rows = []
        print(f"digits CNN, {args.workers} workers, {args.servers} servers, global batch {BATCH}, {steps} steps "
              f"per worker, SGD lr {LR} momentum {MOMENTUM}"
              + (f"; EMULATED link {args.link_gbit:g} Gbit/s, {args.link_latency_ms:g} ms per message"
                 if args.link_gbit or args.link_latency_ms else ""))
        print("| config | lr | test accuracy | seconds | final loss | push B/step | pull B/step | push vs float32 |")
        print("|---|---|---|---|---|---|---|---|")
        for config in args.configs.split(","):
            link = {"link_gbit_s": args.link_gbit, "link_latency_s": args.link_latency_ms / 1e3}
            row = run_config(job_dir, base, config, test, args.async_lr or LR / args.workers, link, args.topk_ratio)
            rows.append(row)
            print(f"| {row['config']} | {row['lr']:g} | {100 * row['accuracy']:.2f}% | {row['seconds']:.2f} | {row['final_loss']:.4f} "
                  f"| {row['push_bytes']:.0f} | {row['pull_bytes']:.0f} | {row['push_ratio']:.1f}x |", flush=True)
        print(f"float32 ring all-reduce: {rows[0]['allreduce_bytes']:.0f} B sent per worker per step")
        if args.link_gbit:
            _print_predictions(base, Link(args.link_latency_ms / 1e3, 8 / (args.link_gbit * 1e9)), rows)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
