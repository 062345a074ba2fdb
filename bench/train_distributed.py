"""Data-parallel training throughput: one worker vs N local workers on the same batch (compiler/dp_training.py).

    flock /tmp/tessel_heavy.lock python bench/train_distributed.py --model mlp --batch 256 --workers 2

Each configuration is compiled, warmed up, then timed over --steps steps; the table gives the step time, the
samples per second and the speed-up over one worker, and how far the weights after the timed steps are from
the one-worker run's (relative). The models are bench/training_models.py's; the batch replaces their own.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tessel  # noqa: E402
from bench.training_models import SPECS, export  # noqa: E402


def _run(path: Path, spec, batch: int, workers: int, batches, warmup: int) -> tuple[float, dict[str, np.ndarray]]:
    """Median step seconds over the timed batches, and the final state."""
    shape = (batch, *spec.input_shape[1:])
    trainer = tessel.compile_training(str(path), loss=spec.loss, optimizer=tessel.optim.SGD(lr=0.01, momentum=0.9),
                                      input_shapes={"x": shape}, devices=workers)
    try:
        for x, labels in batches[:warmup]:
            trainer.step({"x": x}, labels)
        times = []
        for x, labels in batches[warmup:]:
            started = time.perf_counter()
            trainer.step({"x": x}, labels)
            times.append(time.perf_counter() - started)
        return float(np.median(times)), trainer.state
    finally:
        trainer.close()


def main() -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=sorted(SPECS))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    spec = SPECS[args.model]
    rng = np.random.default_rng(0)
    shaped = type(spec)(spec.name, spec.build, (args.batch, *spec.input_shape[1:]), spec.loss, spec.outputs)
    batches = [shaped.batch(rng) for _ in range(args.warmup + args.steps)]
    with tempfile.TemporaryDirectory() as scratch:
        path = export(spec.model(0), shaped.input_shape, Path(scratch) / f"{spec.name}.onnx")
        base, base_state = _run(path, spec, args.batch, 1, batches, args.warmup)
        print("| model | batch | workers | step ms | samples/s | speed-up | weights vs 1 worker |")
        print("|---|---|---|---|---|---|---|")
        print(f"| {spec.name} | {args.batch} | 1 | {1e3 * base:.2f} | {args.batch / base:.0f} | 1.00 | - |")
        for workers in args.workers:
            seconds, state = _run(path, spec, args.batch, workers, batches, args.warmup)
            error = max(float(np.max(np.abs(state[n] - v)) / max(float(np.max(np.abs(v))), 1e-12))
                        for n, v in base_state.items())
            print(f"| {spec.name} | {args.batch} | {workers} | {1e3 * seconds:.2f} | {args.batch / seconds:.0f} | "
                  f"{base / seconds:.2f} | {error:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
