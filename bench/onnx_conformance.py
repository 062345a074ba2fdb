"""ONNX operator conformance: the ONNX backend node tests through Tessel's importer.

Each node test (from `onnx.backend.test.case.node.collect_testcases()`) goes
through import (with its input shapes bound) → verify → export → onnxruntime,
and the outputs are compared with the test's expected outputs at the test's
own tolerances. A case that onnxruntime itself cannot run, or gets wrong, on
the original model is counted apart: it says nothing about Tessel.

    python bench/onnx_conformance.py [--filter SUBSTRING] [--show-failures]
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx.backend.test.case.node import collect_testcases  # noqa: E402

from tessel import ir  # noqa: E402
from tessel.ir.shape_operands import shape_deciding_inputs  # noqa: E402

OUTCOMES = ("pass", "unsupported", "import", "verify", "export", "runtime", "mismatch", "ort-cannot-run-original")


def _session(model_bytes: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def _matches(got, want, rtol: float, atol: float) -> bool:
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            return False
        if w.dtype.kind in "fc":
            if not np.allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True):
                return False
        elif not np.array_equal(g, w):
            return False
    return True


def _op_of(case) -> str:
    ops = sorted({n.op_type for n in case.model.graph.node})
    if len(ops) == 1:
        return ops[0]
    stem = re.sub(r"^test_", "", case.name).replace("_", "").lower()
    named = [op for op in ops if stem.startswith(op.lower())]
    return max(named, key=len) if named else "(multi-op: " + "+".join(ops) + ")"


def bound_inputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]):
    """How a test's inputs are given to Tessel, as a user would: (input shapes, input values known when compiling,
    the feeds left for the run). The inputs that decide shapes (Reshape's shape, Reduce axes, ...) are values."""
    values = {name: feeds[name] for name in shape_deciding_inputs(model) if name in feeds}
    run_feeds = {name: array for name, array in feeds.items() if name not in values}
    return {name: array.shape for name, array in run_feeds.items()}, values, run_feeds


def run_case(case) -> tuple[str, str]:
    """(outcome, detail) of one node test; outcome is one of OUTCOMES."""
    model = case.model
    initializer_names = {t.name for t in model.graph.initializer}
    inputs = [vi.name for vi in model.graph.input if vi.name not in initializer_names]
    # A 0-d input or output is stored as a numpy scalar: a tensor all the same.
    feeds_list, expected_list = ([np.asarray(a) if isinstance(a, np.generic) else a for a in part]
                                 for part in (case.data_sets[0] if case.data_sets else ([], [])))
    if any(not isinstance(a, np.ndarray) for a in feeds_list) or any(not isinstance(a, np.ndarray) for a in expected_list):
        return "unsupported", "inputs or outputs are sequences or optionals"
    feeds = dict(zip(inputs, feeds_list))
    try:
        shapes, values, run_feeds = bound_inputs(model, feeds)
        graph = ir.from_onnx(model, shapes, input_values=values)
    except ir.UnsupportedModelError as exc:
        return "unsupported", str(exc)
    except ir.VerificationError as exc:
        return "verify", str(exc)
    except ir.TesselError as exc:
        return "import", str(exc)
    try:
        exported = ir.to_onnx(graph)
        onnx.checker.check_model(exported, full_check=True)
        data = exported.SerializeToString()
    except Exception as exc:  # noqa: BLE001 - report, do not stop the sweep
        return "export", f"{type(exc).__name__}: {exc}"
    rtol, atol = getattr(case, "rtol", 1e-3), getattr(case, "atol", 1e-7)
    try:
        got = _session(data).run(None, run_feeds)
    except Exception as exc:  # noqa: BLE001
        original_ok, reason = _original_runs(model, feeds, expected_list, rtol, atol)
        return ("runtime" if original_ok else "ort-cannot-run-original"), reason or f"{type(exc).__name__}: {exc}"
    if _matches(got, expected_list, rtol, atol):
        return "pass", ""
    original_ok, reason = _original_runs(model, feeds, expected_list, rtol, atol)
    return ("mismatch" if original_ok else "ort-cannot-run-original"), reason or "outputs differ from the expected outputs"


def _original_runs(model, feeds, expected, rtol, atol) -> tuple[bool, str]:
    try:
        got = _session(model.SerializeToString()).run(None, feeds)
    except Exception as exc:  # noqa: BLE001
        return False, f"onnxruntime fails on the original: {str(exc).splitlines()[0][:160]}"
    if not _matches(got, expected, rtol, atol):
        return False, "onnxruntime gets the original wrong too"
    return True, ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--filter", default="", help="only tests whose name contains this")
    parser.add_argument("--show-failures", action="store_true", help="print each failing case and why")
    args = parser.parse_args(argv)
    cases = [c for c in collect_testcases() if args.filter in c.name]
    per_op: dict[str, Counter] = defaultdict(Counter)
    totals: Counter = Counter()
    start = time.perf_counter()
    for case in cases:
        outcome, detail = run_case(case)
        per_op[_op_of(case)][outcome] += 1
        totals[outcome] += 1
        if args.show_failures and outcome != "pass":
            print(f"{case.name}: {outcome}: {detail[:300]}")
    elapsed = time.perf_counter() - start
    print(f"\n{'op':<36} {'pass':>5} {'fail':>5} {'ort':>5}  failures by stage")
    for op in sorted(per_op):
        counts = per_op[op]
        fails = sum(v for k, v in counts.items() if k not in ("pass", "ort-cannot-run-original"))
        stages = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k not in ("pass", "ort-cannot-run-original"))
        print(f"{op:<36} {counts['pass']:>5} {fails:>5} {counts['ort-cannot-run-original']:>5}  {stages}")
    failed = sum(v for k, v in totals.items() if k not in ("pass", "ort-cannot-run-original"))
    print(f"\n{len(cases)} node tests over {len(per_op)} ops in {elapsed:.0f} s")
    print(f"passed {totals['pass']}, failed {failed}, onnxruntime cannot run the original {totals['ort-cannot-run-original']}")
    print("failures by stage: " + ", ".join(f"{k} {totals[k]}" for k in OUTCOMES[1:-1]))
    ops_all_pass = sum(1 for c in per_op.values() if c["pass"] and c["pass"] + c["ort-cannot-run-original"] == sum(c.values()))
    print(f"ops with every runnable test passing: {ops_all_pass} of {len(per_op)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
