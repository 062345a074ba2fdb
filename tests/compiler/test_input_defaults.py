"""An initializer that is also a graph input is an overridable default (as in onnxruntime), through compile,
save, load, `tessel run --inputs` and `--check`; invalid models are one line and exit 2 from the CLI (issue 13, item 8)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
from onnx import helper

from tessel import compiler
from tests.ir.helpers import F, model

X = np.array([10, 20], np.float32)


def _defaulted_model(path):
    m = model([helper.make_node("Add", ["x", "w"], ["y"])], [("x", F, [2]), ("w", F, [2])], [("y", F, [2])],
              initializers=[("w", np.array([1, 2], np.float32))])
    onnx.save(m, path)
    return path


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tessel.compiler.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_default_is_used_unless_the_caller_overrides_it(tmp_path):
    artifact = compiler.compile(_defaulted_model(tmp_path / "m.onnx"))
    assert set(artifact.inputs) == {"x", "w"}
    np.testing.assert_array_equal(artifact.run({"x": X})["y"], [11, 22])
    np.testing.assert_array_equal(artifact.run({"x": X, "w": np.array([5, 5], np.float32)})["y"], [15, 25])
    loaded = compiler.load(artifact.save(tmp_path / "m.tessel"))
    np.testing.assert_array_equal(loaded.run({"x": X})["y"], [11, 22])


def test_cli_run_takes_inputs_without_the_defaulted_one_and_checks_against_onnxruntime(tmp_path):
    _defaulted_model(tmp_path / "m.onnx")
    assert _cli("compile", "m.onnx", "-o", "m.tessel", cwd=tmp_path).returncode == 0
    np.savez(tmp_path / "in.npz", x=X)
    np.savez(tmp_path / "override.npz", x=X, w=np.array([5, 5], np.float32))
    for inputs, low in (("in.npz", "11"), ("override.npz", "15")):
        result = _cli("run", "m.tessel", "--inputs", inputs, "--check", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert f"y: float32[2] min {low}" in result.stdout and "check: ok" in result.stdout


def test_cli_refuses_an_opset_newer_than_known_in_one_line(tmp_path):
    m = model([helper.make_node("Relu", ["x"], ["y"])], [("x", F, [2])], [("y", F, [2])], opset=999)
    onnx.save(m, tmp_path / "new.onnx")
    result = _cli("compile", "new.onnx", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("tessel: ") and result.stderr.count("\n") == 1
    assert "opset 999; the newest Tessel reads is" in result.stderr
    assert not (tmp_path / "out").exists()
