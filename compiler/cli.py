"""The `tessel` command line.

Every user error ends as one line on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from tessel.ir.errors import ShapeBindingError, TesselError, UnsupportedModelError

from .arg_types import count_from, positive_seconds
from .cli_output import compile_lines, latency_line, latency_summary, output_line, output_summary, print_json
from .progress import NORMAL, QUIET, VERBOSE, logging_to_stderr, progress_bar

EXIT_USAGE = 2

_log = logging.getLogger("tessel.cli")


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


def _compile_values(items: Sequence[str]) -> dict[str, np.ndarray]:
    from .input_values import parse_compile_values

    return parse_compile_values(items)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .model_summary import format_summary, summarize

    report = summarize(args.model, _input_shapes(args.input_shape), _compile_values(args.input_value))
    print(json.dumps(report, indent=2) if args.json else format_summary(report))
    if report["unsupported"]:
        error = UnsupportedModelError([(u["op"], u["domain"], u["count"], u["first_node"], u["reason"]) for u in report["unsupported"]])
        print(f"tessel: error: {args.model}: {error}", file=sys.stderr)
        return EXIT_USAGE
    if report["import_error"]:
        print(f"tessel: error: {args.model}: {report['import_error']}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    from .artifact import check_destination

    output = Path(args.output)
    options = _compile_options(args)  # every option checked before anything is written
    check_destination(output, args.force)  # before compiling: refuse early, not after minutes of work
    _check_writable_directory(output)
    from .api import compile as compile_model  # the compiler's imports (TVM) take seconds: after the checks

    artifact = compile_model(args.model, options, progress=progress_bar("compiling kernels"),
                             profile_progress=progress_bar("timing algorithm candidates"))
    artifact.save(output, overwrite=args.force)
    report = artifact.report()
    if args.json:
        print_json({"artifact": str(output), "sha256": artifact.sha256, "report": report})
    else:
        print("\n".join(compile_lines(args.model, output, report, artifact.sha256, args.dump_after)))
    return 0


def _compile_options(args: argparse.Namespace):
    """The CompileOptions the compile command's flags give."""
    from .options import CompileOptions

    return CompileOptions(
        target=args.target, input_shapes=_input_shapes(args.input_shape), input_values=_compile_values(args.input_value),
        batch=args.batch, devices=args.devices,
        placement=args.placement, microbatches=args.microbatches, pins=args.pin, machine=args.machine,
        profile=not args.no_profile, reprofile=args.reprofile, device_memory=args.device_memory,
        skip_passes=args.skip_pass, verify=args.verify, dump_after=args.dump_after, algo_select=args.algo_select,
        workspace_limit=args.workspace_limit, batch_policy=args.batch_policy, profile_budget=args.profile_budget,
        conv_layout=args.conv_layout, keep_model=args.keep_model, jobs=args.jobs, allow_tf32=args.allow_tf32,
        precision=args.precision)


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


def _outputs_path(text: str) -> Path:
    """The file `--outputs` writes: numpy's savez adds .npz to a name without it."""
    return Path(text if text.endswith(".npz") else text + ".npz")


def _execute(artifact, inputs: dict[str, np.ndarray], repeat: int, timeout: float):
    """Run the artifact once in a session, then `repeat` more times to time it: (outputs, the streamed times of a
    multi-worker run or None, the seconds of each timed single-process run)."""
    from tessel.runtime.session import InferenceSession

    from .bench_command import measure_stream

    if artifact.devices > 1:  # checked before any worker starts
        artifact.check_inputs(inputs)
        _log.info("running on %d local workers", artifact.devices)
    times: list[float] = []
    with InferenceSession(artifact, timeout=timeout) as session:
        outputs = session.run(inputs)
        if repeat > 0 and (artifact.devices > 1 or artifact.microbatches > 1):
            return outputs, measure_stream(session, inputs, repeat), times
        for _ in range(repeat):
            started = time.perf_counter()
            session.run(inputs)
            times.append(time.perf_counter() - started)
    return outputs, None, times


def _cmd_run(args: argparse.Namespace) -> int:
    from tessel.runtime.errors import ArtifactError, InputError
    from tessel.runtime.safe_write import check_writable, write_npz

    from .artifact import load
    from .branch_hints import unrunnable_branch_hint
    from .input_values import parse_input_values, run_inputs
    from .measured_times import placement_report, record_measured, stream_lines

    values = parse_input_values(args.input_value)
    artifact = load(args.artifact, expect_sha256=args.expect_sha256)
    outputs_path = _outputs_path(args.outputs) if args.outputs else None
    if outputs_path:  # refused before the run, not after it; write_file checks again
        check_writable(outputs_path.parent, outputs_path.name, overwrite=args.force)
    if args.workers is not None and args.workers != artifact.devices:
        raise ArtifactError(f"{args.artifact}: compiled for {artifact.devices} device(s); run it with --workers "
                            f"{artifact.devices} or recompile with --devices {args.workers}")
    if args.profile and artifact.devices > 1:
        raise ArtifactError(f"{args.artifact}: --profile times the kernels of one-device artifacts; this one has "
                            f"{artifact.devices} devices")
    reference = None
    if args.check or args.reference:  # found before the run: a missing model or onnxruntime is reported at once
        from .reference_check import onnxruntime, reference_model

        onnxruntime()
        reference = reference_model(artifact.directory, args.reference)
    inputs, guessed = run_inputs(args.inputs, artifact, values)
    try:
        outputs, measured, times = _execute(artifact, inputs, args.repeat, args.timeout)
    except TesselError as exc:
        hint = unrunnable_branch_hint(artifact.directory, str(exc), guessed)
        if hint is None:
            raise
        raise InputError(hint) from None
    if guessed:  # told after the run: a run that fails on them says so in its one error line
        _log.info("no --inputs given: ran on random inputs%s",
                  f" (all but {', '.join(sorted(values))}, set by --input-value)" if values else "")
    result: dict = {"outputs": {name: output_summary(array) for name, array in outputs.items()}}
    placement = placement_report(artifact) if measured else None
    lines = stream_lines(measured, placement) if placement else []
    lines += [output_line(name, summary) for name, summary in result["outputs"].items()]
    if times:
        result["latency"] = latency_summary(times)
        lines.append(latency_line(result["latency"]))
    if measured:
        result["measured"] = measured
    if args.profile:
        from .kernel_profile import kernel_profile, profile_lines

        result["profile"] = kernel_profile(artifact, inputs)
        lines += profile_lines(result["profile"])
    if outputs_path:  # before the reports: a report that cannot be written must not cost the outputs
        write_npz(outputs_path.parent, outputs_path.name, outputs, overwrite=args.force)
        result["outputs_file"] = str(outputs_path)
    if placement:
        record_measured(artifact, placement, measured)
    if not args.json:  # the outputs are shown even when the check below cannot run
        print("\n".join(lines))
    if reference:
        from .reference_check import artifact_tolerance, check_outputs

        check = check_outputs(reference, inputs, outputs, artifact_tolerance(artifact.directory))
        result["check"] = check.to_json()
        if not args.json:
            print("\n".join(check.lines()))
    if args.json:
        print_json(result)
    return 0 if reference is None or result["check"]["ok"] else 1


def version_line() -> str:
    """Tessel's version, the TVM it builds kernels with and the ONNX opset it imports models into."""
    from tessel import __version__
    from tessel.backends.tvm_env import version as tvm_version
    from tessel.ir.schema import CANONICAL_OPSET

    return f"tessel {__version__} (TVM {tvm_version()}, ONNX opset {CANONICAL_OPSET})"


def _output_options() -> argparse.ArgumentParser:
    """-v and -q, shared by every command."""
    common = argparse.ArgumentParser(add_help=False)
    chatter = common.add_mutually_exclusive_group()
    chatter.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=VERBOSE, default=NORMAL,
                         help="also print the details of each stage on stderr")
    chatter.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=QUIET,
                         help="print only warnings, errors and the result (no progress)")
    return common


_COMPILE_VALUE_HELP = ("the value of input NAME, known when compiling: it becomes a constant (e.g. a Reshape's "
                       "shape: shape=1,-1; one number or a comma list; repeatable)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `tessel` command."""
    from .options import CompileOptions

    common = [_output_options()]

    parser = _Parser(prog="tessel", description="Tessel: compile ONNX models for one or many devices.",
                     epilog="Trust: an artifact is native code. Run only artifacts that you or a source you trust "
                            "compiled; check the digest it was published with: tessel run DIR --expect-sha256 SHA256.")
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print Tessel's, TVM's and the ONNX opset versions")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    inspect = commands.add_parser("inspect", parents=common, help="summarize a model: inputs, ops, parameters, FLOPs, memory bound")
    inspect.add_argument("model", help="path of an .onnx model")
    inspect.add_argument("--input-shape", action="append", default=[], metavar="NAME=DIMS",
                         help="bind an input's shape, e.g. x=1x3x224x224 (repeatable)")
    inspect.add_argument("--input-value", action="append", default=[], metavar="NAME=VALUE", help=_COMPILE_VALUE_HELP)
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(run=_cmd_inspect)

    compile_cmd = commands.add_parser("compile", parents=common, help="compile a model into an artifact directory")
    compile_cmd.add_argument("model", help="path of an .onnx model")
    compile_cmd.add_argument("-o", "--output", required=True, metavar="DIR", help="artifact directory to write")
    compile_cmd.add_argument("--target", default=CompileOptions.default("target"),
                             help="llvm (host CPU, default) or cuda:sm_XX")
    compile_cmd.add_argument("--input-shape", action="append", default=[], metavar="NAME=DIMS",
                             help="bind an input's shape, e.g. x=1x3x224x224 (repeatable)")
    compile_cmd.add_argument("--input-value", action="append", default=[], metavar="NAME=VALUE", help=_COMPILE_VALUE_HELP)
    compile_cmd.add_argument("--jobs", type=count_from(1), default=None, help="kernels compiled at once (default: one per core)")
    compile_cmd.add_argument("--force", action="store_true", help="replace an existing artifact directory")
    compile_cmd.add_argument("--json", action="store_true",
                             help="print the result as one JSON document (the compile report) on stdout")
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
    compile_cmd.add_argument("--allow-tf32", action="store_true",
                             help="cuda (sm_80+): run convolutions on TF32 tensor cores (inputs rounded to a 10-bit "
                                  "mantissa, float32 sums; PyTorch's cuDNN default)")
    compile_cmd.add_argument("--precision", default=CompileOptions.default("precision"),
                             choices=CompileOptions.CHOICES["precision"],
                             help="fp32 computes as the model is written; fp64 computes its float32 tensors in float64 "
                                  "(CPU targets; for checking against a float64 reference); bf16 runs the dense convs "
                                  "with bf16 products and float32 sums (CPUs with avx512_bf16; convs that run "
                                  "Winograd stay float32 Winograd, which is faster); auto: bf16 where the "
                                  "CPU has it and those convs hold most of the FLOPs, else fp32")
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

    run = commands.add_parser("run", parents=common, help="run a compiled artifact")
    run.add_argument("artifact", help="artifact directory written by 'tessel compile'")
    run.add_argument("--inputs", metavar="IN.npz", help="inputs by name (default: random inputs)")
    run.add_argument("--outputs", metavar="OUT.npz", help="write the outputs here")
    run.add_argument("--input-value", action="append", default=[], metavar="NAME=VALUE",
                     help="set input NAME to VALUE everywhere (scalars and control inputs, e.g. sr=16000; repeatable)")
    run.add_argument("--repeat", type=count_from(0), default=0, metavar="N",
                     help="time N more runs and print the latency")
    run.add_argument("--check", action="store_true", help="compare with onnxruntime on the original model (the "
                     "artifact's copy from --keep-model, else the file it was compiled from, if unchanged)")
    run.add_argument("--reference", metavar="MODEL.onnx", help="compare with onnxruntime on this model (implies --check)")
    run.add_argument("--force", action="store_true", help="replace an existing --outputs file")
    run.add_argument("--expect-sha256", metavar="SHA256", help="refuse the artifact unless its digest is SHA256 "
                     "(64 hex digits, or a file holding them), as printed by 'tessel compile'")
    run.add_argument("--workers", type=int, metavar="N",
                     help="local workers to spawn (must equal the artifact's devices; default: that many)")
    run.add_argument("--profile", action="store_true", help="also time each kernel call and print its GFLOP/s "
                     "(one-device artifacts)")
    run.add_argument("--json", action="store_true", help="print the result as one JSON document on stdout")
    run.add_argument("--timeout", type=positive_seconds, default=30.0, metavar="S",
                     help="seconds a worker waits for a peer before all of them stop (default 30)")
    run.set_defaults(run=_cmd_run)

    report = commands.add_parser("report", parents=common, help="print an artifact's reports: compile, passes, memory, placement")
    report.add_argument("artifact", help="artifact directory written by 'tessel compile'")
    report.add_argument("--json", action="store_true", help="print every report as one JSON document")
    report.set_defaults(run=_cmd_report)

    from .bench_command import add_bench_parser

    add_bench_parser(commands, common)

    from .train_command import add_train_parser

    add_train_parser(commands, common)

    calibrate = commands.add_parser("calibrate", parents=common, help="measure the link cost (alpha, beta) between two local workers, and their shared-memory all-reduce's")
    calibrate.add_argument("--repeat", type=count_from(1), default=20, metavar="N", help="round trips per message size")
    calibrate.set_defaults(run=_cmd_calibrate)
    return parser


def _cmd_report(args: argparse.Namespace) -> int:
    from .api import load
    from .report_files import report_document, report_markdown

    artifact = load(args.artifact)
    if args.json:
        print_json(report_document(artifact))
        return 0
    report = artifact.report()
    print(f"# {args.artifact}: {report['target']}, {report.get('devices', 1)} device(s), {report['kernel_calls']} kernel calls")
    for text in report_markdown(artifact):
        print()
        print(text)
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from tessel.runtime.calibrate import calibrate
    from tessel.runtime.shared_reduce import available as shared_reduce_available
    from tessel.runtime.shared_reduce_link import calibrate_shared_reduce, describe

    fit, path = calibrate(args.repeat)
    print(f"link: {fit.describe()} -> {path}")
    if shared_reduce_available():
        fit, path = calibrate_shared_reduce(2, args.repeat)
        print(f"shared-memory all-reduce of 2 local workers: {describe(fit)} -> {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `tessel` command; return its exit code."""
    args = build_parser().parse_args(argv)
    with logging_to_stderr(args.verbosity):
        return _run_command(args)


def _run_command(args: argparse.Namespace) -> int:
    """Run the parsed command; every failure the user can act on becomes one line and its exit code."""
    try:
        return args.run(args)
    except TesselError as exc:
        _log.error("%s", exc)
        return EXIT_USAGE
    except OSError as exc:  # the file system refused something no check above foresaw: still one line
        where = f"{exc.filename}: " if exc.filename else ""
        _log.error("%s%s", where, exc.strerror or exc)
        return EXIT_USAGE
    except MemoryError:
        _log.error("out of memory; use smaller inputs or a machine with more memory")
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        # A stop signal during a launch says which signal and what was cleaned up (LaunchInterrupted's text);
        # a Ctrl-C elsewhere has none. Kernel build workers print nothing (their stderr is a file of the
        # builder's) and the builder kills them; atexit stops the idle ones.
        print(f"tessel: {str(exc) or 'interrupted (Ctrl-C)'}", file=sys.stderr)
        return 128 + getattr(exc, "signum", 2)


if __name__ == "__main__":
    sys.exit(main())
