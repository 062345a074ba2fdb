"""What the `tessel` commands print: a line per compile stage without a terminal, -q and -v, --json documents on
stdout, and a report that covers every worker."""
from __future__ import annotations

import json

import onnx
import pytest
from onnx import helper

from tessel.compiler.api import compile as compile_model
from tessel.compiler.cli import main
from tests.ir.helpers import F, model

STAGES = ("imported:", "passes:", "kernels:", "placement:")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "add.onnx"
    onnx.save(model([helper.make_node("Add", ["x", "x"], ["y"], name="add")], [("x", F, [4, 8])], [("y", F, [4, 8])]),
              str(path))
    return path


@pytest.fixture(scope="module")
def two_workers(model_path, kernel_cache, tmp_path_factory):
    return compile_model(str(model_path), cache_dir=kernel_cache, devices=2, placement="pipeline", microbatches=2,
                         profile=False).save(tmp_path_factory.mktemp("art") / "add2")


@pytest.fixture
def cached(kernel_cache, monkeypatch):
    """The CLI compiles into the test session's kernel cache (the cache root is its parent)."""
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(kernel_cache.parent))


def test_compile_prints_one_line_per_stage_without_a_terminal(model_path, tmp_path, capsys, cached):
    assert main(["compile", str(model_path), "-o", str(tmp_path / "a")]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert [line.split()[0] for line in lines] == list(STAGES), captured.err
    assert captured.out.startswith("compiled ")


def test_quiet_compile_prints_only_the_result(model_path, tmp_path, capsys, cached):
    assert main(["compile", str(model_path), "-o", str(tmp_path / "a"), "-q"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.startswith("compiled ")


def test_compile_json_is_the_only_thing_on_stdout(model_path, tmp_path, capsys, cached):
    assert main(["compile", str(model_path), "-o", str(tmp_path / "a"), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["artifact"] == str(tmp_path / "a") and len(document["sha256"]) == 64
    assert document["report"]["kernels"] == 1


def test_run_json_holds_outputs_latency_and_check(model_path, kernel_cache, tmp_path, capsys):
    artifact = compile_model(str(model_path), cache_dir=kernel_cache, keep_model=True).save(tmp_path / "a")
    assert main(["run", str(artifact), "--json", "--repeat", "2", "--check", "--input-value", "x=1.5"]) == 0
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert document["outputs"]["y"] == {"dtype": "float32", "shape": [4, 8], "min": 3.0, "max": 3.0}
    assert document["latency"]["runs"] == 2 and document["check"]["ok"] is True
    assert captured.err == ""  # every input was given: no note about random ones


def test_report_covers_every_worker(two_workers, capsys):
    assert main(["report", str(two_workers)]) == 0
    text = capsys.readouterr().out
    assert "# Device 0" in text and "# Device 1" in text and text.count("# Memory") == 2
    assert main(["report", str(two_workers), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [m["device"] for m in document["memory"]] == [0, 1] and "arena_bytes" in document["memory"][1]
    assert document["placement"]["planner"] == "pipeline" and document["compile"]["devices"] == 2
