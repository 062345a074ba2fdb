"""ONNX operator conformance: the ONNX backend node tests through Tessel.

Each node test (from `onnx.backend.test.case.node.collect_testcases()`) goes
through the stages in order, stopping at the first that fails:

- import: `ir.from_onnx` with the test's input shapes bound (verify included);
- export: `ir.to_onnx` → onnx.checker → onnxruntime, compared with the
  expected outputs (a test that onnxruntime cannot run, or gets wrong, on the
  original model says nothing about the export and goes on);
- compile: `tessel.compile` for llvm (kernel cache, no profiling);
- run: Tessel's runtime on the test's inputs;
- compare: the outputs against the expected ones with the test suite's own
  check (`Runner.assert_similar_outputs`, the case's rtol/atol).

Tests run in worker processes (crash isolation and a per-test timeout: a
worker that dies or overruns is replaced and the test is counted apart).

    python bench/onnx_conformance.py [--filter SUBSTRING] [--stage {import,export,compile,run}]
        [--jobs N] [--timeout SECONDS] [--show-failures] [--json PATH]
"""
from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import re
import signal
import sys
import time
import warnings
from collections import Counter, defaultdict, deque
from multiprocessing.connection import wait
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from onnx.backend.test.case.node import collect_testcases  # noqa: E402

STAGES = ("import", "export", "compile", "run")
# Failure outcomes in stage order; "ort-cannot-run-original" only ends a test run with --stage export.
FAILURES = ("unsupported", "import", "verify", "export", "export-ort-run", "export-ort-compare",
            "compile", "run", "compare", "timeout", "crash")
OUTCOMES = ("pass",) + FAILURES + ("ort-cannot-run-original",)


@functools.cache
def all_cases() -> tuple:
    """Every ONNX backend node test, collected once per process (collecting takes seconds)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cases' own generators overflow casts on purpose
        return tuple(collect_testcases())


def _session(model_bytes: bytes):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def _matches(got, want, rtol: float, atol: float) -> str:
    """'' when `got` passes the node-test suite's own output check against `want`, else why not."""
    from onnx.backend.test.runner import Runner

    try:
        Runner.assert_similar_outputs(list(want), [np.asarray(g) for g in got], rtol, atol)
    except (AssertionError, TypeError) as exc:
        return " ".join(str(exc).split())[:300]
    return ""


def _op_of(case) -> str:
    ops = sorted({n.op_type for n in case.model.graph.node})
    if len(ops) == 1:
        return ops[0]
    stem = re.sub(r"^test_", "", case.name).replace("_", "").lower()
    named = [op for op in ops if stem.startswith(op.lower())]
    return max(named, key=len) if named else "(multi-op: " + "+".join(ops) + ")"


def bound_inputs(model, feeds: dict[str, np.ndarray]):
    """How a test's inputs are given to Tessel, as a user would: (input shapes, input values known when compiling,
    the feeds left for the run). The inputs that decide shapes (Reshape's shape, Reduce axes, ...) are values."""
    from tessel.ir.shape_operands import shape_deciding_inputs

    values = {name: feeds[name] for name in shape_deciding_inputs(model) if name in feeds}
    run_feeds = {name: array for name, array in feeds.items() if name not in values}
    return {name: array.shape for name, array in run_feeds.items()}, values, run_feeds


def _feeds_and_expected(case):
    initializer_names = {t.name for t in case.model.graph.initializer}
    inputs = [vi.name for vi in case.model.graph.input if vi.name not in initializer_names]
    feeds_list, expected_list = case.data_sets[0] if case.data_sets else ([], [])
    # A 0-d result some cases hold as a NumPy scalar (np.float32(...)) is a tensor like any other.
    as_arrays = lambda values: [np.asarray(v) if isinstance(v, np.generic) else v for v in values]  # noqa: E731
    return inputs, as_arrays(feeds_list), as_arrays(expected_list)


def run_case(case, stage: str = "run") -> tuple[str, str]:
    """(outcome, detail) of one node test through the stages up to `stage`; outcome is one of OUTCOMES."""
    from tessel import ir

    inputs, feeds_list, expected_list = _feeds_and_expected(case)
    if any(not isinstance(a, np.ndarray) for a in feeds_list) or any(not isinstance(a, np.ndarray) for a in expected_list):
        return "unsupported", "inputs or outputs are sequences or optionals"
    feeds = dict(zip(inputs, feeds_list))
    try:
        shapes, values, run_feeds = bound_inputs(case.model, feeds)
        graph = ir.from_onnx(case.model, shapes, input_values=values)
    except ir.UnsupportedModelError as exc:
        return "unsupported", str(exc)
    except ir.VerificationError as exc:
        return "verify", str(exc)
    except ir.TesselError as exc:
        return "import", str(exc)
    if stage == "import":
        return "pass", ""
    rtol, atol = case.rtol, case.atol
    outcome, detail = _export_stage(graph, case.model, feeds, run_feeds, expected_list, rtol, atol)
    if outcome != "pass" and (outcome != "ort-cannot-run-original" or stage == "export"):
        return outcome, detail
    if stage == "export":
        return "pass", ""
    return _compile_stages(case.model, values, run_feeds, expected_list, rtol, atol, stage)


def _export_stage(graph, model, feeds, run_feeds, expected, rtol, atol) -> tuple[str, str]:
    import onnx

    from tessel import ir

    try:
        exported = ir.to_onnx(graph)
        onnx.checker.check_model(exported, full_check=True)
        data = exported.SerializeToString()
    except Exception as exc:  # noqa: BLE001 - report, do not stop the sweep
        return "export", f"{type(exc).__name__}: {exc}"
    try:
        got = _session(data).run(None, run_feeds)
    except Exception as exc:  # noqa: BLE001
        original_ok, reason = _original_runs(model, feeds, expected, rtol, atol)
        return ("export-ort-run" if original_ok else "ort-cannot-run-original"), reason or f"{type(exc).__name__}: {exc}"
    if not (why := _matches(got, expected, rtol, atol)):
        return "pass", ""
    original_ok, reason = _original_runs(model, feeds, expected, rtol, atol)
    return ("export-ort-compare" if original_ok else "ort-cannot-run-original"), reason or why


def _original_runs(model, feeds, expected, rtol, atol) -> tuple[bool, str]:
    try:
        got = _session(model.SerializeToString()).run(None, feeds)
    except Exception as exc:  # noqa: BLE001
        return False, f"onnxruntime fails on the original: {str(exc).splitlines()[0][:160]}"
    if _matches(got, expected, rtol, atol):
        return False, "onnxruntime gets the original wrong too"
    return True, ""


def _compile_stages(model, values, feeds, expected, rtol, atol, stage: str) -> tuple[str, str]:
    from tessel.compiler.api import compile

    try:
        artifact = compile(model, input_shapes={k: v.shape for k, v in feeds.items()}, input_values=values,
                           profile=False, jobs=1)
    except Exception as exc:  # noqa: BLE001 - report, do not stop the sweep
        return "compile", f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
    if stage == "compile":
        return "pass", ""
    try:
        outputs = artifact.run(feeds)
        got = [outputs[o.name] for o in model.graph.output]
    except Exception as exc:  # noqa: BLE001
        return "run", f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
    why = _matches(got, expected, rtol, atol)
    return ("compare", why) if why else ("pass", "")


def _worker(conn, cases, stage: str) -> None:
    """Run the cases whose indices arrive on `conn`, answering [index, outcome, detail] as JSON."""
    os.setpgrp()  # its own process group, so that a timeout also ends its kernel build workers
    warnings.simplefilter("ignore")
    while msg := conn.recv_bytes():
        index = int(msg)
        outcome, detail = run_case(cases[index], stage)
        conn.send_bytes(json.dumps([index, outcome, detail]).encode())


class _Pool:
    """Worker processes that each run one case at a time; one that dies or overruns is replaced."""

    def __init__(self, cases, stage: str, jobs: int, timeout: float):
        self._context = multiprocessing.get_context("fork")
        self._cases, self._stage, self._timeout = cases, stage, timeout
        self._slots = [self._start() for _ in range(jobs)]

    def _start(self):
        parent, child = self._context.Pipe()
        process = self._context.Process(target=_worker, args=(child, self._cases, self._stage), daemon=True)
        process.start()
        child.close()
        return {"process": process, "conn": parent, "index": None, "since": 0.0}

    def _kill(self, slot) -> None:
        try:
            os.killpg(slot["process"].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        slot["process"].join()
        slot["conn"].close()

    def results(self, indices):
        """Yield (index, outcome, detail) for every index, in completion order."""
        pending = deque(indices)
        while pending or any(s["index"] is not None for s in self._slots):
            for slot in self._slots:
                if slot["index"] is None and pending:
                    slot["index"], slot["since"] = pending.popleft(), time.monotonic()
                    slot["conn"].send_bytes(str(slot["index"]).encode())
            busy = [s for s in self._slots if s["index"] is not None]
            deadline = min(s["since"] for s in busy) + self._timeout
            ready = wait([s["conn"] for s in busy], timeout=max(0.0, deadline - time.monotonic()))
            for position, slot in enumerate(self._slots):
                if slot["index"] is None:
                    continue
                index = slot["index"]
                if slot["conn"] in ready:
                    try:
                        yield tuple(json.loads(slot["conn"].recv_bytes()))
                        slot["index"] = None
                        continue
                    except EOFError:
                        slot["process"].join(timeout=5)
                        outcome, detail = "crash", f"worker died (exit {slot['process'].exitcode})"
                elif time.monotonic() - slot["since"] >= self._timeout:
                    outcome, detail = "timeout", f"over {self._timeout:.0f} s"
                else:
                    continue
                self._kill(slot)
                self._slots[position] = self._start()
                yield index, outcome, detail

    def close(self) -> None:
        for slot in self._slots:
            slot["conn"].send_bytes(b"")
            slot["process"].join(timeout=10)
            if slot["process"].is_alive():
                self._kill(slot)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--filter", default="", help="only tests whose name contains this")
    parser.add_argument("--stage", choices=STAGES, default="run", help="the last stage to run (default: run, which compares)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes (default 2)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one test may take (default 300)")
    parser.add_argument("--show-failures", action="store_true", help="print each failing case and why")
    parser.add_argument("--json", help="write every test's op, outcome and detail to this JSON file")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.timeout <= 0:
        parser.error("--jobs and --timeout must be positive")
    cases = [c for c in all_cases() if args.filter in c.name]
    per_op: dict[str, Counter] = defaultdict(Counter)
    totals: Counter = Counter()
    records = {}
    start = time.perf_counter()
    pool = _Pool(cases, args.stage, args.jobs, args.timeout)
    try:
        for index, outcome, detail in pool.results(range(len(cases))):
            case = cases[index]
            op = _op_of(case)
            per_op[op][outcome] += 1
            totals[outcome] += 1
            records[case.name] = {"op": op, "outcome": outcome, "detail": detail}
            if args.show_failures and outcome != "pass":
                print(f"{case.name}: {outcome}: {detail[:300]}", flush=True)
    finally:
        pool.close()
    elapsed = time.perf_counter() - start
    if args.json:
        Path(args.json).write_text(json.dumps(dict(sorted(records.items())), indent=1))
    _print_table(per_op, totals, len(cases), elapsed, args.stage)
    return 0


def _print_table(per_op, totals, count: int, elapsed: float, stage: str) -> None:
    shown = [k for k in FAILURES if totals[k]]
    print(f"\n{'op':<36} {'pass':>5} {'fail':>5} {'ort':>4}  failures by stage")
    for op in sorted(per_op):
        counts = per_op[op]
        fails = sum(counts[k] for k in FAILURES)
        stages = ", ".join(f"{k} {counts[k]}" for k in FAILURES if counts[k])
        print(f"{op:<36} {counts['pass']:>5} {fails:>5} {counts['ort-cannot-run-original']:>4}  {stages}")
    failed = sum(totals[k] for k in FAILURES)
    print(f"\n{count} node tests over {len(per_op)} ops in {elapsed:.0f} s, through stage '{stage}'")
    print(f"passed {totals['pass']}, failed {failed}, onnxruntime cannot run the original {totals['ort-cannot-run-original']}")
    print("failures by stage: " + (", ".join(f"{k} {totals[k]}" for k in shown) or "none"))
    ops_all_pass = sum(1 for c in per_op.values() if c["pass"] and c["pass"] + c["ort-cannot-run-original"] == sum(c.values()))
    print(f"ops with every runnable test passing: {ops_all_pass} of {len(per_op)}")


if __name__ == "__main__":
    sys.exit(main())
