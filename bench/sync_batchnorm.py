"""Synchronised BatchNorm against one device: N local workers with sync_batchnorm=True and one device on the
whole batch, the same SGD-momentum steps from the same weights (compiler/dp_training.py, passes/training_mode.py).

    flock /tmp/tessel_heavy.lock python bench/sync_batchnorm.py --model resnet18 --workers 2 --steps 20

Prints each step's loss on both and their relative difference, then, per state tensor (weights, BN running
statistics, momentum), the relative difference max|a - b| / max|b| after the first step and after the last.
After the first step SGD's momentum buffer holds the first gradient itself, so its row is the first-step
gradient agreement, which float32 rounding alone limits; later steps show how far the trajectories drift (a
chaotic model's 20-step float32 trajectory amplifies rounding: notes on ResNet-18 in the training docs).
--interpret does the same in float64 on the IR interpreter, the replicas simulated
(ir/interpret.interpret_replicas): no float32 rounding, so the two should agree to about 1e-10 at every step.
The models are bench/training_models.py's; --batch replaces their own batch.
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
from tessel.compiler.training import build_step_graph  # noqa: E402
from tessel.ir.interpret import interpret_replicas  # noqa: E402
from tessel.ir.onnx_import import with_batch  # noqa: E402


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def _summary(label: str, got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """The largest and median relative difference per kind of state tensor."""
    kinds = {"momentum": [n for n in want if n.endswith(".momentum")],
             "running stats": [n for n in want if n.endswith(("running_mean", "running_var"))]}
    kinds["weights"] = [n for n in want if n not in kinds["momentum"] + kinds["running stats"]]
    for kind, names in kinds.items():
        if names:
            errors = sorted(_relative(got[n], want[n]) for n in names)
            worst = max(names, key=lambda n: _relative(got[n], want[n]))
            print(f"  {label:>12} {kind:>14}: max {errors[-1]:.2e} ({worst}), median {errors[len(errors) // 2]:.2e}"
                  f" over {len(names)}")


class _Interpreted:
    """A step graph interpreted in float64 as `replicas` data-parallel replicas (one: a single device): the
    surface of a Trainer that main uses."""

    def __init__(self, path: Path, shape: tuple[int, ...], loss: str, optimizer, replicas: int):
        import onnx

        part = (shape[0] // replicas, *shape[1:])
        model = with_batch(onnx.load(str(path)), part[0])
        self.graph = build_step_graph(model, {"x": part}, loss, optimizer, replicas=replicas,
                                      sync_batchnorm=replicas > 1)
        self.optimizer, self.replicas, self.steps = optimizer, replicas, 0
        self.state = {name: value.astype(np.float64) for name, value in self.graph.state.items()}

    def step(self, feeds: dict, labels: np.ndarray) -> float:
        part = len(labels) // self.replicas
        step = self.graph
        outputs = interpret_replicas(step.graph, [
            {**self.state, "x": feeds["x"][r * part:(r + 1) * part].astype(np.float64),
             step.label_input: labels[r * part:(r + 1) * part], **self.optimizer.step_scalars(self.steps)}
            for r in range(self.replicas)])
        for out in outputs[1:]:
            assert all(np.array_equal(out[name], outputs[0][name]) for name in step.state_updates.values())
        self.state = {name: outputs[0][step.state_updates[name]] if name in step.state_updates else value
                      for name, value in self.state.items()}
        self.steps += 1
        return float(outputs[0][step.loss_output])

    def close(self) -> None:
        """Nothing to release (a Trainer's surface)."""


def main() -> int:
    """Run the comparison and print it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", choices=sorted(SPECS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, help="samples per step (default: the model's own)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--interpret", action="store_true", help="float64 on the IR interpreter, replicas simulated")
    args = parser.parse_args()
    spec = SPECS[args.model]
    shape = (args.batch or spec.input_shape[0], *spec.input_shape[1:])
    sized = type(spec)(spec.name, spec.build, shape, spec.loss, spec.outputs)
    rng = np.random.default_rng(0)
    batches = [sized.batch(rng) for _ in range(args.steps)]
    with tempfile.TemporaryDirectory() as tmp:
        path = export(spec.model(0), shape, Path(tmp) / f"{spec.name}.onnx")
        options = {"loss": spec.loss, "optimizer": tessel.optim.SGD(lr=args.lr, momentum=0.9),
                   "input_shapes": {"x": shape}}
        started = time.perf_counter()
        if args.interpret:
            single = _Interpreted(path, shape, spec.loss, options["optimizer"], 1)
            parallel = _Interpreted(path, shape, spec.loss, options["optimizer"], args.workers)
        else:
            single = tessel.compile_training(str(path), **options)
            parallel = tessel.compile_training(str(path), devices=args.workers, sync_batchnorm=True, **options)
        print(f"{spec.name}, batch {shape[0]}: one device and {args.workers} workers with synchronised BN, "
              f"{'float64 interpreted' if args.interpret else 'compiled'} ({time.perf_counter() - started:.0f} s)")
        try:
            for step, (x, labels) in enumerate(batches):
                want, got = single.step({"x": x}, labels), parallel.step({"x": x}, labels)
                sys.stdout.flush()
                print(f"  step {step:2d}: loss {want:.6f} vs {got:.6f}, relative {abs(got - want) / abs(want):.2e}")
                if step == 0:
                    _summary("after step 1", parallel.state, single.state)
            _summary(f"after {args.steps}", parallel.state, single.state)
        finally:
            parallel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
