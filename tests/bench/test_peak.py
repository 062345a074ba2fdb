"""bench/peak.py: the FMA peak measured through TVM on this CPU, printed with the CPU model."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _peak(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/peak.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_peak_is_measured_per_dtype_and_thread_count():
    done = _peak("--threads", "1", "--seconds", "0.05", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["cpu"] and result["threads"] == 1 and result["measured"]
    assert set(result["gflops"]) <= {"float32", "bfloat16"} and result["gflops"]["float32"]["1"] > 0
    assert all(by_threads["1"] > 0 for by_threads in result["gflops"].values())


def test_bad_arguments_are_one_line():
    done = _peak("--threads", "0")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--threads" in done.stderr
