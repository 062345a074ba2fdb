"""Tessel's error types: every failure a user can cause is one of these.

Each error carries a single-line message that says what went wrong, where, and
what to do; the CLI prints it as is and exits with code 2.
"""
from __future__ import annotations


# Characters that break a line (str.splitlines, terminals) or drive a terminal: a message quotes names from
# models, plans and files as they are, so these are shown escaped and the message stays one line.
_ONE_LINE = str.maketrans({c: repr(c)[1:-1] for c in [*map(chr, range(32)), "\x7f", "\x85", "\u2028", "\u2029"]})


class TesselError(Exception):
    """Base class of every error Tessel raises on purpose; its message is always one line."""

    def __str__(self) -> str:
        return super().__str__().translate(_ONE_LINE)


class ModelLoadError(TesselError):
    """The model file is missing, unreadable, not ONNX, or a corrupt protobuf."""


class ModelImportError(TesselError):
    """The ONNX graph is readable but cannot become a static Tessel graph."""


class ShapeBindingError(ModelImportError):
    """An input shape is missing, malformed, or contradicts the model."""


class UnsupportedModelError(ModelImportError):
    """The model uses ops Tessel does not support; lists all of them at once.

    `unsupported` holds (op type, domain, node count, first node name, reason) tuples.
    """

    def __init__(self, unsupported: list[tuple[str, str, int, str, str]]):
        self.unsupported = unsupported
        parts = [
            f"{op} (domain {domain or 'ai.onnx'}, {count} node{'s' if count != 1 else ''}, first '{first}': {reason})"
            for op, domain, count, first, reason in unsupported
        ]
        kinds = len(unsupported)
        super().__init__(
            f"model uses {kinds} unsupported op type{'s' if kinds != 1 else ''}: " + "; ".join(parts)
            + " — replace these ops or export the model without them"
        )


class VerificationError(TesselError):
    """The graph violates an IR invariant (dangling value, cycle, type mismatch...)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(f"graph verification failed: {problems[0]}{more}")


class SerializationError(TesselError):
    """A serialized Tessel graph (JSON) is malformed."""


class InferenceFailure(Exception):
    """Type inference could not give a static type; the message says why."""
