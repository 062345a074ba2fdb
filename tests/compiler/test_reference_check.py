"""`tessel run --check` finds its reference model: --reference, the artifact's kept copy, or the file it was
compiled from while unchanged; otherwise one line says how to give it, before anything runs."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tessel.backends.cpu.bf16 import cpu_has_bf16
from tessel.compiler.api import compile as compile_model
from tessel.compiler.cli import main
from tessel.compiler.reference_check import BF16_SCALED_TOL, Tolerance, compare
from tests.ir.helpers import F, model


def _save_model(path: Path, scale: float = 1.0) -> Path:
    """y = Relu(x @ w) with w = scale * I, x float32[1,4]."""
    w = scale * np.eye(4, dtype=np.float32)
    onnx.save(model([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["y"], name="r")],
                    [("x", F, [1, 4])], [("y", F, [1, 4])], [("w", w)]), str(path))
    return path


@pytest.fixture
def compiled(tmp_path, kernel_cache) -> tuple[Path, Path]:
    """(the model file, its artifact compiled without --keep-model)."""
    path = _save_model(tmp_path / "m.onnx")
    return path, compile_model(str(path), cache_dir=kernel_cache).save(tmp_path / "m.tessel")


def _refused(capsys, argv: list[str], *expected: str) -> None:
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2 and captured.err.count("\n") == 1 and captured.err.startswith("tessel: error: "), captured.err
    assert all(text in captured.err for text in expected), captured.err
    assert "y:" not in captured.out  # refused before the run


def test_check_compares_with_the_file_the_artifact_was_compiled_from(compiled, capsys):
    assert main(["run", str(compiled[1]), "--check"]) == 0
    assert "check: ok" in capsys.readouterr().out


def test_check_without_the_model_file_says_how_to_give_it(compiled, tmp_path, capsys):
    path, artifact = compiled
    moved = Path(shutil.move(path, tmp_path / "elsewhere.onnx"))
    _refused(capsys, ["run", str(artifact), "--check"], "is gone", "--keep-model", "--reference MODEL.onnx")
    assert main(["run", str(artifact), "--reference", str(moved)]) == 0
    assert "check: ok" in capsys.readouterr().out
    _refused(capsys, ["run", str(artifact), "--reference", str(tmp_path / "none.onnx")], "no such file")


def test_check_refuses_a_model_file_changed_since_compiling(compiled, capsys):
    path, artifact = compiled
    _save_model(path, scale=2.0)
    _refused(capsys, ["run", str(artifact), "--check"], "has changed since", "--reference MODEL.onnx")


def test_check_uses_the_kept_copy_when_the_file_is_gone(tmp_path, kernel_cache, capsys):
    path = _save_model(tmp_path / "k.onnx")
    artifact = compile_model(str(path), cache_dir=kernel_cache, keep_model=True).save(tmp_path / "k.tessel")
    path.unlink()
    assert main(["run", str(artifact), "--check"]) == 0
    assert "check: ok" in capsys.readouterr().out


def test_check_re_batches_the_file_as_the_artifact_was_compiled(tmp_path, kernel_cache, capsys):
    path = _save_model(tmp_path / "b.onnx")
    artifact = compile_model(str(path), cache_dir=kernel_cache, batch=3).save(tmp_path / "b.tessel")
    assert main(["run", str(artifact), "--check"]) == 0
    out = capsys.readouterr().out
    assert "y: float32[3,4]" in out and "check: ok" in out


def test_check_of_an_artifact_compiled_from_a_model_in_memory_needs_the_model(tmp_path, kernel_cache, capsys):
    path = _save_model(tmp_path / "p.onnx")
    artifact = compile_model(onnx.load(str(path)), cache_dir=kernel_cache).save(tmp_path / "p.tessel")
    _refused(capsys, ["run", str(artifact), "--check"], "no record of its file", "--keep-model")
    assert main(["run", str(artifact), "--reference", str(path)]) == 0


def test_a_bf16_artifact_is_checked_against_its_output_scale():
    want = np.array([10.0, 0.01, -4.0], np.float32)
    got = want + np.array([0.05, 0.05, 0.0], np.float32)  # 0.5% of the largest magnitude; 5x the small element
    assert not compare(got, want).ok  # float32's rtol/atol
    rtol, atol = Tolerance(scaled=BF16_SCALED_TOL).bounds(want.astype(np.float64))
    result = compare(got, want, rtol, atol)
    assert result.ok and abs(result.max_relative - 0.005) < 1e-6
    assert not compare(want + np.float32(0.2), want, rtol, atol).ok  # 2% of the scale


@pytest.mark.skipif(not cpu_has_bf16(), reason="the CPU lacks avx512_bf16")
def test_check_of_a_bf16_artifact_states_its_tolerance(tmp_path, kernel_cache, capsys):
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1] * 4)]
    path = tmp_path / "conv.onnx"
    onnx.save(model(nodes, [("x", F, [1, 16, 8, 8])], [("y", F, None)],
                    [("w", rng.standard_normal((32, 16, 3, 3)).astype(np.float32))]), str(path))
    artifact = compile_model(str(path), precision="bf16", cache_dir=kernel_cache).save(tmp_path / "conv.tessel")
    assert main(["run", str(artifact), "--check"]) == 0
    out = capsys.readouterr().out
    assert "check: ok" in out and "bf16 artifact: within 0.01 x the output's largest magnitude" in out
    assert "of the output's largest magnitude)" in out  # each output's relative error
