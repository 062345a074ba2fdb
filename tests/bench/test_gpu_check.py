"""bench/gpu_check.py end to end on this machine: pack an llvm artifact, run it from the pack on TVM's runtime alone."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def packed(tmp_path_factory, kernel_cache) -> Path:
    out = tmp_path_factory.mktemp("gpu-check") / "pack"
    python = f"{sys.version_info.major}{sys.version_info.minor}"
    subprocess.run([sys.executable, "bench/gpu_check.py", "pack", "--target", "llvm", "-o", str(out), "--python", python,
                    "--models", "mtcnn_onet", "oww_hey_jarvis", "--cache-dir", str(kernel_cache), "--limit-mib", "12"],
                   cwd=REPO, check=True, capture_output=True, timeout=600)
    return out


def test_the_pack_holds_only_what_the_executor_reads(packed):
    (part,) = sorted(packed.glob("part*"))
    cases = json.loads((part / "cases.json").read_text())["cases"]
    assert {c["name"] for c in cases} == {"mtcnn_onet", "oww_hey_jarvis"}
    for case in cases:
        names = set(case["files"])
        assert "plan.json" in names and "weights.npz" in names and any(n.endswith(".so") for n in names)
        assert not names & {"model.onnx", "graph.json"} and not any(n.startswith("reports/") for n in names)
        for digest in case["files"].values():  # stored deflated under the hash of what they inflate to
            assert hashlib.sha256(zlib.decompress((part / "blobs" / digest).read_bytes())).hexdigest() == digest
    assert (part / "tvm_runtime.tar.gz").stat().st_size < 8 << 20  # no compiler library inside


def test_running_the_pack_matches_onnxruntime_on_the_runtime_library_alone(packed, tmp_path):
    (part,) = sorted(packed.glob("part*"))
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "run", str(part), "--json", str(tmp_path / "r.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "runtime library only: True" in done.stdout
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert {r["model"] for r in rows} == {"mtcnn_onet", "oww_hey_jarvis"} and all(r["matches"] for r in rows)
