"""The `tessel` command line.

Every user error ends as one line on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from tessel.ir.errors import ShapeBindingError, TesselError, UnsupportedModelError

from .sizes import format_bytes

EXIT_USAGE = 2


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
    from tessel.backends.builder import ProgressBar, stderr_progress

    from .api import compile as compile_model
    from .artifact import check_destination

    output = Path(args.output)
    options = _compile_options(args)  # every option checked before anything is written
    check_destination(output, args.force)  # before compiling: refuse early, not after minutes of work
    _check_writable_directory(output)
    artifact = compile_model(args.model, options, progress=stderr_progress,
                             profile_progress=ProgressBar("timing algorithm candidates"))
    artifact.save(output, overwrite=args.force)
    report = artifact.report()
    memory = report["memory"]
    print(f"compiled {args.model} for {report['target']}: {report['kernels']} kernels "
          f"({report['kernels_cached']} from cache), {report['kernel_calls']} kernel calls per run, "
          f"activations {format_bytes(memory['arena_bytes'])} (bound {format_bytes(memory['bound_bytes'])}), "
          f"weights {format_bytes(memory['weights_bytes'])} -> {output}")
    print(f"artifact sha256 {artifact.sha256} (publish it; 'tessel run --expect-sha256' checks it)")
    if report["conv_layout"]["blocked_values"]:
        print(f"{report['conv_layout']['blocked_values']} activations kept in NCHW[16]c between conv kernels")
    if "placement" in report:
        placed = report["placement"]
        print(f"placement {placed['planner']} on {report['devices']} devices: predicted "
              f"{1e3 * placed['predicted_makespan_s']:.2f} ms per batch (bound {1e3 * placed['bound_s']:.2f} ms), "
              f"{format_bytes(placed['transfer_bytes'])} sent per micro-batch; see {output / 'reports' / 'placement.md'}")
    if "algo" in report:
        algo = report["algo"]
        versus = (f" vs {1e3 * algo['best_single_total_seconds']:.2f} ms with the best single algorithm"
                  if algo["best_single_total_seconds"] else "")
        print(f"algorithms ({algo['mode']}): conv/matmul layers {1e3 * algo['total_seconds']:.2f} ms{versus}; "
              f"see {output / 'reports' / 'algo.md'}")
    for name in args.dump_after:
        print(f"graph after {name}: {output / 'reports' / f'after_{name}.txt'} and .onnx")
    return 0


def _compile_options(args: argparse.Namespace):
    """The CompileOptions the compile command's flags give."""
    from .options import CompileOptions

    return CompileOptions(
        target=args.target, input_shapes=_input_shapes(args.input_shape), batch=args.batch, devices=args.devices,
        placement=args.placement, microbatches=args.microbatches, pins=args.pin, machine=args.machine,
        profile=not args.no_profile, reprofile=args.reprofile, device_memory=args.device_memory,
        skip_passes=args.skip_pass, verify=args.verify, dump_after=args.dump_after, algo_select=args.algo_select,
        workspace_limit=args.workspace_limit, batch_policy=args.batch_policy, profile_budget=args.profile_budget,
        conv_layout=args.conv_layout, keep_model=args.keep_model, jobs=args.jobs)


def _check_writable_directory(output: Path) -> None:
    """Refuse an artifact directory whose nearest existing ancestor cannot be written (read-only, no permission)."""
    from tessel.runtime.errors import ArtifactError

    ancestor = output.absolute().parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ArtifactError(f"{output}: cannot write the artifact there: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK):
        raise ArtifactError(f"{output}: cannot write the artifact there: {ancestor} is not writable "
                            "(read-only file system or no permission); choose another -o")


def _read_inputs(path: str | None, artifact) -> dict[str, np.ndarray]:
    from tessel.runtime.inputs import random_input, read_npz_inputs

    if path is None:
        rng = np.random.default_rng(0)
        print("no --inputs given: running on random inputs", file=sys.stderr)
        return {name: random_input(t, rng) for name, t in artifact.batch_input_types().items()}
    return read_npz_inputs(path, artifact.batch_input_types(), artifact.plan.get("input_defaults", ()))


def _outputs_path(text: str) -> Path:
    """The file `--outputs` writes: numpy's savez adds .npz to a name without it."""
    return Path(text if text.endswith(".npz") else text + ".npz")


def _cmd_run(args: argparse.Namespace) -> int:
    from tessel.runtime.errors import ArtifactError
    from tessel.runtime.safe_write import check_writable, write_npz

    from .api import load

    artifact = load(args.artifact, expect_sha256=args.expect_sha256)
    outputs_path = _outputs_path(args.outputs) if args.outputs else None
    if outputs_path:  # refused before the run, not after it; write_file checks again
        check_writable(outputs_path.parent, outputs_path.name, overwrite=args.force)
    if args.workers is not None and args.workers != artifact.devices:
        raise ArtifactError(f"{args.artifact}: compiled for {artifact.devices} device(s); run it with --workers "
                            f"{artifact.devices} or recompile with --devices {args.workers}")
    reference = None
    if args.check or args.reference:  # found before the run: a missing model is reported at once
        from .reference_check import reference_model

        reference = reference_model(artifact.directory, args.reference)
    inputs = _read_inputs(args.inputs, artifact)
    measured, times = None, []
    from tessel.runtime.session import InferenceSession

    from .bench_command import measure_stream

    if artifact.devices > 1:  # checked before any worker starts
        artifact.check_inputs(inputs)
        print(f"running on {artifact.devices} local workers", file=sys.stderr)
    with InferenceSession(artifact, timeout=args.timeout) as session:
        outputs = session.run(inputs)
        if args.repeat > 0 and (artifact.devices > 1 or artifact.microbatches > 1):
            measured = measure_stream(session, inputs, args.repeat)
        else:
            for _ in range(max(args.repeat, 0)):
                started = time.perf_counter()
                session.run(inputs)
                times.append(time.perf_counter() - started)
    placement = _print_stream(artifact, measured) if measured else None
    for name, array in outputs.items():
        summary = f"min {array.min():.6g} max {array.max():.6g}" if array.size and array.dtype != bool else ""
        print(f"{name}: {array.dtype}[{','.join(map(str, array.shape))}] {summary}")
    if times:
        print(f"latency over {len(times)} runs: median {1e3 * float(np.median(times)):.3f} ms, min {1e3 * min(times):.3f} ms")
    if outputs_path:  # before the reports: a report that cannot be written must not cost the outputs
        write_npz(outputs_path.parent, outputs_path.name, outputs, overwrite=args.force)
    if placement:
        _record_measured(artifact, placement, measured)
    if reference:
        from .reference_check import check_outputs

        return 0 if check_outputs(reference, inputs, outputs) else 1
    return 0


def _print_stream(artifact, measured) -> dict | None:
    """Print the latency of one run and the time per batch streaming --repeat runs, each against the placement's
    prediction; return the placement report (None, with a note, when it cannot be read)."""
    from tessel.runtime.safe_write import FileReadError, read_text

    try:
        placement = json.loads(read_text(artifact.directory, "reports/placement.json"))
        predictions = (float(placement["predicted_makespan_s"]), float(placement["predicted_steady_s"]))
    except (FileReadError, ValueError, KeyError, TypeError) as exc:
        print(f"note: measured times not compared with the placement: reports/placement.json is unusable ({exc})",
              file=sys.stderr)
        return None
    for label, got, predicted in (("latency of one run", measured["latency_s"], predictions[0]),
                                  (f"time per batch over {measured['runs']} streamed runs", measured["seconds_per_batch"],
                                   predictions[1])):
        print(f"{label}: {1e3 * got:.3f} ms; placement predicted {1e3 * predicted:.3f} ms "
              f"(error {100 * (predicted - got) / got:+.1f}%)")
    return placement


def _record_measured(artifact, placement: dict, measured) -> None:
    """Add the measured times to reports/placement.json and .md, atomically and never through a link;
    an artifact that cannot be written (read-only) keeps its reports, with one note line."""
    from tessel.runtime.safe_write import FileWriteError, write_text

    from .distribute import placement_markdown

    placement["measured"] = {**measured, "prediction_error": (placement["predicted_steady_s"] - measured["seconds_per_batch"])
                             / measured["seconds_per_batch"],
                             "latency_prediction_error": (placement["predicted_makespan_s"] - measured["latency_s"])
                             / measured["latency_s"]}
    try:
        write_text(artifact.directory, "reports/placement.json", json.dumps(placement, indent=1))
        write_text(artifact.directory, "reports/placement.md", placement_markdown(placement))
    except FileWriteError as exc:
        print(f"note: measured times not added to the reports: {exc}", file=sys.stderr)
        return
    print(f"measured times added to {artifact.directory / 'reports' / 'placement.md'}")


def version_line() -> str:
    """Tessel's version, the TVM it builds kernels with and the ONNX opset it imports models into."""
    from tessel import __version__
    from tessel.backends.tvm_env import version as tvm_version
    from tessel.ir.schema import CANONICAL_OPSET

    return f"tessel {__version__} (TVM {tvm_version()}, ONNX opset {CANONICAL_OPSET})"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `tessel` command."""
    from .options import CompileOptions

    parser = _Parser(prog="tessel", description="Tessel: compile ONNX models for one or many devices.",
                     epilog="Trust: an artifact is native code. Run only artifacts that you or a source you trust "
                            "compiled; check the digest it was published with: tessel run DIR --expect-sha256 SHA256.")
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print Tessel's, TVM's and the ONNX opset versions")
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
    compile_cmd.add_argument("--target", default=CompileOptions.default("target"),
                             help="llvm (host CPU, default) or cuda:sm_XX")
    compile_cmd.add_argument("--input-shape", action="append", default=[], metavar="NAME=DIMS",
                             help="bind an input's shape, e.g. x=1x3x224x224 (repeatable)")
    compile_cmd.add_argument("--jobs", type=int, default=None, help="kernels compiled at once (default: one per core)")
    compile_cmd.add_argument("--force", action="store_true", help="replace an existing artifact directory")
    compile_cmd.add_argument("--dump-after", action="append", default=[], metavar="PASS",
                             choices=CompileOptions.CHOICES["dump_after"],
                             help="write the graph after PASS to reports/after_PASS.txt and .onnx (repeatable)")
    compile_cmd.add_argument("--skip-pass", action="append", default=[], metavar="PASS",
                             choices=CompileOptions.CHOICES["skip_passes"],
                             help="leave PASS out of the pipeline (repeatable), e.g. --skip-pass fuse")
    compile_cmd.add_argument("--verify", action="store_true", help="check the graph's invariants after every pass")
    compile_cmd.add_argument("--keep-model", action="store_true",
                             help="keep a copy of the model in the artifact (model.onnx) for 'tessel run --check' elsewhere")
    compile_cmd.add_argument("--device-memory", metavar="SIZE",
                             help="memory of the device, e.g. 512MiB: fail when weights and activations do not fit")
    compile_cmd.add_argument("--batch", type=int, metavar="N", help="run N samples at once: axis 0 of every input becomes N")
    compile_cmd.add_argument("--devices", type=int, default=CompileOptions.default("devices"), metavar="N",
                             help="place the model on N devices (workers)")
    compile_cmd.add_argument("--placement", default=CompileOptions.default("placement"),
                             choices=CompileOptions.CHOICES["placement"], help="placement planner (default: the best predicted)")
    compile_cmd.add_argument("--microbatches", type=int, default=CompileOptions.default("microbatches"), metavar="K",
                             help="split the batch (axis 0) into K micro-batches that pipeline through the devices")
    compile_cmd.add_argument("--pin", action="append", default=[], metavar="REGEX=DEVICE",
                             help="keep nodes whose name matches REGEX on DEVICE (repeatable)")
    compile_cmd.add_argument("--machine", metavar="MACHINE.json",
                             help='devices, memory and link as JSON: {"devices": 2, "memory": "2GiB", '
                                  '"link": {"alpha_s": 5e-5, "beta_s_per_byte": 1e-9}}')
    compile_cmd.add_argument("--no-profile", action="store_true",
                             help="place with FLOP/byte estimates instead of timing the kernels on this machine")
    compile_cmd.add_argument("--reprofile", action="store_true",
                             help="time the kernels again (cached times taken on a busy machine mislead the planner)")
    compile_cmd.add_argument("--conv-layout", default=CompileOptions.default("conv_layout"),
                             choices=CompileOptions.CHOICES["conv_layout"],
                             help="activations between conv kernels: kept in NCHW[16]c (blocked) or NCHW")
    compile_cmd.add_argument("--algo-select", default=CompileOptions.default("algo_select"),
                             choices=CompileOptions.CHOICES["algo_select"],
                             help="choose each conv/matmul layer's algorithm and micro-batches: per layer within the "
                                  "workspace limit (dp) or with the layers' workspaces together within it (ilp)")
    compile_cmd.add_argument("--workspace-limit", metavar="SIZE",
                             help="workspace for --algo-select, e.g. 64MiB (default: what --device-memory leaves)")
    compile_cmd.add_argument("--batch-policy", default=CompileOptions.default("batch_policy"),
                             choices=CompileOptions.CHOICES["batch_policy"],
                             help="micro-batch sizes --algo-select may use")
    compile_cmd.add_argument("--profile-budget", type=float, metavar="SECONDS",
                             help="time candidate kernels for at most this long; estimate the rest")
    compile_cmd.set_defaults(run=_cmd_compile)

    run = commands.add_parser("run", help="run a compiled artifact")
    run.add_argument("artifact", help="artifact directory written by 'tessel compile'")
    run.add_argument("--inputs", metavar="IN.npz", help="inputs by name (default: random inputs)")
    run.add_argument("--outputs", metavar="OUT.npz", help="write the outputs here")
    run.add_argument("--repeat", type=int, default=0, metavar="N", help="time N more runs and print the latency")
    run.add_argument("--check", action="store_true", help="compare with onnxruntime on the original model (the "
                     "artifact's copy from --keep-model, else the file it was compiled from, if unchanged)")
    run.add_argument("--reference", metavar="MODEL.onnx", help="compare with onnxruntime on this model (implies --check)")
    run.add_argument("--force", action="store_true", help="replace an existing --outputs file")
    run.add_argument("--expect-sha256", metavar="SHA256", help="refuse the artifact unless its digest is SHA256 "
                     "(64 hex digits, or a file holding them), as printed by 'tessel compile'")
    run.add_argument("--workers", type=int, metavar="N",
                     help="local workers to spawn (must equal the artifact's devices; default: that many)")
    run.add_argument("--timeout", type=float, default=30.0, metavar="S",
                     help="seconds a worker waits for a peer before all of them stop (default 30)")
    run.set_defaults(run=_cmd_run)

    report = commands.add_parser("report", help="print an artifact's reports: compile, passes, memory, placement")
    report.add_argument("artifact", help="artifact directory written by 'tessel compile'")
    report.set_defaults(run=_cmd_report)

    from .bench_command import add_bench_parser

    add_bench_parser(commands)

    calibrate = commands.add_parser("calibrate", help="measure the link cost (alpha, beta) between two local workers")
    calibrate.add_argument("--repeat", type=int, default=20, metavar="N", help="round trips per message size")
    calibrate.set_defaults(run=_cmd_calibrate)
    return parser


def _cmd_report(args: argparse.Namespace) -> int:
    from tessel.runtime.safe_write import FileReadError, read_text

    from .api import load

    artifact = load(args.artifact)
    report = artifact.report()
    print(f"# {args.artifact}: {report['target']}, {report.get('devices', 1)} device(s), {report['kernel_calls']} kernel calls")
    for name in ("passes.md", "memory.md", "algo.md", "placement.md"):
        if not os.path.lexists(artifact.directory / "reports" / name):
            continue
        try:
            text = read_text(artifact.directory, f"reports/{name}")  # never a file a link points to elsewhere
        except FileReadError as exc:
            print(f"note: {exc}", file=sys.stderr)
            continue
        print()
        print(text.rstrip())
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from tessel.runtime.calibrate import calibrate

    alpha, beta, path = calibrate(args.repeat)
    print(f"link: alpha {1e6 * alpha:.1f} us, beta {1e9 * beta:.3f} ns/byte ({1 / beta / 1e9:.2f} GB/s) -> {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `tessel` command; return its exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except TesselError as exc:
        print(f"tessel: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # the file system refused something no check above foresaw: still one line
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"tessel: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except MemoryError:
        print("tessel: error: out of memory; use smaller inputs or a machine with more memory", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        # A stop signal during a launch says which signal and what was cleaned up; Ctrl-C elsewhere has no text.
        print(f"tessel: {exc or 'interrupted'}", file=sys.stderr)
        return 128 + getattr(exc, "signum", 2)


if __name__ == "__main__":
    sys.exit(main())
