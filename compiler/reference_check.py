"""`tessel run --check`: compare a run's outputs with onnxruntime's on the original model.

The model is found in this order: the one given (`--reference MODEL.onnx`), the
artifact's own copy (model.onnx, compiled with --keep-model), the file it was
compiled from (recorded in reports/compile.json) while its sha256 still matches.

NaN equals NaN at the same position, as IEEE-aware comparisons do (numpy's equal_nan);
a NaN on one side only is a mismatch, reported by position.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from tessel.ir.errors import TesselError
from tessel.runtime.artifact_files import file_hash
from tessel.runtime.safe_write import FileReadError, read_text

from .artifact import MODEL_FILE

CHECK_RTOL, CHECK_ATOL = 1e-3, 1e-4
# An artifact compiled with bf16 convs (compiler/precision.py) is checked against its output's scale: every element
# within this fraction of the output's largest magnitude (bf16 keeps 8 significant bits; ResNet-18's logits
# measured within 0.15% of their scale on 100 random inputs).
BF16_SCALED_TOL = 1e-2


@dataclass(frozen=True)
class Tolerance:
    """What a check allows: |tessel - reference| <= atol + rtol · |reference|, the atol `scaled` by the output's
    largest magnitude when set (bf16 artifacts)."""

    rtol: float = CHECK_RTOL
    atol: float = CHECK_ATOL
    scaled: float | None = None

    def bounds(self, want: np.ndarray) -> tuple[float, float]:
        """(rtol, atol) for reference output `want`."""
        if self.scaled is None:
            return self.rtol, self.atol
        return 0.0, self.scaled * largest_magnitude(want)

    def text(self) -> str:
        """The tolerance as the check's verdict states it."""
        if self.scaled is None:
            return f"rtol {self.rtol}, atol {self.atol}"
        return f"bf16 artifact: within {self.scaled:g} x the output's largest magnitude"


def largest_magnitude(values: np.ndarray) -> float:
    """The largest finite |value| (0 when there is none)."""
    finite = np.abs(values[np.isfinite(values)])
    return float(finite.max()) if finite.size else 0.0


def artifact_tolerance(directory: Path) -> Tolerance:
    """The check's tolerance for the artifact at `directory`: scaled for one compiled with bf16 convs."""
    try:
        precision = json.loads(read_text(directory, "reports/compile.json")).get("precision") or {}
    except (FileReadError, ValueError, AttributeError):
        precision = {}
    return Tolerance(scaled=BF16_SCALED_TOL) if precision.get("used") == "bf16" else Tolerance()


class ReferenceRunError(TesselError):
    """onnxruntime cannot run the model, so there is nothing to compare with."""


@dataclass(frozen=True)
class ReferenceModel:
    """The model onnxruntime runs for the check: a file, or serialized bytes (re-batched), and its name in messages."""

    source: str | bytes
    label: str


def reference_model(directory: Path, given: str | None = None) -> ReferenceModel:
    """The model to compare the artifact at `directory` with (see the module docstring); ReferenceRunError, one
    line saying what to do, when there is none."""
    record = _compile_record(directory)
    if given is not None:
        path = Path(given)
        if not path.is_file():
            raise ReferenceRunError(f"--reference {given}: no such file")
        return _rebatched(path, record.get("batch"))
    if (directory / MODEL_FILE).is_file():
        return ReferenceModel(str(directory / MODEL_FILE), str(directory / MODEL_FILE))
    recorded = record.get("path")
    advice = "compile with --keep-model, or give the model: --reference MODEL.onnx"
    if not isinstance(recorded, str):
        raise ReferenceRunError(f"--check: {directory} holds no copy of the model and no record of its file; {advice}")
    path = Path(recorded)
    if not path.is_file():
        raise ReferenceRunError(f"--check: {directory} holds no copy of the model and {path}, which it was compiled "
                                f"from, is gone; {advice}")
    if file_hash(path) != record.get("sha256"):
        raise ReferenceRunError(f"--check: {path}, which {directory} was compiled from, has changed since; {advice}")
    return _rebatched(path, record.get("batch"))


def _compile_record(directory: Path) -> dict:
    """reports/compile.json's "model" entry; empty when the report is missing or unreadable."""
    try:
        record = json.loads(read_text(directory, "reports/compile.json")).get("model")
    except (FileReadError, ValueError, AttributeError):
        return {}
    return record if isinstance(record, dict) else {}


def _rebatched(path: Path, batch) -> ReferenceModel:
    """The model file as compiled: re-declared to the artifact's batch when it was compiled with one."""
    if not isinstance(batch, int):
        return ReferenceModel(str(path), str(path))
    from tessel import ir
    from tessel.ir.onnx_import import with_batch

    return ReferenceModel(with_batch(ir.load_model(str(path)), batch).SerializeToString(), f"{path} (batch {batch})")


@dataclass(frozen=True)
class Comparison:
    """How one output differs from its reference."""

    max_error: float  # over positions where neither side is NaN; equal infinities differ by 0
    nan_mismatches: int  # positions where exactly one side is NaN
    first_nan_mismatch: tuple[int, ...] | None
    ok: bool
    max_relative: float = 0.0  # max_error over the reference's largest finite magnitude


def compare(got: np.ndarray, want: np.ndarray, rtol: float = CHECK_RTOL, atol: float = CHECK_ATOL) -> Comparison:
    """Compare an output with its reference: within rtol/atol where both are numbers, NaN where both are NaN."""
    if got.shape != want.shape:
        return Comparison(float("inf"), 0, None, False)
    g, w = got.astype(np.float64), want.astype(np.float64)
    g_nan, w_nan = np.isnan(g), np.isnan(w)
    nan_mismatch = g_nan != w_nan
    numbers = ~(g_nan | w_nan)
    with np.errstate(invalid="ignore"):
        difference = np.where(g == w, 0.0, np.abs(g - w))[numbers]  # g == w: equal infinities are no error
        bound = atol + rtol * np.abs(w[numbers])
        within = bool(np.all((difference == 0) | (np.isfinite(difference) & (difference <= bound))))
    positions = np.argwhere(nan_mismatch)
    max_error = float(difference.max()) if difference.size else 0.0
    scale = largest_magnitude(w)
    return Comparison(max_error=max_error,
                      nan_mismatches=len(positions),
                      first_nan_mismatch=tuple(int(i) for i in positions[0]) if len(positions) else None,
                      ok=within and not len(positions),
                      max_relative=max_error / scale if scale > 0 else (0.0 if max_error == 0 else float("inf")))


def onnxruntime():
    """The onnxruntime module, the reference of the check; ReferenceRunError, one line, when it cannot be imported
    (callers ask before a run, so a check that cannot happen costs no run)."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise ReferenceRunError(f"--check needs onnxruntime, which cannot be imported ({exc}); "
                                "pip install onnxruntime") from None
    return ort


def reference_outputs(model: ReferenceModel, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """onnxruntime's outputs of `model` by name; ReferenceRunError (one line) when it cannot run the model."""
    ort = onnxruntime()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(model.source, options, providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(None, dict(inputs))))
    except Exception as exc:  # onnxruntime's errors share no base class beyond Exception
        reason = " ".join(str(exc).split())[:300]
        raise ReferenceRunError(f"--check: onnxruntime cannot run {model.label} ({reason}); the run's outputs are not "
                             "compared") from exc


@dataclass(frozen=True)
class OutputCheck:
    """One output's comparison with onnxruntime, and the remarks a person needs (NaN on one side, shapes)."""

    name: str
    comparison: Comparison
    remarks: tuple[str, ...]

    def line(self) -> str:
        """The output's line of the check report."""
        return (f"check {self.name}: max |tessel - onnxruntime| = {self.comparison.max_error:.3g} "
                f"({self.comparison.max_relative:.3g} of the output's largest magnitude)"
                + "".join(f"; {remark}" for remark in self.remarks))


@dataclass(frozen=True)
class CheckResult:
    """Every output's comparison with onnxruntime and the verdict."""

    outputs: tuple[OutputCheck, ...]
    tolerance: Tolerance = Tolerance()

    @property
    def ok(self) -> bool:
        """True when every output matches."""
        return all(o.comparison.ok for o in self.outputs)

    @property
    def max_error(self) -> float:
        """The largest error over the outputs."""
        return max((o.comparison.max_error for o in self.outputs), default=0.0)

    def lines(self) -> list[str]:
        """The check report: a line per output and the verdict."""
        return [o.line() for o in self.outputs] + [
            f"check: {'ok' if self.ok else 'MISMATCH'} (max error {self.max_error:.3g}; {self.tolerance.text()}; "
            "NaN equals NaN at the same position)"]

    def to_json(self) -> dict:
        """The result for `--json`."""
        return {"ok": self.ok, "max_error": self.max_error, "rtol": self.tolerance.rtol, "atol": self.tolerance.atol,
                **({"scaled_tolerance": self.tolerance.scaled} if self.tolerance.scaled is not None else {}),
                "outputs": {o.name: {"ok": o.comparison.ok, "max_error": o.comparison.max_error,
                                     "max_relative_error": o.comparison.max_relative,
                                     "nan_mismatches": o.comparison.nan_mismatches, "remarks": list(o.remarks)}
                            for o in self.outputs}}


def check_outputs(model: ReferenceModel, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray],
                  tolerance: Tolerance = Tolerance()) -> CheckResult:
    """Compare each output of a run with onnxruntime's on the same inputs, within `tolerance`."""
    reference = reference_outputs(model, inputs)
    checks = []
    for name, got in outputs.items():
        if name not in reference:
            raise ReferenceRunError(f"--check: onnxruntime's outputs of {model.label} lack '{name}'; the run's outputs are not compared")
        want = reference[name]
        result = compare(got, want, *tolerance.bounds(np.asarray(want, np.float64)))
        remarks = []
        if result.nan_mismatches:
            at = result.first_nan_mismatch
            remarks.append(f"NaN on one side only at {result.nan_mismatches} position(s), first [{','.join(map(str, at))}]: "
                           f"tessel {got[at]}, onnxruntime {want[at]}")
        if got.shape != want.shape:
            remarks.append(f"shapes differ: {got.shape} vs {want.shape}")
        checks.append(OutputCheck(name, result, tuple(remarks)))
    return CheckResult(tuple(checks), tolerance)
