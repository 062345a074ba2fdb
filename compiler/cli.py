"""The `tessel` command line.

Every user error ends as one line on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ir.errors import ShapeBindingError, TesselError, UnsupportedModelError
from ir.types import TensorType

from .pipeline import PASS_NAMES
from .sizes import format_bytes

EXIT_USAGE = 2
CHECK_RTOL, CHECK_ATOL = 1e-3, 1e-4


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (what, and where to look) and exit code 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def parse_input_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """Read NAME=1x3x224x224 (NAME= for a scalar) into (name, shape)."""
    name, sep, dims = text.rpartition("=")
    if not sep or not name:
        raise ShapeBindingError(f"bad --input-shape '{text}': expected NAME=DIMxDIM..., e.g. x=1x3x224x224")
    if not dims:
        return name, ()
    try:
        shape = tuple(int(d) for d in dims.lower().split("x"))
    except ValueError:
        raise ShapeBindingError(f"bad --input-shape '{text}': dimensions must be integers separated by 'x', e.g. {name}=1x3x224x224") from None
    if any(d < 0 for d in shape):
        raise ShapeBindingError(f"bad --input-shape '{text}': dimensions must not be negative")
    return name, shape


def _input_shapes(items: Sequence[str]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, shape = parse_input_shape(item)
        if name in shapes:
            raise ShapeBindingError(f"--input-shape gives '{name}' twice")
        shapes[name] = shape
    return shapes


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .model_summary import format_summary, summarize

    report = summarize(args.model, _input_shapes(args.input_shape))
    print(json.dumps(report, indent=2) if args.json else format_summary(report))
    if report["unsupported"]:
        error = UnsupportedModelError([(u["op"], u["domain"], u["count"], u["first_node"], u["reason"]) for u in report["unsupported"]])
        print(f"tessel: error: {args.model}: {error}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    from backends.builder import stderr_progress

    from .api import compile as compile_model
    from .artifact import check_destination

    output = Path(args.output)
    check_destination(output, args.force)  # before compiling: refuse early, not after minutes of work
    artifact = compile_model(args.model, target=args.target, input_shapes=_input_shapes(args.input_shape),
                             jobs=args.jobs, progress=stderr_progress, device_memory=args.device_memory,
                             skip_passes=args.skip_pass,
                             verify=args.verify, dump_after=args.dump_after)
    artifact.save(output, overwrite=args.force)
    report = artifact.report()
    memory = report["memory"]
    print(f"compiled {args.model} for {report['target']}: {report['kernels']} kernels "
          f"({report['kernels_cached']} from cache), {report['kernel_calls']} kernel calls per run, "
          f"activations {format_bytes(memory['arena_bytes'])} (bound {format_bytes(memory['bound_bytes'])}), "
          f"weights {format_bytes(memory['weights_bytes'])} -> {output}")
    for name in args.dump_after:
        print(f"graph after {name}: {output / 'reports' / f'after_{name}.txt'} and .onnx")
    return 0


def _read_inputs(path: str | None, artifact) -> dict[str, np.ndarray]:
    from runtime.errors import InputError

    if path is None:
        rng = np.random.default_rng(0)
        print("no --inputs given: running on random inputs", file=sys.stderr)
        return {name: _random_input(TensorType.parse(spec), rng) for name, spec in artifact.inputs.items()}
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: cannot read inputs as .npz ({exc})") from exc


def _random_input(t: TensorType, rng: np.random.Generator) -> np.ndarray:
    if t.dtype.startswith("float"):
        return rng.standard_normal(t.shape).astype(t.dtype)
    return np.zeros(t.shape, dtype=t.dtype)


def _cmd_run(args: argparse.Namespace) -> int:
    from runtime.errors import ArtifactError

    from .api import load

    artifact = load(args.artifact)
    if args.outputs and Path(args.outputs).exists() and not args.force:
        raise ArtifactError(f"{args.outputs}: already exists; choose another file or pass --force")
    inputs = _read_inputs(args.inputs, artifact)
    outputs = artifact.run(inputs)
    times = []
    for _ in range(max(args.repeat, 0)):
        started = time.perf_counter()
        artifact.run(inputs)
        times.append(time.perf_counter() - started)
    for name, array in outputs.items():
        summary = f"min {array.min():.6g} max {array.max():.6g}" if array.size and array.dtype != bool else ""
        print(f"{name}: {array.dtype}[{','.join(map(str, array.shape))}] {summary}")
    if times:
        print(f"latency over {len(times)} runs: median {1e3 * float(np.median(times)):.3f} ms, min {1e3 * min(times):.3f} ms")
    if args.outputs:
        np.savez(args.outputs, **outputs)
    if args.check:
        return _check(artifact, inputs, outputs)
    return 0


def _check(artifact, inputs, outputs) -> int:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(artifact.directory / "model.onnx"), options, providers=["CPUExecutionProvider"])
    reference = dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs)))
    worst = 0.0
    ok = True
    for name, got in outputs.items():
        want = reference[name]
        error = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))) if got.size else 0.0
        worst = max(worst, error)
        ok = ok and bool(np.allclose(got, want, rtol=CHECK_RTOL, atol=CHECK_ATOL))
        print(f"check {name}: max |tessel - onnxruntime| = {error:.3g}")
    print(f"check: {'ok' if ok else 'MISMATCH'} (max error {worst:.3g}; rtol {CHECK_RTOL}, atol {CHECK_ATOL})")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `tessel` command."""
    parser = _Parser(prog="tessel", description="Tessel: compile ONNX models for one or many devices.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    inspect = commands.add_parser("inspect", help="summarize a model: inputs, ops, parameters, FLOPs, memory bound")
    inspect.add_argument("model", help="path of an .onnx model")
    inspect.add_argument("--input-shape", action="append", default=[], metavar="NAME=DIMS",
                         help="bind an input's shape, e.g. x=1x3x224x224 (repeatable)")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(run=_cmd_inspect)

    compile_cmd = commands.add_parser("compile", help="compile a model into an artifact directory")
    compile_cmd.add_argument("model", help="path of an .onnx model")
    compile_cmd.add_argument("-o", "--output", required=True, metavar="DIR", help="artifact directory to write")
    compile_cmd.add_argument("--target", default="llvm", help="llvm (host CPU, default) or cuda:sm_XX")
    compile_cmd.add_argument("--input-shape", action="append", default=[], metavar="NAME=DIMS",
                             help="bind an input's shape, e.g. x=1x3x224x224 (repeatable)")
    compile_cmd.add_argument("--jobs", type=int, default=None, help="kernels compiled at once (default: one per core)")
    compile_cmd.add_argument("--force", action="store_true", help="replace an existing artifact directory")
    compile_cmd.add_argument("--dump-after", action="append", default=[], metavar="PASS", choices=PASS_NAMES,
                             help="write the graph after PASS to reports/after_PASS.txt and .onnx (repeatable)")
    compile_cmd.add_argument("--skip-pass", action="append", default=[], metavar="PASS", choices=PASS_NAMES,
                             help="leave PASS out of the pipeline (repeatable), e.g. --skip-pass fuse")
    compile_cmd.add_argument("--verify", action="store_true", help="check the graph's invariants after every pass")
    compile_cmd.add_argument("--device-memory", metavar="SIZE",
                             help="memory of the device, e.g. 512MiB: fail when weights and activations do not fit")
    compile_cmd.set_defaults(run=_cmd_compile)

    run = commands.add_parser("run", help="run a compiled artifact")
    run.add_argument("artifact", help="artifact directory written by 'tessel compile'")
    run.add_argument("--inputs", metavar="IN.npz", help="inputs by name (default: random inputs)")
    run.add_argument("--outputs", metavar="OUT.npz", help="write the outputs here")
    run.add_argument("--repeat", type=int, default=0, metavar="N", help="time N more runs and print the latency")
    run.add_argument("--check", action="store_true", help="compare with onnxruntime on the original model")
    run.add_argument("--force", action="store_true", help="replace an existing --outputs file")
    run.set_defaults(run=_cmd_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `tessel` command; return its exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except TesselError as exc:
        print(f"tessel: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("tessel: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
