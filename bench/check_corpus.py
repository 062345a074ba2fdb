"""`tessel run --check` on every corpus model, with the inputs made as the corpus documents them (its fills).

    python bench/check_corpus.py [--models a,b] [--work DIR]

Each model is compiled by `tessel compile` into a scratch folder (the shared kernel cache, under the heavy lock
/tmp/tessel_heavy.lock so that timings elsewhere are not spoiled), then run with `tessel run --check --json` on
the corpus inputs (an .npz made from the fills) and compared with onnxruntime. Prints one row per model;
exit code 0 when every model's check passes. Models the corpus marks negative (to be refused) are left out.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from tessel.compiler.corpus import CorpusModel, load_corpus

HEAVY_LOCK = "/tmp/tessel_heavy.lock"
COMPILE_TIMEOUT_S = 1800
RUN_TIMEOUT_S = 600


@contextmanager
def heavy_lock():
    """Hold the shared lock of heavy jobs (one at a time on this machine)."""
    with open(HEAVY_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _tessel(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tessel.compiler.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:160] if lines else ""


def check_model(model: CorpusModel, work: Path) -> dict:
    """Compile `model` and run it with --check on its corpus inputs; the row of the table."""
    artifact, inputs = work / f"{model.name}.tessel", work / f"{model.name}.inputs.npz"
    np.savez(inputs, **model.make_inputs(seed=0))
    shapes = [f"--input-shape={name}={'x'.join(map(str, shape))}" for name, shape in model.input_shapes.items()]
    started = time.perf_counter()
    with heavy_lock():
        compiled = _tessel("compile", str(model.path), "-o", str(artifact), "--keep-model", "--force", "-q", *shapes,
                           timeout=COMPILE_TIMEOUT_S)
    compile_s = time.perf_counter() - started
    row = {"model": model.name, "compile_s": round(compile_s, 1)}
    if compiled.returncode != 0:
        return {**row, "verdict": "compile failed", "detail": _last_line(compiled.stderr)}
    ran = _tessel("run", str(artifact), "--check", "--inputs", str(inputs), "--json", "-q", timeout=RUN_TIMEOUT_S)
    try:
        check = json.loads(ran.stdout)["check"]
    except (ValueError, KeyError):
        return {**row, "verdict": f"run failed (exit {ran.returncode})", "detail": _last_line(ran.stderr)}
    finally:
        shutil.rmtree(artifact, ignore_errors=True)
    return {**row, "verdict": "ok" if check["ok"] else "MISMATCH", "max_error": check["max_error"], "detail": ""}


def main(argv: list[str] | None = None) -> int:
    """Check the chosen corpus models (all by default) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated model names (default: every model not marked negative)")
    parser.add_argument("--work", help="scratch folder (default: a temporary one, removed at the end)")
    args = parser.parse_args(argv)
    models = [m for m in load_corpus() if not m.negative]
    if args.models:
        wanted = set(args.models.split(","))
        models = [m for m in models if m.name in wanted]
    work = Path(args.work or tempfile.mkdtemp(prefix="tessel-check-corpus-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"{'model':24} {'compile s':>9}  {'max error':>9}  verdict", flush=True)
    try:
        for model in models:
            row = check_model(model, work)
            rows.append(row)
            error = f"{row['max_error']:.2g}" if "max_error" in row else "-"
            print(f"{row['model']:24} {row['compile_s']:9.1f}  {error:>9}  {row['verdict']}"
                  + (f": {row['detail']}" if row["detail"] else ""), flush=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    passed = sum(r["verdict"] == "ok" for r in rows)
    print(f"{passed} of {len(rows)} models pass `tessel run --check` with the corpus fills")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
