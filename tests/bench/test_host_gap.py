"""bench/host_gap.py: a run's time split into its kernels and the host between them; bad input is one line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from onnx import helper, numpy_helper

from tessel.compiler.api import compile
from tests.ir.helpers import F, model

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import host_gap  # noqa: E402


def test_a_run_splits_into_its_kernels_and_the_host(kernel_cache):
    weight = np.random.default_rng(0).standard_normal((8, 4, 3, 3)).astype(np.float32)
    proto = model([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                   helper.make_node("Relu", ["c"], ["y"])],
                  [("x", F, [1, 4, 16, 16])], [("y", F, None)])
    proto.graph.initializer.append(numpy_helper.from_array(weight, "w"))
    artifact = compile(proto, cache_dir=kernel_cache)
    result = host_gap.measure(artifact, {"x": np.ones((1, 4, 16, 16), np.float32)}, runs=5)
    assert result["measured"] and result["runs"] == 5 and result["kernel_calls"] >= 1
    assert 0 < result["sum_of_kernel_minima_ms"] <= result["sum_of_kernel_p25_ms"] <= result["sum_of_kernel_medians_ms"]
    # Each timed run's whole time holds its kernels' time: the host's share is what is left, never negative.
    assert result["host_us"] > 0 and result["timed_run_ms"] >= result["kernels_ms"] > 0


def test_bad_arguments_are_one_line(tmp_path):
    for args in (["no_such_model"], ["no_such_model", "--runs", "0"], [str(tmp_path)]):  # a directory, no artifact
        done = subprocess.run([sys.executable, "bench/host_gap.py", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
