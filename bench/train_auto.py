"""Parallel auto: every alternative's predicted training step against its measured one, on N local workers.

    flock /tmp/tessel_heavy.lock nice -n 5 python bench/train_auto.py [MODEL ...] [--workers 2] [--steps 20]
                                                                      [--batch B] [--profile DIR]

For each model (bench/training_models.py; the MLP at its batch and the transformer block at 256 unless --batch
says otherwise) `compile_training(parallel="auto", devices=N)` predicts every alternative (compiler/parallel_auto.py)
and trains the chosen one; each other runnable alternative is then compiled as such and trained too. Each step
time is the median of --steps steps after warm-up (SGD with momentum, the same batches). The table gives every
alternative's prediction, its measured step and the error, the chosen one marked; then the chosen one's report.
With --profile DIR the workers profile their steps (TESSEL_STEP_PROFILE=1, runtime/step_profile.py): the chosen
one's report gets the measured step chart of its last step, and DIR its reports (the chart beside the predicted
one); the step times then include the profile's own small cost.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from bench.train import _batch_spec, _median  # noqa: E402
from bench.train_distributed import DEFAULT_IMAGE_SIZE, LR, MOMENTUM, WARMUP_STEPS, _export  # noqa: E402

BATCHES = {"mlp": 16, "transformer_block": 256}


def _step_seconds(trainer, batches, steps: int) -> list[float]:
    """Every step's seconds, warm-up included (record_measured leaves the warm-up out)."""
    seconds = []
    for i in range(WARMUP_STEPS + steps):
        x, y = batches[i % len(batches)]
        started = time.perf_counter()
        trainer.step({"x": x}, y)
        seconds.append(time.perf_counter() - started)
    return seconds


def bench_model(name: str, batch: int, workers: int, steps: int, scratch: Path, keep: Path | None = None) -> list[dict]:
    """Every alternative's row: predicted and measured seconds, and whether auto chose it."""
    import numpy as np

    import tessel
    from tessel.compiler.measured_step import measured_timeline
    from tessel.compiler.parallel_auto import REPORT, record_measured

    spec = _batch_spec(name, batch, DEFAULT_IMAGE_SIZE)
    path = _export(name, batch, DEFAULT_IMAGE_SIZE, scratch / f"{name}.onnx")
    rng = np.random.default_rng(0)
    batches = [spec.batch(rng) for _ in range(4)]

    def compiled(**options):
        return tessel.compile_training(str(path), loss=spec.loss, optimizer=tessel.optim.SGD(LR, momentum=MOMENTUM),
                                       input_shapes={"x": spec.input_shape}, devices=workers, **options)

    started = time.perf_counter()
    auto = compiled(parallel="auto")
    print(f"{name}: auto compiled in {time.perf_counter() - started:.0f} s", flush=True)
    reports = Path(auto.step_artifact.directory) / "reports"
    try:
        seconds = _step_seconds(auto, batches, steps)
        profile = auto.step_profile
        record_measured(reports, seconds, timeline=measured_timeline(auto.step_artifact.plan, profile) if profile else None)
        if keep is not None:
            shutil.copytree(reports, keep / name, dirs_exist_ok=True)
    finally:
        auto.close()
    doc = json.loads((reports / f"{REPORT}.json").read_text())
    print((reports / f"{REPORT}.md").read_text(), flush=True)
    rows = []
    for a in doc["alternatives"]:
        row = {"model": name, "alternative": a["name"], "predicted_s": a["predicted_s"],
               "chosen": a["name"] == doc["chosen"], "measured_s": None}
        if row["chosen"]:
            row["measured_s"] = doc["measured"]["step_s"]
        elif a["runnable"] and a["predicted_s"] is not None:
            options = {"parallel": a["parallel"]}
            if a["parallel"] == "pipeline":
                options.update(schedule=a["schedule"], micro_batches=a["bubble"]["micro_batches"])
            trainer = compiled(**options)
            try:
                row["measured_s"] = _median(_step_seconds(trainer, batches, steps)[WARMUP_STEPS:])
            finally:
                trainer.close()
        rows.append(row)
    return rows


def _table(rows: list[dict], workers: int) -> str:
    lines = [f"| model | alternative ({workers} workers) | predicted ms | measured ms | error |",
             "|---|---|---|---|---|"]
    for r in rows:
        mark = " **(chosen)**" if r["chosen"] else ""
        predicted = "-" if r["predicted_s"] is None else f"{1e3 * r['predicted_s']:.2f}"
        measured = "-" if r["measured_s"] is None else f"{1e3 * r['measured_s']:.2f}"
        error = "-" if r["predicted_s"] is None or r["measured_s"] is None else \
            f"{100 * (r['predicted_s'] - r['measured_s']) / r['measured_s']:+.0f}%"
        lines.append(f"| {r['model']} | {r['alternative']}{mark} | {predicted} | {measured} | {error} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the bench and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(BATCHES))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--profile", type=Path, metavar="DIR", help="profile the steps; the reports go to DIR/MODEL")
    args = parser.parse_args(argv)
    if args.profile:
        from tessel.runtime.step_profile import PROFILE_ENV

        os.environ[PROFILE_ENV] = "1"  # the workers inherit it
    rows = []
    with tempfile.TemporaryDirectory(prefix="tessel-auto-bench-") as scratch:
        for name in args.models:
            rows += bench_model(name, args.batch or BATCHES.get(name, 32), args.workers, args.steps, Path(scratch),
                                args.profile)
    print(_table(rows, args.workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
