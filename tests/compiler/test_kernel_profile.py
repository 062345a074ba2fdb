"""`tessel run --profile`: each kernel's time and achieved GFLOP/s, FLOPs counted at compile time."""
from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import helper

from tessel.compiler.api import compile as compile_model
from tessel.compiler.cli import main
from tests.ir.helpers import F, model

ROWS, DEPTH, COLS = 32, 64, 48


def test_profile_reports_each_kernel_gflops(tmp_path, kernel_cache, capsys):
    weight = np.random.default_rng(0).standard_normal((DEPTH, COLS)).astype(np.float32)
    proto = model([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["y"])],
                  [("x", F, [ROWS, DEPTH])], [("y", F, [ROWS, COLS])], [("w", weight)])
    path = tmp_path / "m.onnx"
    onnx.save(proto, str(path))
    artifact = compile_model(str(path), cache_dir=kernel_cache).save(tmp_path / "m.tessel")
    assert main(["run", str(artifact), "--profile", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["profile"]
    matmul = [row for row in rows if row["gflop"]]
    assert len(matmul) == 1 and abs(matmul[0]["gflop"] - 2 * ROWS * DEPTH * COLS / 1e9) < 1e-6 + ROWS * COLS * 2 / 1e9
    assert matmul[0]["gflops"] > 0 and matmul[0]["ms"] > 0
    assert main(["run", str(artifact), "--profile"]) == 0
    assert "GFLOP/s" in capsys.readouterr().out
