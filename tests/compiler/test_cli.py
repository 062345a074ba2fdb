"""`tessel inspect` and the CLI's handling of bad input."""
from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys

import onnx
import pytest
from onnx import helper

from tessel.compiler.cli import main, parse_input_shape
from tessel.compiler.model_summary import summarize
from tessel.ir.errors import ShapeBindingError
from tests.conftest import CORPUS, by_name
from tests.ir.helpers import F, model


def _initializer_elements(graph: onnx.GraphProto) -> int:
    total = sum(math.prod(t.dims) for t in graph.initializer)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                total += _initializer_elements(attr.g)
    return total


@pytest.mark.parametrize("entry", by_name(CORPUS))
def test_inspect_parameters_equal_initializer_elements(entry):
    report = summarize(entry.path, entry.input_shapes)
    proto = onnx.load(str(entry.path), load_external_data=False)
    assert report["parameters"]["elements"] == _initializer_elements(proto.graph)
    if entry.negative:
        assert report["unsupported"]
    else:
        assert report["flops"] > 0 and report["activation_memory_lower_bound"]["bytes"] > 0
        assert [i["name"] for i in report["inputs"]] == list(entry.input_shapes)


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tessel.compiler.cli", *args], capture_output=True, text=True, timeout=120)


def test_inspect_json_on_a_corpus_model():
    entry = next(m for m in CORPUS if m.name == "ppocr_v4_det")
    result = _run_cli("inspect", str(entry.path), "--input-shape", "x=1x3x64x64", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["inputs"] == [{"name": "x", "dtype": "float32", "shape": [1, 3, 64, 64]}]
    assert report["ops"]["Conv"] > 0 and report["unsupported"] == []


def test_inspect_unsupported_model_lists_ops_and_exits_2():
    entry = next(m for m in CORPUS if m.name == "unsupported_ml")
    result = _run_cli("inspect", str(entry.path))
    assert result.returncode == 2
    assert "LinearClassifier" in result.stdout and "ZipMap" in result.stdout
    assert result.stderr.count("\n") == 1 and "ai.onnx.ml" in result.stderr


def _bad_inputs(tmp_path):
    good = model([helper.make_node("Relu", ["x"], ["y"])], [("x", F, [1, "n"])], [("y", F, None)])
    data = good.SerializeToString()
    text = tmp_path / "text.onnx"
    text.write_text("hello, I am not a model\n")
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(data[: len(data) - 7])
    valid = tmp_path / "valid.onnx"
    valid.write_bytes(data)
    cyclic = tmp_path / "cyclic.onnx"
    cyclic_model = model([helper.make_node("Add", ["x", "b"], ["a"]), helper.make_node("Relu", ["a"], ["b"])],
                         [("x", F, [1, 2])], [("b", F, None)])
    cyclic.write_bytes(cyclic_model.SerializeToString())
    return {
        "missing file": ([str(tmp_path / "absent.onnx")], "no such file"),
        "not onnx": ([str(text)], "not"),
        "truncated": ([str(truncated)], "truncated.onnx"),
        "directory": ([str(tmp_path)], "directory"),
        "bad shape syntax": ([str(valid), "--input-shape", "x=1xQ"], "bad --input-shape"),
        "bad shape name": ([str(valid), "--input-shape", "z=1x2"], "model's inputs are 'x'"),
        "missing binding": ([str(valid)], "axis 1 is symbolic"),
        "cycle": ([str(cyclic)], "cycle"),
        "unknown flag": ([str(valid), "--frobnicate"], "unrecognized arguments"),
    }


@pytest.mark.parametrize("case", ["missing file", "not onnx", "truncated", "directory", "bad shape syntax",
                                  "bad shape name", "missing binding", "cycle", "unknown flag"])
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    args, expected = _bad_inputs(tmp_path)[case]
    with pytest.raises(SystemExit) if case == "unknown flag" else contextlib.nullcontext():
        code = main(["inspect", *args])
        assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err and expected in err


def test_input_shape_parsing():
    assert parse_input_shape("x=1x3x224x224") == ("x", (1, 3, 224, 224))
    assert parse_input_shape("gpu_0/data_0=1x3") == ("gpu_0/data_0", (1, 3))
    assert parse_input_shape("sr=") == ("sr", ())
    with pytest.raises(ShapeBindingError):
        parse_input_shape("1x3")


def test_compile_then_run_with_check(tmp_path, tessel_cache, monkeypatch):
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tessel_cache))
    entry = next(m for m in CORPUS if m.name == "mtcnn_rnet")
    out = tmp_path / "rnet"
    shape = "x".join(map(str, entry.input_shapes["input_2"]))
    compiled = _run_cli("compile", str(entry.path), "-o", str(out), "--input-shape", f"input_2={shape}",
                        "--dump-after", "simplify", "--dump-after", "fuse", "--verify")
    assert compiled.returncode == 0, compiled.stderr
    import json

    import onnx
    for name in ("simplify", "fuse"):
        assert (out / "reports" / f"after_{name}.txt").is_file()
        onnx.checker.check_model(onnx.load(str(out / "reports" / f"after_{name}.onnx")), full_check=True)
    passes = json.loads((out / "reports" / "compile.json").read_text())["passes"]
    assert [p["name"] for p in passes] == ["simplify", "split_variadic", "constant_fold", "one_hot_gather",
                                              "pool_taps", "cse", "dce", "pool_concat", "batch_gemms",
                                              "fuse"]
    assert passes[-1]["kernels_after"] < passes[-1]["kernels_before"]
    inputs = tmp_path / "in.npz"
    import numpy as np
    np.savez(inputs, **entry.make_inputs())
    ran = _run_cli("run", str(out), "--inputs", str(inputs), "--outputs", str(tmp_path / "out.npz"), "--check", "--repeat", "2")
    assert ran.returncode == 0, ran.stderr
    assert "check: ok" in ran.stdout and "latency over 2 runs" in ran.stdout
    assert (tmp_path / "out.npz").is_file()

    again = _run_cli("compile", str(entry.path), "-o", str(out), "--input-shape", f"input_2={shape}")
    assert again.returncode == 2 and "already exists" in again.stderr and again.stderr.count("\n") == 1
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, input_2=np.zeros((1, 24, 24, 4), np.float32))
    bad = _run_cli("run", str(out), "--inputs", str(wrong))
    assert bad.returncode == 2 and "input 'input_2' is float32[1,24,24,4]" in bad.stderr
    assert "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1
    next((out / "kernels").glob("*.so")).unlink()
    broken = _run_cli("run", str(out), "--inputs", str(inputs))
    assert broken.returncode == 2 and "missing from the artifact" in broken.stderr


def test_run_on_a_missing_artifact_is_one_line(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such artifact directory" in err


def test_unknown_pass_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compile", "model.onnx", "-o", str(tmp_path / "out"), "--skip-pass", "nosuchpass"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nosuchpass" in err and not (tmp_path / "out").exists()
