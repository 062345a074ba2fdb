"""The `tessel` command line.

Every user error ends as one line on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from ir.errors import ShapeBindingError, TesselError, UnsupportedModelError

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
